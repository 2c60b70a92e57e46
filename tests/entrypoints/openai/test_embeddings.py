"""/v1/embeddings on `pagellm serve --convert embed` (a tiny random model) with the
official openai client: float and base64 decode to LLM.embed's vectors; the wrong engine,
empty input, input over the context and dimensions the model cannot give are 400s in
OpenAI's error shape that reach no engine and hold no KV block."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from pagellm import LLM
from tests.entrypoints.openai.conftest import ServerProcess

TEXTS = ["Hello world", "The capital of France is Paris."]
MAX_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def pooling_server(model_dir: str):
    srv = ServerProcess("--model", model_dir, "--convert", "embed", "--max-model-len", str(MAX_LEN))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(pooling_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=pooling_server.url + "/v1", api_key=pooling_server.api_key)


@pytest.fixture(scope="module")
def offline(model_dir: str) -> list[list[float]]:
    llm = LLM(model_dir, runner="pooling", multiprocess_mode=False, max_model_len=MAX_LEN)
    try:
        return [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    finally:
        llm.shutdown()


def _post(srv: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=30)


def _idle(srv: ServerProcess) -> None:
    assert srv.metric("pagellm:num_requests_running") == 0.0
    assert srv.metric("pagellm:kv_cache_usage_perc") == 0.0


def test_float_and_base64_equal_llm_embed(client: openai.OpenAI, offline: list, pooling_server) -> None:
    floats = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS)
    assert [d.index for d in floats.data] == [0, 1]
    for d, ref in zip(floats.data, offline):
        np.testing.assert_allclose(d.embedding, ref, rtol=1e-5, atol=1e-6)
    n_tokens = floats.usage.prompt_tokens
    assert n_tokens == floats.usage.total_tokens > 0
    raw = _post(pooling_server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}).json()
    for d, f in zip(raw["data"], floats.data):
        vec = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert vec.tolist() == list(np.asarray(f.embedding, dtype=np.float32))
    # the openai client asks for base64 by default and decodes it itself
    one = client.embeddings.create(model=floats.model, input=TEXTS[1])
    np.testing.assert_allclose(one.data[0].embedding, offline[1], rtol=1e-5, atol=1e-6)
    _idle(pooling_server)


def test_token_id_inputs(client: openai.OpenAI, model_dir: str, offline: list) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(TEXTS[0])
    for inp in (ids, [ids, ids]):
        out = client.embeddings.create(model=client.models.list().data[0].id, input=inp,
                                       encoding_format="float")
        for d in out.data:
            np.testing.assert_allclose(d.embedding, offline[0], rtol=1e-5, atol=1e-6)
        assert out.usage.prompt_tokens == len(ids) * len(out.data)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": []}, "input", "The input is empty: give a string, a list of strings or token ids."),
    ({"input": [[]]}, "input", "An input is empty: each must contain at least one token."),
    ({"input": [1] * (MAX_LEN + 1)}, "input",
     f"This model's maximum context length is {MAX_LEN} tokens. However, you requested {MAX_LEN + 1} "
     "tokens in the input for embedding generation. Please reduce the length of the input."),
    ({"input": "Hello", "dimensions": 8}, "dimensions",
     'Model "{name}" does not support matryoshka representation, changing output dimensions will lead '
     "to poor results."),
])
def test_bad_input_is_a_400(pooling_server: ServerProcess, client, body: dict, param: str, message: str) -> None:
    name = client.models.list().data[0].id
    response = _post(pooling_server, "/v1/embeddings", body)
    assert response.status_code == 400, response.text
    assert response.json() == {"error": {"message": message.format(name=name), "type": "BadRequestError",
                                         "param": param, "code": 400}}
    _idle(pooling_server)


def test_generation_on_a_pooling_server_is_a_400(pooling_server: ServerProcess) -> None:
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/responses", {"input": "Hi"})):
        response = _post(pooling_server, path, body)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert "--runner pooling / --convert embed" in error["message"], error
    _idle(pooling_server)


def test_embeddings_on_a_generate_server_is_a_400(model_dir: str) -> None:
    srv = ServerProcess("--model", model_dir, "--max-model-len", str(MAX_LEN))
    try:
        response = _post(srv, "/v1/embeddings", {"input": "Hello"})
        assert response.status_code == 400, response.text
        assert response.json() == {"error": {
            "message": "This engine runs the model for generation; embeddings need a pooling engine: start it "
                       "with --runner pooling (or --convert embed), LLM(model, runner='pooling') offline.",
            "type": "BadRequestError", "param": "model", "code": 400}}
        _idle(srv)
    finally:
        srv.stop()
