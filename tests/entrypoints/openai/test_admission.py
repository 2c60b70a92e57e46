"""Serving under pressure and at its edges: admission control (503 + Retry-After past
--max-num-queued-requests), the API key on every API route, X-Request-Id, and a SIGTERM
that lets in-flight requests finish within --shutdown-timeout."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import psutil
import pytest

from tests.entrypoints.openai.conftest import ServerProcess


@pytest.fixture(scope="module")
def busy_server(tiny_model):
    srv = ServerProcess("--model", tiny_model("llama"), "--max-model-len", "128", "--max-num-seqs", "4",
                        "--max-num-queued-requests", "8", "--shutdown-timeout", "20")
    yield srv
    srv.stop()


def _auth(srv: ServerProcess) -> dict[str, str]:
    return {"Authorization": f"Bearer {srv.api_key}"}


def test_burst_past_the_queue_cap_gets_503_and_the_rest_complete(busy_server) -> None:
    srv = busy_server
    body = {"prompt": "Hello there", "max_tokens": 24, "ignore_eos": True, "temperature": 0}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, headers=_auth(srv), timeout=120) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(64)])

    responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(busy) == 64
    # 4 running + 8 waiting fit; every later arrival while they are in flight is refused
    assert 12 <= len(ok) < 64 and busy
    for r in ok:
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 24
    for r in busy:
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["type"] == "ServiceUnavailableError" and err["code"] == 503
        assert "--max-num-queued-requests 8" in err["message"]
    assert srv.metric("pagellm:num_requests_running") == 0
    # the slots came back: a later request is admitted
    later = httpx.post(srv.url + "/v1/completions", json=body, headers=_auth(srv), timeout=60)
    assert later.status_code == 200


def test_every_api_route_needs_the_key_and_errors_do_not_echo_it(busy_server) -> None:
    srv = busy_server
    for method, path, body in (("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                               ("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x"})):
        r = httpx.request(method, srv.url + path, json=body, headers={"Authorization": "Bearer wrong-key"})
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "AuthenticationError"
        assert "wrong-key" not in r.text and srv.api_key not in r.text
    assert httpx.post(srv.url + "/tokenize", json={"prompt": "hi"}, headers=_auth(srv)).status_code == 200
    for path in ("/health", "/metrics", "/version"):  # stay open
        assert httpx.get(srv.url + path).status_code == 200, path


def test_x_request_id_is_echoed_sanitized_and_used(busy_server) -> None:
    srv = busy_server
    headers = {**_auth(srv), "X-Request-Id": "abc-123<script>" + "x" * 300}
    r = httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200
    rid = "abc-123script" + "x" * (128 - len("abc-123script"))
    assert r.headers["x-request-id"] == rid
    assert r.json()["id"] == f"chatcmpl-{rid}"
    r = httpx.post(srv.url + "/v1/completions", headers={**_auth(srv), "X-Request-Id": "job-7"}, timeout=60,
                   json={"prompt": "hi", "max_tokens": 2})
    assert r.headers["x-request-id"] == "job-7" and r.json()["id"] == "cmpl-job-7"


def test_sigterm_lets_in_flight_requests_finish(tiny_model) -> None:
    # 1500-token requests: none may finish before the test has seen all three running
    srv = ServerProcess("--model", tiny_model("llama", max_position_embeddings=2048), "--max-model-len", "2048",
                        "--shutdown-timeout", "30")
    children = [c.pid for c in psutil.Process(srv.proc.pid).children(recursive=True)]
    body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, headers=_auth(srv), timeout=120) as client:
            tasks = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(3)]
            await asyncio.to_thread(srv.wait_running, 3)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    try:
        responses = asyncio.run(run())
        assert [r.status_code for r in responses] == [200, 200, 200]
        assert all(r.json()["usage"]["completion_tokens"] == 1500 for r in responses)
        assert srv.proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    finally:
        srv.stop()
