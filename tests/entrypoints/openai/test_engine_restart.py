"""An engine core killed under load (`kill -9`). With --restart-engine-on-failure the
server fails that engine's in-flight requests with 503 at once (a stream gets an error
event, then [DONE]), answers /health 503 while a new engine core starts, counts the
restart, and serves again; with data parallelism only the dead rank restarts and the
other rank's streams run on untouched. Without the flag the server exits with status 1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import psutil
import pytest

from pagellm.core.protocol import HEARTBEAT_INTERVAL_S
from tests.entrypoints.openai.conftest import ServerProcess

BODY = {"prompt": "Hello there", "max_tokens": 48, "ignore_eos": True, "temperature": 0}


def _auth(srv: ServerProcess) -> dict[str, str]:
    return {"Authorization": f"Bearer {srv.api_key}"}


def _long_model(tiny_model) -> str:
    """The tiny llama with a 2048-token context: streams long enough that none finishes
    before a test has seen them all running."""
    return tiny_model("llama", max_position_embeddings=2048)


def _engine_pids(srv: ServerProcess) -> dict[int, int]:
    """rank -> pid of each engine-core process under the server."""
    pids = {}
    for p in psutil.Process(srv.proc.pid).children(recursive=True):
        cmd = p.cmdline()
        if "pagellm.core.engine_core_proc" in cmd:
            pids[int(cmd[cmd.index("--rank") + 1])] = p.pid
    return pids


async def _stream(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed completion: its text chunks' count, its usage's completion tokens, its
    error (if any), the time the error arrived, and whether [DONE] closed it."""
    result: dict = {"chunks": 0, "tokens": None, "error": None, "error_at": None, "done": False}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                result["done"] = True
            elif "error" in (event := json.loads(data)):
                result["error"], result["error_at"] = event["error"], time.monotonic()
            elif event.get("usage"):
                result["tokens"] = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                result["chunks"] += 1
    return result


def _kill_under_load(srv: ServerProcess, pid: int, streams: int, max_tokens: int,
                     timeout: float) -> tuple[list[dict], float]:
    """`streams` streaming completions of `max_tokens` each, and SIGKILL of `pid` once the
    server runs them all: each stream's result (_stream) and the kill's monotonic time."""

    async def load_and_kill() -> tuple[list[dict], float]:
        async with httpx.AsyncClient(base_url=srv.url, headers=_auth(srv), timeout=timeout) as client:
            body = {**BODY, "max_tokens": max_tokens}
            tasks = [asyncio.create_task(_stream(client, body)) for _ in range(streams)]
            await asyncio.to_thread(srv.wait_running, streams)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*tasks), killed_at

    return asyncio.run(load_and_kill())


def _wait_healthy(srv: ServerProcess, within: float) -> float:
    """Seconds until /health is a plain 200 (every engine core serving)."""
    start = time.monotonic()
    while True:
        r = httpx.get(srv.url + "/health", timeout=5)
        if r.status_code == 200 and r.content == b"":
            return time.monotonic() - start
        assert time.monotonic() - start < within, f"/health stayed {r.status_code} {r.text}"
        time.sleep(0.05)


def test_kill_9_under_load_restarts_the_engine(tiny_model) -> None:
    srv = ServerProcess("--model", _long_model(tiny_model), "--max-model-len", "2048", "--restart-engine-on-failure")
    try:
        (old_pid,) = _engine_pids(srv).values()
        assert srv.metric("pagellm:engine_restarts_total") == 0

        # still running when the engine dies
        results, killed_at = _kill_under_load(srv, old_pid, streams=6, max_tokens=2000, timeout=60)
        for res in results:
            assert res["done"] and res["chunks"] < 2000 and res["tokens"] is None
            assert res["error"]["code"] == 503 and res["error"]["type"] == "ServiceUnavailableError"
            assert res["error"]["message"] == (
                "The engine core serving this request died (killed by SIGKILL) and is restarting; retry the request.")
            assert res["error_at"] - killed_at < 2

        # meanwhile: /health 503, and a new request is refused the same way
        health = httpx.get(srv.url + "/health")
        if health.status_code == 503:
            assert health.json()["error"]["message"] == "Engine core(s) [0] restarting after a failure."
            r = httpx.post(srv.url + "/v1/completions", json=BODY, headers=_auth(srv))
            assert r.status_code in (200, 503)  # 200 if the new core came up in between
            if r.status_code == 503:
                assert r.headers["retry-after"] == "5"
        _wait_healthy(srv, within=30)
        new_pids = _engine_pids(srv)
        assert list(new_pids) == [0] and new_pids[0] != old_pid
        assert srv.metric("pagellm:engine_restarts_total") == 1
        assert srv.metric("vllm:engine_restarts_total") == 1

        async def later() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, headers=_auth(srv), timeout=60) as client:
                return await asyncio.gather(*[client.post("/v1/completions", json=BODY) for _ in range(20)])

        for r in asyncio.run(later()):
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48
        assert srv.metric("pagellm:kv_cache_usage_perc") == 0
        assert srv.proc.poll() is None
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


def test_data_parallel_kill_of_one_rank_leaves_the_other_serving(tiny_model) -> None:
    # long streams: none may finish before all eight run (the kill comes after)
    srv = ServerProcess("--model", _long_model(tiny_model), "--max-model-len", "2048", "--data-parallel-size", "2",
                        "--restart-engine-on-failure")
    try:
        pids = _engine_pids(srv)
        assert sorted(pids) == [0, 1]

        async def load_and_kill() -> tuple[list[dict], dict]:
            async with httpx.AsyncClient(base_url=srv.url, headers=_auth(srv), timeout=120) as client:
                body = {**BODY, "max_tokens": 1500}
                streams = [asyncio.create_task(_stream(client, body)) for _ in range(8)]
                await asyncio.to_thread(srv.wait_running, 8)
                os.kill(pids[1], signal.SIGKILL)
                await asyncio.sleep(0.5)
                during = httpx.get(srv.url + "/health")
                return await asyncio.gather(*streams), {"status": during.status_code, "body": during.json()}

        results, during = asyncio.run(load_and_kill())
        # rank 0 keeps serving: /health stays 200 and names the restarting rank
        assert during == {"status": 200, "body": {"status": "degraded", "restarting_engines": [1]}}
        completed = [r for r in results if r["error"] is None]
        failed = [r for r in results if r["error"] is not None]
        # the balancer put 4 on each rank: rank 0's finish whole, rank 1's fail
        assert len(completed) == 4 and len(failed) == 4
        assert all(r["tokens"] == 1500 and r["done"] for r in completed)
        assert all(r["error"]["code"] == 503 and r["done"] for r in failed)
        assert srv.metric('pagellm:request_success_total{engine="0",finished_reason="length"') == 4
        _wait_healthy(srv, within=30)
        new = _engine_pids(srv)
        assert new[0] == pids[0] and new[1] != pids[1]
        assert srv.metric('pagellm:engine_restarts_total{engine="1"') == 1
        assert srv.metric('pagellm:engine_restarts_total{engine="0"') == 0
        for _ in range(4):  # both ranks serve again
            r = httpx.post(srv.url + "/v1/completions", json=BODY, headers=_auth(srv), timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48
    finally:
        srv.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_without_the_flag_a_dead_or_hung_engine_ends_the_server_with_status_1(tiny_model, sig) -> None:
    """SIGKILL: a death; SIGSTOP: a hang, which the watchdog (2 s) kills first."""
    srv = ServerProcess("--model", _long_model(tiny_model), "--max-model-len", "2048",
                        "--engine-iteration-timeout-s", "2")
    try:
        (pid,) = _engine_pids(srv).values()

        async def load_and_kill() -> list[dict]:
            async with httpx.AsyncClient(base_url=srv.url, headers=_auth(srv), timeout=60) as client:
                streams = [asyncio.create_task(_stream(client, {**BODY, "max_tokens": 2000})) for _ in range(2)]
                await asyncio.to_thread(srv.wait_running, 2)
                os.kill(pid, sig)
                return await asyncio.gather(*streams)

        for res in asyncio.run(load_and_kill()):
            assert res["error"]["code"] == 503 and res["done"]
        assert srv.proc.wait(timeout=30) == 1
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        srv.stop()


def test_a_stopped_engine_core_is_found_hung_killed_and_restarted(tiny_model) -> None:
    """SIGSTOP: the process neither dies nor sends a heartbeat. With a 3 s timeout the
    watchdog kills it, its streams end with the 503 event, /health reports the restart,
    and a new process serves."""
    srv = ServerProcess("--model", _long_model(tiny_model), "--max-model-len", "2048", "--restart-engine-on-failure",
                        "--engine-iteration-timeout-s", "3")
    try:
        (old_pid,) = _engine_pids(srv).values()

        async def load_and_stop() -> tuple[list[dict], float, dict]:
            async with httpx.AsyncClient(base_url=srv.url, headers=_auth(srv), timeout=60) as client:
                streams = [asyncio.create_task(_stream(client, {**BODY, "max_tokens": 2000})) for _ in range(4)]
                await asyncio.to_thread(srv.wait_running, 4)
                stopped_at = time.monotonic()
                os.kill(old_pid, signal.SIGSTOP)
                await asyncio.sleep(1)
                before = httpx.get(srv.url + "/health")  # stopped, not yet found hung
                results = await asyncio.gather(*streams)
                return results, stopped_at, {"status": before.status_code, "body": before.content}

        results, stopped_at, before = asyncio.run(load_and_stop())
        assert before == {"status": 200, "body": b""}
        for res in results:
            assert res["done"] and res["tokens"] is None
            assert res["error"]["code"] == 503
            assert res["error"]["message"].startswith(
                "The engine core serving this request died (hung: no heartbeat for 3 s) and is restarting")
            assert 3 - HEARTBEAT_INTERVAL_S < res["error_at"] - stopped_at < 3 + 5  # from the last heartbeat
        health = httpx.get(srv.url + "/health")
        if health.status_code == 503:  # the new core may already serve
            assert health.json()["error"]["message"] == "Engine core(s) [0] restarting after a failure."
        _wait_healthy(srv, within=30)
        assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
        (new_pid,) = _engine_pids(srv).values()
        assert new_pid != old_pid
        assert srv.metric("pagellm:engine_restarts_total") == 1
        r = httpx.post(srv.url + "/v1/completions", json=BODY, headers=_auth(srv), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48
    finally:
        srv.stop()
    assert srv.proc.returncode == 0

