"""Per-request caps as `pagellm serve` flags: past each one a request gets a 400 naming the
field and the cap (a body past --max-request-body-bytes a 413, before it is read to its
end), and a chat template a request brings (--trust-request-chat-template) is refused when
it reaches for Python's internals and stopped by the size and time bounds, with a 400
naming chat_template. One server with small caps on a tiny model serves the module."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.openai.conftest import ServerProcess

BODY_CAP = 4096
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(tiny_model) -> Iterator[ServerProcess]:
    server = ServerProcess("--model", tiny_model("llama"), "--max-model-len", "64", "--disable-ui",
                           "--max-n", "3", "--max-logprobs", "2", "--max-prompts-per-request", "2",
                           "--max-stop-strings", "2", "--max-stop-string-length", "8",
                           "--max-request-body-bytes", str(BODY_CAP), "--trust-request-chat-template")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(srv: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=30) as client:
        yield client


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


OVER_THE_CAP = [
    # (path, body past a cap, param, message)
    ("/v1/completions", {"prompt": "x", "n": 4}, "n", "n must be at most 3 on this server (--max-n), got 4."),
    ("/v1/chat/completions", {"messages": HI, "n": 4}, "n", "n must be at most 3 on this server (--max-n), got 4."),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, "logprobs",
     "logprobs must be at most 2 on this server (--max-logprobs), got 3."),
    ("/v1/completions", {"prompt": "x", "logprobs": 3, "echo": True}, "logprobs",
     "logprobs must be at most 2 on this server (--max-logprobs), got 3."),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 3}, "top_logprobs",
     "top_logprobs must be at most 2 on this server (--max-logprobs), got 3."),
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt",
     "prompt holds 3 prompts; this server takes at most 2 (--max-prompts-per-request)."),
    ("/v1/completions", {"prompt": [[1], [2], [3]]}, "prompt",
     "prompt holds 3 prompts; this server takes at most 2 (--max-prompts-per-request)."),
    ("/v1/chat/completions", {"messages": HI, "stop": ["a", "b", "c"]}, "stop",
     "stop holds 3 stop strings; this server takes at most 2 (--max-stop-strings)."),
    ("/v1/completions", {"prompt": "x", "stop": "123456789"}, "stop",
     "stop[0] is 9 characters long; this server takes stop strings of at most 8 characters "
     "(--max-stop-string-length)."),
]


def test_each_cap_is_a_400_naming_the_field_and_the_cap(http) -> None:
    for path, body, param, message in OVER_THE_CAP:
        err = _error(http.post(path, json={**body, "max_tokens": 2}), 400)
        assert (err["param"], err["message"], err["type"]) == (param, message, "BadRequestError"), body
        # the same request streamed is refused before its 200 goes out
        assert _error(http.post(path, json={**body, "max_tokens": 2, "stream": True}), 400)["param"] == param
    # at every cap at once: served
    r = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3, "logprobs": 2, "echo": True,
                                           "stop": ["12345678", "b"], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 6 and all(len(c["logprobs"]["top_logprobs"][-1]) <= 3 for c in choices)
    r = http.post("/v1/chat/completions", json={"messages": HI, "n": 3, "logprobs": True, "top_logprobs": 2,
                                                "max_tokens": 2, "chat_template": "{{ messages[0].content }}"})
    assert r.status_code == 200, r.text
    assert all(len(t["top_logprobs"]) == 2 for c in r.json()["choices"] for t in c["logprobs"]["content"])


def test_a_body_over_the_cap_is_a_413_whether_sized_or_chunked(http) -> None:
    big = b'{"prompt": "' + b"x" * BODY_CAP + b'"}'
    headers = {"content-type": "application/json"}
    err = _error(http.post("/v1/completions", content=big, headers=headers), 413)
    message = f"The request body is larger than this server's limit of {BODY_CAP} bytes (--max-request-body-bytes)."
    assert (err["message"], err["type"], err["param"]) == (message, "RequestTooLargeError", None)

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked, counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    err = _error(http.post("/v1/completions", content=chunks(), headers=headers), 413)
    assert err["message"] == message
    # /tokenize and the other routes share the cap; a body under it is served
    assert _error(http.post("/tokenize", content=big, headers=headers), 413)["message"] == message
    ok = http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}', headers=headers)
    assert ok.status_code == 200, ok.text


REFUSED_TEMPLATES = [
    # (template, what the message says)
    ("{{ ''.__class__.__mro__ }}", "tried to reach Python internals (attribute '__class__' of a 'str' object)"),
    ("{{ cycler.__init__.__globals__ }}", "tried to reach Python internals (attribute '__init__'"),
    ("{{ self._TemplateReference__context }}", "tried to reach Python internals (attribute '_TemplateReference"),
    ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "would build an output of over 1048"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit of 1 s"),
    ("{{ raise_exception('no system role here') }}", "TemplateError: no system role here"),
]


def test_request_templates_reaching_internals_or_past_the_bounds_are_refused(http) -> None:
    for i, (template, needle) in enumerate(REFUSED_TEMPLATES):
        kwargs = [{"chat_template_kwargs": {"chat_template": template}}] if i == 0 else []  # vLLM's other place
        for where in ({"chat_template": template}, *kwargs):
            err = _error(http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, **where}), 400)
            assert err["param"] == "chat_template" and err["message"].startswith("The chat template failed: ")
            assert needle in err["message"], err
    # the server still serves, and a template's text is never read as a file name
    r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "chat_template": "/etc/hostname"})
    assert r.status_code == 200, r.text
    ids = http.post("/tokenize", json={"prompt": "/etc/hostname", "add_special_tokens": False}).json()["tokens"]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_template_kwargs_may_not_set_the_requests_own_fields(http) -> None:
    body = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"tokenize": True, "tools": []}}
    err = _error(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "chat_template_kwargs"
    assert err["message"] == "chat_template_kwargs may not set tokenize, tools: the request's own fields do."
