"""Schema fuzzing of the HTTP API (issue #16): schemathesis generates requests from the
server's own OpenAPI schema, valid ones and invalid ones, for every route of a real
`pagellm serve` on a tiny random model with a 64-token context. No case may get a 5xx or
hang; every 4xx body is OpenAI's error JSON; the engine is idle with its KV cache free
afterwards. Derandomized with a bounded number of cases, so CI sees the same requests."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.entrypoints.openai.conftest import ServerProcess

ROUTES = {
    # route: (valid cases, invalid cases); routes without parameters have one case each
    ("POST", "/v1/completions"): (70, 40),
    ("POST", "/v1/chat/completions"): (70, 40),
    ("POST", "/v1/responses"): (60, 30),
    ("GET", "/v1/responses/{response_id}"): (5, 0),  # any string is a valid id
    ("POST", "/v1/messages"): (50, 30),
    ("POST", "/v1/embeddings"): (20, 20),  # a 400 here (a generate server); fuzzed on a pooling one below
    ("POST", "/v1/score"): (10, 10),  # likewise; /score and the rerank paths are the same handlers
    ("POST", "/score"): (3, 3),
    ("POST", "/v1/rerank"): (10, 10),
    ("POST", "/rerank"): (3, 3),
    ("POST", "/v2/rerank"): (3, 3),
    ("POST", "/tokenize"): (30, 20),
    ("POST", "/detokenize"): (30, 20),
    ("GET", "/v1/models"): (1, 0),
    ("GET", "/health"): (1, 0),
    ("GET", "/metrics"): (1, 0),
    ("GET", "/version"): (1, 0),
}
REQUEST_TIMEOUT = 30.0
"""Seconds one request may take; a 64-token context generates in well under a second."""
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def srv(tiny_model):
    server = ServerProcess("--model", tiny_model("llama"), "--max-model-len", "64")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def schema(srv: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(srv.url + "/openapi.json")


def test_every_route_is_fuzzed(schema: Any) -> None:
    """A route added to the server joins ROUTES, so it is fuzzed too."""
    served = {(method.upper(), path) for path, item in schema.raw_schema["paths"].items()
              for method in item}
    assert served == set(ROUTES)


def _steer(body: Any, data: st.DataObject) -> None:
    """Half of the valid cases are made likelier to reach the engine: the schema cannot
    say that `model` must be a served name, that `suffix`/`best_of` are refused, that a
    message's role is one of a few, that token ids lie in the vocabulary, that a
    previous_response_id must name a stored response, or that texts to score are not
    empty, and without this almost every case would stop at one of those 4xx answers."""
    if not isinstance(body, dict) or not data.draw(st.booleans()):
        return
    for key in ("model", "suffix", "best_of"):
        body.pop(key, None)
    if not body.get("stream"):
        body.pop("stream_options", None)
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            message["role"] = data.draw(st.sampled_from(["system", "user", "assistant"]))
    body.pop("previous_response_id", None)  # a made-up id is always a 404
    if body.get("input") in ("", []):
        body["input"] = "Hello"
    body.pop("dimensions", None)  # the tiny model is no matryoshka model: always a 400
    inp = body.get("input")  # embeddings' token ids, one list or several
    if isinstance(inp, list) and inp and isinstance(inp[0], int):
        body["input"] = [abs(t) % 30000 for t in inp]
    elif isinstance(inp, list) and inp and all(isinstance(x, list) for x in inp):
        body["input"] = [[abs(t) % 30000 for t in x if isinstance(t, int)] or [1] for x in inp]
    prompt = body.get("prompt")
    if prompt == "" or prompt == []:
        body["prompt"] = "Hello"
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        body["prompt"] = [abs(t) % 30000 for t in prompt]
    # score and rerank: non-empty texts, one first text (1:N pairs always pair up)
    for key in ("text_1", "query"):
        if key in body:
            body[key] = "Hello"
    for key in ("text_2", "documents"):
        texts = body.get(key)
        if isinstance(texts, list):
            body[key] = [t for t in texts if isinstance(t, str) and t] or ["Hello"]
    body.pop("truncate_prompt_tokens", None)


def _check_error_body(response: Any, where: str) -> None:
    body = response.json()
    assert set(body) == {"error"}, where
    error = body["error"]
    assert set(error) == ERROR_FIELDS, where
    assert isinstance(error["message"], str) and error["message"], where
    assert isinstance(error["type"], str) and error["type"], where
    assert error["param"] is None or isinstance(error["param"], str), where
    assert error["code"] == response.status_code, where


def _check_stream(text: str, cut_short: bool, where: str) -> None:
    """An SSE body ends with [DONE] unless the client stopped reading (schemathesis reads
    a bounded number of events, then hangs up: the server must abort the request); an
    error event mid-stream is the caller's (4xx)."""
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events, where
    if not cut_short:
        assert events[-1] == "[DONE]", f"{where}: stream ends with {events[-2:]!r}"
    # a stream cut short may end inside an event
    for event in events[:-1] if cut_short else events:
        if event == "[DONE]":
            continue
        payload = json.loads(event)
        if "error" in payload:
            assert set(payload["error"]) == ERROR_FIELDS, f"{where}: {event}"
            assert 400 <= payload["error"]["code"] < 500, f"{where}: {event}"


def _check_response(case: Any, response: Any) -> None:
    where = f"{case.method} {case.path} body={case.body!r} -> {response.status_code} {response.text[:200]!r}"
    assert response.status_code < 500, where
    if response.status_code >= 400:
        _check_error_body(response, where)
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        _check_stream(response.text, response.stream_cut_short, where)


def _wait_idle(srv: ServerProcess, timeout: float = 30.0) -> None:
    """Polls /metrics until nothing runs or waits; aborted requests free their blocks
    a step after the abort, so an instant read could still see them."""
    deadline = time.monotonic() + timeout
    while True:
        busy = srv.metric("pagellm:num_requests_running") + srv.metric("pagellm:num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert srv.metric("pagellm:num_requests_running") == 0.0
    assert srv.metric("pagellm:num_requests_waiting") == 0.0
    assert srv.metric("pagellm:kv_cache_usage_perc") == 0.0


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("route", list(ROUTES), ids=lambda r: f"{r[0]} {r[1]}")
def test_fuzz_route(srv: ServerProcess, schema: Any, route: tuple[str, str], mode: GenerationMode) -> None:
    valid, invalid = ROUTES[route]
    examples = valid if mode is GenerationMode.POSITIVE else invalid
    if examples == 0:
        pytest.skip("a route without parameters has no invalid request")
    _fuzz(srv, schema, route, mode, examples)


@pytest.fixture(scope="module")
def pooling_srv(tiny_model):
    server = ServerProcess("--model", tiny_model("llama"), "--max-model-len", "64", "--convert", "embed")
    yield server
    server.stop()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize(("path", "examples"), [("/v1/embeddings", (60, 30)), ("/v1/score", (30, 20)),
                                                ("/v1/rerank", (30, 20))])
def test_fuzz_pooling_routes_on_a_pooling_server(pooling_srv: ServerProcess, path: str, examples: tuple[int, int],
                                                 mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(pooling_srv.url + "/openapi.json")
    _fuzz(pooling_srv, schema, ("POST", path), mode, examples[0] if mode is GenerationMode.POSITIVE else examples[1])


def _fuzz(srv: ServerProcess, schema: Any, route: tuple[str, str], mode: GenerationMode, examples: int) -> None:
    method, path = route
    strategy = schema[path][method].as_strategy(generation_mode=mode)
    headers = {"Authorization": f"Bearer {srv.api_key}"}

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        case = data.draw(strategy)
        if mode is GenerationMode.POSITIVE:
            _steer(case.body, data)
        response = case.call(base_url=srv.url, headers=headers, timeout=REQUEST_TIMEOUT)
        _check_response(case, response)

    fuzz()
    assert srv.proc.poll() is None, "the server died"
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    _wait_idle(srv)


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    # a top_k past the vocabulary keeps every token; it once overflowed the engine's wire
    ({"top_k": 10**23}, 200, None, None),
    ({"priority": 10**23}, 400, "priority",
     "Invalid value for 'priority': Input should be less than or equal to 9223372036854775807 "
     "(got 100000000000000000000000)."),
    # a constraint of the wrong type once killed the engine core, which could not decode it
    ({"structured_outputs": {"choice": "abc"}}, 400, "structured_outputs",
     "structured_outputs.choice must be a list, got 'abc'."),
    ({"structured_outputs": {"regex": 5}}, 400, "structured_outputs",
     "structured_outputs.regex must be a str, got 5."),
])
def test_found_by_fuzzing(srv: ServerProcess, body: dict, status: int, param: str | None,
                          message: str | None) -> None:
    response = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {srv.api_key}"},
                          json={"prompt": "Hello", "max_tokens": 2, **body}, timeout=REQUEST_TIMEOUT)
    assert response.status_code == status, response.text
    if status == 400:
        assert response.json() == {"error": {"message": message, "type": "BadRequestError",
                                             "param": param, "code": 400}}
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    _wait_idle(srv)


def test_undecodable_body_is_an_openai_error(srv: ServerProcess) -> None:
    """Found by fuzzing: a body that is not UTF-8 JSON got FastAPI's `{"detail": ...}`."""
    response = httpx.post(srv.url + "/v1/completions", content=b"\x0eo\x9f\x01@\x92",
                          headers={"Authorization": f"Bearer {srv.api_key}",
                                   "Content-Type": "application/json"}, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 400
    assert set(response.json()) == {"error"}
    assert set(response.json()["error"]) == ERROR_FIELDS
