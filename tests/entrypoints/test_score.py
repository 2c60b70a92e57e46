"""LLM.score on a pooling engine (a tiny random llama): a pair's score is the cosine of
LLM.embed's two vectors, for 1:1, 1:N and N:N pairs; each distinct text is embedded
once; truncate_prompt_tokens keeps each text's last tokens; unpairable lengths, empty
texts and a generate engine are errors naming the cause, and no KV block stays held."""

from __future__ import annotations

import numpy as np
import pytest

from pagellm import LLM, ScoringOutput, ScoringRequestOutput

QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Horses and cows are both animals", "Paris is in France."]
MAX_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = LLM(tiny_model("llama"), runner="pooling", multiprocess_mode=False, max_model_len=MAX_LEN)
    yield llm
    llm.shutdown()


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _embeddings(llm: LLM, texts: list[str]) -> dict[str, list[float]]:
    """LLM.embed's vectors of the distinct texts, embedded in one batch as score does."""
    distinct = list(dict.fromkeys(texts))
    return {t: o.outputs.embedding for t, o in zip(distinct, llm.embed(distinct, use_tqdm=False))}


def _free_blocks(llm: LLM) -> None:
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


@pytest.mark.parametrize(("data_1", "data_2", "pairs"), [
    (QUERY, DOCS[0], [(QUERY, DOCS[0])]),  # 1:1, strings
    ([QUERY], [DOCS[0]], [(QUERY, DOCS[0])]),  # 1:1, lists
    (QUERY, DOCS, [(QUERY, d) for d in DOCS]),  # 1:N
    ([QUERY], DOCS, [(QUERY, d) for d in DOCS]),  # 1:N, a list of one
    ([QUERY, DOCS[1], DOCS[2]], DOCS, [(QUERY, DOCS[0]), (DOCS[1], DOCS[1]), (DOCS[2], DOCS[2])]),  # N:N
], ids=["1:1", "1:1-lists", "1:N", "1:N-list", "N:N"])
def test_scores_are_the_cosine_of_the_embeddings(llm: LLM, data_1, data_2, pairs) -> None:
    outs = llm.score(data_1, data_2, use_tqdm=False)
    vectors = _embeddings(llm, [t for pair in pairs for t in pair])
    assert [type(o) for o in outs] == [ScoringRequestOutput] * len(pairs)
    assert all(isinstance(o.outputs, ScoringOutput) and o.finished for o in outs)
    np.testing.assert_allclose([o.outputs.score for o in outs], [_cos(vectors[a], vectors[b]) for a, b in pairs],
                               rtol=1e-6)
    tok = llm.get_tokenizer()
    for out, (a, b) in zip(outs, pairs):
        assert out.prompt_token_ids == tok.encode(a) + tok.encode(b)
    _free_blocks(llm)


def test_a_text_is_embedded_once_per_call(llm: LLM) -> None:
    """1:N against [d0, d1, d0]: three pairs, three requests (the query, d0, d1); a pair's
    request id joins its two embedding requests' ids, as vLLM's does."""
    q = next(llm._request_counter) + 1  # the next request's id
    outs = llm.score(QUERY, [DOCS[0], DOCS[1], DOCS[0]], use_tqdm=False)
    assert [o.request_id for o in outs] == [f"{q}_{q + 1}", f"{q}_{q + 2}", f"{q}_{q + 1}"]
    assert outs[0].outputs.score == outs[2].outputs.score
    assert next(llm._request_counter) == q + 3  # nothing else was added
    same = llm.score(QUERY, QUERY, use_tqdm=False)[0]
    assert same.request_id == f"{q + 4}_{q + 4}"
    assert same.outputs.score == pytest.approx(1.0, abs=1e-6)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    long_doc = " ".join(["the river Seine runs through Paris"] * 20)
    assert len(tok.encode(long_doc)) > MAX_LEN
    k = 10
    out = llm.score(QUERY, long_doc, truncate_prompt_tokens=k, use_tqdm=False)[0]
    ids_q, ids_d = tok.encode(QUERY)[-k:], tok.encode(long_doc)[-k:]
    assert out.prompt_token_ids == ids_q + ids_d
    ref = llm.embed([{"prompt_token_ids": ids_q}, {"prompt_token_ids": ids_d}], use_tqdm=False)
    np.testing.assert_allclose(out.outputs.score, _cos(ref[0].outputs.embedding, ref[1].outputs.embedding),
                               rtol=1e-6)
    whole = llm.score(QUERY, long_doc, truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert whole.prompt_token_ids == tok.encode(QUERY) + tok.encode(long_doc)[-MAX_LEN:]
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens value \(65\) is greater than max_model_len "
                                         r"\(64\)\. Please, select a smaller truncation size\.$"):
        llm.score(QUERY, long_doc, truncate_prompt_tokens=MAX_LEN + 1, use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.score(QUERY, long_doc, use_tqdm=False)
    _free_blocks(llm)


@pytest.mark.parametrize(("data_1", "data_2", "message"), [
    ([QUERY, DOCS[0]], DOCS, "Input lengths must be either 1:1, 1:N or N:N: data_1 has 2 texts and data_2 has 3."),
    (DOCS, [QUERY], "Input lengths must be either 1:1, 1:N or N:N: data_1 has 3 texts and data_2 has 1."),
    ([], DOCS, "data_1 is empty: give a string or a list of strings."),
    (QUERY, [], "data_2 is empty: give a string or a list of strings."),
    ("", DOCS, "data_1 is an empty string: each text must have at least one character."),
    (QUERY, [DOCS[0], ""], "data_2[1] is an empty string: each text must have at least one character."),
])
def test_bad_inputs_are_errors_naming_the_argument(llm: LLM, data_1, data_2, message: str) -> None:
    before = next(llm._request_counter)
    with pytest.raises(ValueError) as info:
        llm.score(data_1, data_2, use_tqdm=False)
    assert str(info.value) == message
    assert next(llm._request_counter) == before + 1  # nothing reached the engine
    _free_blocks(llm)


def test_score_on_a_generate_engine_is_an_error(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), multiprocess_mode=False, max_model_len=MAX_LEN)
    try:
        with pytest.raises(ValueError) as info:
            llm.score(QUERY, DOCS, use_tqdm=False)
        assert str(info.value) == (
            "This engine runs the model for generation; embeddings need a pooling engine: start it with "
            "--runner pooling (or --convert embed), LLM(model, runner='pooling') offline.")
    finally:
        llm.shutdown()
