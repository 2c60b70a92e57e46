"""LLM.embed / LLM.encode on a pooling engine (--runner pooling, --convert embed): the
pooled final-norm hidden state equals transformers' on tiny models (last and mean
pooling, sentence-transformers config), runs on the default GGUF model, frees its KV
blocks, and the wrong engine or input is a clear error."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from pagellm import LLM, PoolingParams, SamplingParams

TEXTS = ["Hello world", "The capital of France is Paris, a city on the Seine.",
         " ".join(["a long prompt that runs in several chunks"] * 6)]


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def _with_sentence_transformers(model_dir: str, tmp_path, mode: str, normalize: bool) -> str:
    """A copy of model_dir with modules.json and 1_Pooling/config.json, as
    sentence-transformers saves them."""
    out = str(tmp_path / f"st-{mode}")
    shutil.copytree(model_dir, out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(out, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(out, "1_Pooling"))
    modes = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": mode == "mean",
             "pooling_mode_lasttoken": mode == "last"}
    with open(os.path.join(out, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 0, **modes}, f)
    return out


def _reference(model_dir: str, token_ids: list[int], mode: str, normalize: bool) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0]
    vec = hidden.mean(0) if mode == "mean" else hidden[-1]
    if normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec.numpy()


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("mode", ["last", "mean"])
def test_embeddings_equal_transformers(tiny_model, tmp_path, monkeypatch, family: str, mode: str) -> None:
    """Float path: cosine >= 0.99999 against transformers' last hidden state pooled, with
    the pooling and normalisation read from the sentence-transformers files; a prompt
    longer than the token budget runs in chunks (mean pooling sums across them); every
    KV block is free afterwards."""
    monkeypatch.setenv("PAGELLM_CHECK_INVARIANTS", "1")
    model_dir = _with_sentence_transformers(tiny_model(family), tmp_path, mode, normalize=True)
    llm = LLM(model_dir, runner="pooling", multiprocess_mode=False, dtype="float32",
              max_model_len=128, max_num_batched_tokens=32, block_size=16)
    try:
        outs = llm.embed(TEXTS, use_tqdm=False)
        assert len(outs[-1].prompt_token_ids) > 32  # runs in two chunks
        for out in outs:
            ref = _reference(model_dir, out.prompt_token_ids, mode, normalize=True)
            emb = out.outputs.embedding
            assert isinstance(emb, list) and len(emb) == len(ref)
            assert _cos(emb, ref) >= 0.99999
            assert abs(np.linalg.norm(emb) - 1.0) < 1e-5
        unnormalised = llm.embed(TEXTS[0], PoolingParams(normalize=False), use_tqdm=False)[0]
        ref = _reference(model_dir, unnormalised.prompt_token_ids, mode, normalize=False)
        np.testing.assert_allclose(unnormalised.outputs.embedding, ref, rtol=1e-4, atol=1e-4)
        pool = _core(llm).scheduler.kv_cache_manager.block_pool
        pool.check_invariants()
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
    finally:
        llm.shutdown()


def test_no_sentence_transformers_config_means_last_token_normalised(tiny_model) -> None:
    model_dir = tiny_model("llama")
    llm = LLM(model_dir, convert="embed", multiprocess_mode=False, dtype="float32", max_model_len=128)
    try:
        out = llm.embed([TEXTS[1]], use_tqdm=False)[0]
        ref = _reference(model_dir, out.prompt_token_ids, "last", normalize=True)
        assert _cos(out.outputs.embedding, ref) >= 0.99999
        enc = llm.encode(TEXTS[1], use_tqdm=False)[0]
        assert enc.outputs.data.dtype == np.float32
        np.testing.assert_allclose(enc.outputs.data, out.outputs.embedding, rtol=1e-6)
    finally:
        llm.shutdown()


def test_embed_through_the_engine_core_process(tiny_model) -> None:
    """PoolingParams and the pooled bytes cross the process boundary (SyncMPClient)."""
    model_dir = tiny_model("llama")
    llm = LLM(model_dir, runner="pooling", dtype="float32", max_model_len=128)
    try:
        outs = llm.embed(TEXTS[:2], [PoolingParams(), PoolingParams(normalize=False)], use_tqdm=False)
        for out, normalize in zip(outs, (True, False)):
            ref = _reference(model_dir, out.prompt_token_ids, "last", normalize)
            np.testing.assert_allclose(out.outputs.embedding, ref, rtol=1e-4, atol=1e-5)
    finally:
        llm.shutdown()


def test_pooler_config_argument_picks_mean(tiny_model) -> None:
    model_dir = tiny_model("llama")
    llm = LLM(model_dir, runner="pooling", pooler_config={"pooling_type": "MEAN"},
              multiprocess_mode=False, dtype="float32", max_model_len=128)
    try:
        assert not llm.llm_engine.config.cache_config.enable_prefix_caching  # mean reads every token
        out = llm.embed(TEXTS[1], use_tqdm=False)[0]
        ref = _reference(model_dir, out.prompt_token_ids, "mean", normalize=True)
        assert _cos(out.outputs.embedding, ref) >= 0.99999
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def gguf_embedder():
    llm = LLM(convert="embed", multiprocess_mode=False, max_num_seqs=8)
    yield llm
    llm.shutdown()


def test_gguf_default_model_embeds_normalised_and_deterministic(gguf_embedder: LLM) -> None:
    """The default GGUF model (quantized path) under --convert embed: unit vectors of the
    hidden size, the same whether a text runs alone or batched with others, and no KV block
    left held."""
    batched = gguf_embedder.embed(TEXTS + ["Paris is in France."], use_tqdm=False)
    alone = gguf_embedder.embed(TEXTS[1], use_tqdm=False)[0]
    hidden = gguf_embedder.llm_engine.model_config.hidden_size
    for out in batched:
        assert len(out.outputs.embedding) == hidden
        assert abs(np.linalg.norm(out.outputs.embedding) - 1.0) < 1e-5
    assert _cos(alone.outputs.embedding, batched[1].outputs.embedding) > 0.9999
    again = gguf_embedder.embed(TEXTS[1], use_tqdm=False)[0]
    assert again.outputs.embedding == alone.outputs.embedding
    pool = _core(gguf_embedder).scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_wrong_engine_and_bad_input_are_errors_naming_the_cause(gguf_embedder: LLM, tiny_model) -> None:
    with pytest.raises(ValueError, match="--runner pooling / --convert embed"):
        gguf_embedder.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        gguf_embedder.embed("Hello", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        gguf_embedder.embed({"prompt_token_ids": []}, use_tqdm=False)
    max_len = gguf_embedder.llm_engine.model_config.max_model_len
    with pytest.raises(ValueError, match=f"maximum context length is {max_len} tokens"):
        gguf_embedder.embed({"prompt_token_ids": [1] * (max_len + 1)}, use_tqdm=False)
    pool = _core(gguf_embedder).scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    llm = LLM(tiny_model("llama"), multiprocess_mode=False, dtype="float32", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="start it with --runner pooling"):
            llm.embed("Hello", use_tqdm=False)
    finally:
        llm.shutdown()


def test_matryoshka_dimensions_cut_then_normalise(tiny_model, tmp_path) -> None:
    src = tiny_model("llama")
    model_dir = str(tmp_path / "matryoshka")
    shutil.copytree(src, model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["matryoshka_dimensions"] = [8, 16]
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    llm = LLM(model_dir, runner="pooling", multiprocess_mode=False, dtype="float32", max_model_len=64)
    try:
        full = llm.embed(TEXTS[0], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
        short = llm.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
        expect = np.asarray(full[:8]) / np.linalg.norm(full[:8])
        np.testing.assert_allclose(short, expect, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match=r"only supports \[8, 16\] matryoshka dimensions"):
            llm.embed(TEXTS[0], PoolingParams(dimensions=12), use_tqdm=False)
    finally:
        llm.shutdown()
