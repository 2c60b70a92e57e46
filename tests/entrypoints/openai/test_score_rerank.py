"""/score and /rerank on `pagellm serve --convert embed` (a tiny random model): scores
equal LLM.score's (the cosine of the two embeddings) under every path vLLM serves them
at; rerank orders the documents best first and cuts to top_n; empty texts, unpairable
lengths, a text over the context and the wrong engine are 400s in OpenAI's error shape
that reach no engine and hold no KV block."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from pagellm import LLM
from tests.entrypoints.openai.conftest import ServerProcess

QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Horses and cows are both animals", "Paris is in France.",
        "The capital of France is Paris."]  # the last repeats the first: embedded once
MAX_LEN = 64
LONG = " ".join(["the river Seine runs through Paris"] * 20)  # over MAX_LEN tokens


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def pooling_server(model_dir: str):
    srv = ServerProcess("--model", model_dir, "--convert", "embed", "--max-model-len", str(MAX_LEN))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir: str) -> dict[str, list[float]]:
    """LLM.score's values: 1:N (QUERY against DOCS) and N:N (DOCS[:3] against DOCS[1:])."""
    llm = LLM(model_dir, runner="pooling", multiprocess_mode=False, max_model_len=MAX_LEN)
    try:
        return {"1:N": [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)],
                "N:N": [o.outputs.score for o in llm.score(DOCS[:3], DOCS[1:], use_tqdm=False)]}
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def num_tokens(model_dir: str):
    """The prompt tokens of the distinct texts, each cut to its last `keep` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return lambda texts, keep=None: sum(min(len(tok.encode(t)), keep or MAX_LEN * 10) for t in dict.fromkeys(texts))


def _post(srv: ServerProcess, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=30,
                      headers={"Authorization": f"Bearer {srv.api_key}", **headers})


def _idle(srv: ServerProcess) -> None:
    assert srv.metric("pagellm:num_requests_running") == 0.0
    assert srv.metric("pagellm:kv_cache_usage_perc") == 0.0


def _model(srv: ServerProcess) -> str:
    return httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {srv.api_key}"}).json()["data"][0]["id"]


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score_equals_llm_score(pooling_server: ServerProcess, offline: dict, num_tokens, path: str) -> None:
    cases = [({"text_1": QUERY, "text_2": DOCS}, offline["1:N"], [QUERY, *DOCS]),
             ({"text_1": [QUERY], "text_2": DOCS}, offline["1:N"], [QUERY, *DOCS]),
             ({"text_1": QUERY, "text_2": DOCS[0]}, offline["1:N"][:1], [QUERY, DOCS[0]]),
             ({"text_1": DOCS[:3], "text_2": DOCS[1:]}, offline["N:N"], DOCS),
             ({"queries": DOCS[:3], "documents": DOCS[1:]}, offline["N:N"], DOCS)]  # vLLM's newer names
    for body, expected, texts in cases:
        response = _post(pooling_server, path, body)
        assert response.status_code == 200, response.text
        out = response.json()
        assert out["id"].startswith("score-") and len(out["id"]) == len("score-") + 32
        assert (out["object"], out["model"]) == ("list", _model(pooling_server))
        assert [(d["index"], d["object"]) for d in out["data"]] == [(i, "score") for i in range(len(expected))]
        np.testing.assert_allclose([d["score"] for d in out["data"]], expected, rtol=1e-5, atol=1e-6)
        n = num_tokens(texts)
        assert out["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}
    response = _post(pooling_server, path, {"text_1": QUERY, "text_2": DOCS[0]}, **{"X-Request-Id": "abc"})
    assert response.json()["id"] == "score-abc"
    assert httpx.post(pooling_server.url + path, json={"text_1": QUERY, "text_2": QUERY}).status_code == 401
    _idle(pooling_server)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_documents_best_first(pooling_server: ServerProcess, offline: dict, num_tokens,
                                            path: str) -> None:
    scores = offline["1:N"]
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    assert scores[0] == scores[3] and order.index(0) < order.index(3)  # a tie keeps the documents' order
    for top_n, cut in ((0, len(DOCS)), (2, 2), (10, len(DOCS)), (-1, len(DOCS))):
        response = _post(pooling_server, path, {"query": QUERY, "documents": DOCS, "top_n": top_n})
        assert response.status_code == 200, response.text
        out = response.json()
        assert out["id"].startswith("rerank-") and out["model"] == _model(pooling_server)
        assert out["usage"] == {"total_tokens": num_tokens([QUERY, *DOCS])}
        assert [r["index"] for r in out["results"]] == order[:cut]
        assert [r["document"] for r in out["results"]] == [{"text": DOCS[i]} for i in order[:cut]]
        np.testing.assert_allclose([r["relevance_score"] for r in out["results"]], [scores[i] for i in order[:cut]],
                                   rtol=1e-5, atol=1e-6)
    out = _post(pooling_server, path, {"query": QUERY, "documents": DOCS, "return_documents": False}).json()
    assert [r["document"] for r in out["results"]] == [None] * len(DOCS)
    assert httpx.post(pooling_server.url + path, json={"query": QUERY, "documents": DOCS}).status_code == 401
    _idle(pooling_server)


def test_truncate_prompt_tokens_lets_a_long_text_in(pooling_server: ServerProcess, num_tokens) -> None:
    """Each text keeps its last k tokens (-1: the context length), so a long one fits."""
    finished = pooling_server.metric("pagellm:request_success_total")
    for path, body in (("/v1/score", {"text_1": QUERY, "text_2": LONG}),
                       ("/v1/rerank", {"query": QUERY, "documents": [LONG]})):
        for k, keep in ((-1, MAX_LEN), (8, 8)):
            response = _post(pooling_server, path, {**body, "truncate_prompt_tokens": k})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["total_tokens"] == num_tokens([QUERY, LONG], keep)
    _idle(pooling_server)
    # one engine request per text: what test_bad_input_is_a_400 counts to see none reached it
    assert pooling_server.metric("pagellm:request_success_total") == finished + 8


CONTEXT = (f"This model's maximum context length is {MAX_LEN} tokens. However, you requested {{n}} tokens in "
           "the input for embedding generation. Please reduce the length of the input.")


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/score", {"text_1": [], "text_2": DOCS}, "text_1", "text_1 is empty: give a string or a list of strings."),
    ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2", "text_2 is empty: give a string or a list of strings."),
    ("/v1/score", {"text_1": QUERY, "text_2": [DOCS[0], ""]}, "text_2",
     "text_2[1] is an empty string: each text must have at least one character."),
    ("/v1/score", {"text_1": DOCS[:2], "text_2": DOCS}, "text_2",
     "Input lengths must be either 1:1, 1:N or N:N: text_1 has 2 texts and text_2 has 4."),
    ("/v1/score", {"text_1": QUERY, "text_2": [DOCS[0], LONG]}, "text_2", CONTEXT),
    ("/v1/score", {"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": MAX_LEN + 1},
     "truncate_prompt_tokens", "truncate_prompt_tokens value (65) is greater than max_model_len (64). Please, "
                               "select a smaller truncation size."),
    ("/v1/score", {"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be -1 (the context length) or a positive number of tokens, got 0."),
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents",
     "documents is empty: give a string or a list of strings."),
    ("/v1/rerank", {"query": "", "documents": DOCS}, "query",
     "query is an empty string: each text must have at least one character."),
    ("/v1/rerank", {"query": LONG, "documents": DOCS}, "query", CONTEXT),
], ids=["empty-text_1", "empty-text_2", "empty-string", "N:M", "too-long", "truncate-too-large", "truncate-0",
        "no-documents", "empty-query", "query-too-long"])
def test_bad_input_is_a_400(pooling_server: ServerProcess, num_tokens, path: str, body: dict, param: str,
                            message: str) -> None:
    finished = pooling_server.metric("pagellm:request_success_total")
    response = _post(pooling_server, path, body)
    assert response.status_code == 400, response.text
    message = message.format(n=num_tokens([LONG]))
    assert response.json() == {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
    assert pooling_server.metric("pagellm:request_success_total") == finished  # nothing reached the engine
    _idle(pooling_server)


def test_score_and_rerank_on_a_generate_server_are_400s(model_dir: str) -> None:
    srv = ServerProcess("--model", model_dir, "--max-model-len", str(MAX_LEN))
    try:
        for path in ("/v1/score", "/score"):
            response = _post(srv, path, {"text_1": QUERY, "text_2": DOCS})
            assert response.status_code == 400, response.text
            assert response.json() == {"error": {
                "message": "This engine runs the model for generation; embeddings need a pooling engine: start "
                           "it with --runner pooling (or --convert embed), LLM(model, runner='pooling') offline.",
                "type": "BadRequestError", "param": "model", "code": 400}}
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            response = _post(srv, path, {"query": QUERY, "documents": []})  # the engine is checked first
            assert response.status_code == 400, response.text
            assert "start it with --runner pooling (or --convert embed)" in response.json()["error"]["message"]
        _idle(srv)
    finally:
        srv.stop()
