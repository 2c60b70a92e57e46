"""benchmarks/perplexity.py: llama-perplexity's chunking and scoring protocol, and its
pagellm part run on a tiny synthetic GGUF over a slice of the test text (--ctx 64)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.utils import import_benchmark

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "tests" / "data" / "public_domain_english.txt"


def _perplexity():
    return import_benchmark("perplexity")


def test_chunks_follow_llama_perplexity() -> None:
    ppl = _perplexity()
    ids = list(range(100, 100 + 2 * 64 + 40))  # 168 tokens: 2 whole chunks of 64, the rest dropped
    chunks = ppl.make_chunks(ids, 64, bos=None)
    assert chunks == [ids[:64], ids[64:128]]
    with_bos = ppl.make_chunks(ids, 64, bos=1)
    assert [c[0] for c in with_bos] == [1, 1] and [c[1:] for c in with_bos] == [c[1:] for c in chunks]
    assert ppl.scored_per_chunk(64) == 31 and ppl.scored_per_chunk(512) == 255  # n_ctx - n_ctx/2 - 1
    with pytest.raises(ValueError, match="at least 128"):
        ppl.make_chunks(ids[:127], 64, bos=None)
    log = ("perplexity: calculating perplexity over 6 chunks, n_ctx=512, batch_size=2048, n_seq=4\n"
           "[1]17.1,[2]18.0,\nFinal estimate: PPL = 19.7925 +/- 1.49931\n")
    assert ppl.parse_llama_perplexity(log) == {"perplexity": 19.7925, "plus_minus": 1.49931, "chunks": 6}


def test_perplexity_of_a_tiny_model(tmp_path: Path) -> None:
    """The pagellm part end to end: the JSON's keys, a finite perplexity above 1 for each
    activation path, and chunks x (ctx/2 - 1) scored tokens."""
    from pagellm.benchmarks.synthetic_gguf import SHAPES, write_llama_gguf
    from pagellm.model_executor.layers.quantization import q8_kernels_available
    from pagellm.model_executor.loader import default_model_path

    ppl = _perplexity()
    model = tmp_path / "tiny.gguf"
    write_llama_gguf(str(model), SHAPES["tiny"], "q4_k_m", vocab_from=default_model_path())
    text = tmp_path / "slice.txt"
    text.write_text(TEXT.read_text(encoding="utf-8")[:1000], encoding="utf-8")
    acts = "float32,q8" if q8_kernels_available() else "float32"
    out = tmp_path / "results"
    assert ppl.main(["--model", str(model), "--text", str(text), "--ctx", "64",
                     "--activations", acts, "--results-dir", str(out)]) == 0
    (path,) = out.glob("perplexity-*.json")
    data = json.loads(path.read_text())
    assert list(data) == list(ppl.RESULT_KEYS)
    assert data["ctx"] == 64 and data["chunks"] == data["tokens"] // 64 >= 2
    assert data["scored_tokens"] == data["chunks"] * 31 and data["add_bos"] is False
    assert list(data["pagellm"]) == acts.split(",")
    for act, r in data["pagellm"].items():
        assert set(r) == {"perplexity", "mean_nll", "scored_tokens", "seconds", "tokens_per_s",
                          "quantization", "gguf_activations", "kv_cache_dtype", "q8_head", "q8_decode_stack"}
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert r["perplexity"] == pytest.approx(math.exp(r["mean_nll"]))
        assert r["scored_tokens"] == data["scored_tokens"]
        assert r["quantization"] == "gguf" and r["gguf_activations"] == act
        assert r["q8_decode_stack"] == r["q8_head"] == (act == "q8")
        # the cache the engine gives the path: float32 on the exact one, q8_0 on int8 rows
        # where the AVX2 attention reads it (the tiny shape's heads: 32-dim multiples)
        assert r["kv_cache_dtype"] == ("float32" if act == "float32" else
                                       "q8_0" if q8_kernels_available() else "float16")
    if "q8" in data["pagellm"]:
        assert data["q8_over_float32"] == pytest.approx(
            data["pagellm"]["q8"]["perplexity"] / data["pagellm"]["float32"]["perplexity"])
        assert 0 < data["top1_agreement"] <= 1 and data["q8_over_float32_se"] > 0
    assert data["llama_perplexity"] is None
