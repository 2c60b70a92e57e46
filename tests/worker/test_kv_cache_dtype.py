"""--kv-cache-dtype: what `auto` resolves to, the bytes a block takes, bad values refused,
an engine on a float16 cache giving the float32 cache's greedy tokens on real text (the
exact path: float32 activations), and the q8_0 cache the int8 path takes where the C
attention reads it (the kernels themselves are tested in
tests/attention/test_paged_decode_kernel.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from pagellm import LLM, SamplingParams, kernels
from pagellm.engine.arg_utils import EngineArgs
from pagellm.worker.model_runner import ModelRunner

Q8_KV_HERE = kernels.simd_flags_available() and kernels.find_compiler() is not None
"""Whether this machine runs a q8_0 cache (the AVX2 attention kernels build here)."""


def _cache_dtype(**kw) -> str:
    return EngineArgs(max_model_len=256, **kw).create_engine_config().cache_config.cache_dtype


def test_auto_is_q8_0_on_the_int8_path_and_float32_on_the_exact_paths(tiny_model) -> None:
    # the default model on int8 rows: q8_0 where the AVX2 attention reads it, else float16
    assert _cache_dtype(gguf_activations="q8") == ("q8_0" if Q8_KV_HERE else "float16")
    assert _cache_dtype(gguf_activations="q8", block_size=32) == "float16"  # q8_0 needs blocks of 16
    assert _cache_dtype(gguf_activations="float32") == "float32"  # GGUF, exact
    assert _cache_dtype(model=tiny_model("llama")) == "float32"  # float weights
    assert _cache_dtype(gguf_activations="float32", kv_cache_dtype="bfloat16") == "bfloat16"
    assert _cache_dtype(gguf_activations="q8", kv_cache_dtype="float32") == "float32"


def test_block_bytes_by_cache_dtype() -> None:
    """float16 half of float32; q8_0 17 / 64 of it (32 int8 values and a float16 scale per
    32 dims: 34 bytes against float32's 128)."""
    sizes = {}
    for dtype in ("float32", "float16", "q8_0"):
        config = EngineArgs(max_model_len=256, kv_cache_dtype="float32").create_engine_config()
        config = dataclasses.replace(config, cache_config=dataclasses.replace(config.cache_config, cache_dtype=dtype))
        sizes[dtype] = ModelRunner(config).kv_bytes_per_block()
    m = config.model_config  # SmolLM2-135M: 30 layers, 3 KV heads of 64, 16 slots
    assert sizes["float32"] == 2 * m.num_layers * 16 * m.num_kv_heads * m.head_dim * 4 == 737280
    assert sizes["float16"] == sizes["float32"] // 2
    assert sizes["q8_0"] == 2 * m.num_layers * 16 * m.num_kv_heads * (64 + 4) == sizes["float32"] * 17 // 64


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "int8", "half"])
def test_other_values_are_refused_by_name(value: str) -> None:
    hint = " (fp8 caches are not supported)." if value.startswith("fp8") else "."
    with pytest.raises(ValueError) as err:
        EngineArgs(kv_cache_dtype=value).verify_args()
    assert str(err.value) == f"kv_cache_dtype must be one of auto, float32, float16, bfloat16, q8_0; got {value!r}{hint}"


@pytest.mark.parametrize("kw,why", [
    ({"block_size": 32}, "needs block_size 16 (got 32)"),
    ({"dtype": "bfloat16", "quantization": "none"}, "needs float32 activations (dtype bfloat16)"),
])
def test_q8_0_is_refused_where_the_c_attention_cannot_read_it(kw: dict, why: str) -> None:
    with pytest.raises(ValueError) as err:
        _cache_dtype(kv_cache_dtype="q8_0", **kw)
    assert str(err.value) == f"kv_cache_dtype q8_0 {why}."


@pytest.mark.skipif(not Q8_KV_HERE, reason="no AVX2 attention kernels here: q8_0 is refused (tested above)")
def test_q8_0_cache_serves_the_default_model() -> None:
    """The default `LLM()` on this machine: a q8_0 cache (int8 storage, rows of 64 + 4
    bytes), the answer to a factual question unchanged, and the same greedy tokens for a
    prompt alone, batched with another, and again after a prefix-cache hit."""
    llm = LLM(max_model_len=512, multiprocess_mode=False)
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_runner
        assert {(t.dtype, t.shape[-1]) for kv in runner.kv_caches for t in kv} == {(torch.int8, 68)}
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        story = "Once upon a time, in a small village by the sea, there lived"
        alone = llm.generate([story], params, use_tqdm=False)[0].outputs[0].token_ids
        both = llm.generate(["The capital of France is", story], params, use_tqdm=False)
        again = llm.generate([story], params, use_tqdm=False)[0].outputs[0].token_ids
        assert both[1].outputs[0].token_ids == alone == again
        assert "Paris" in both[0].outputs[0].text
    finally:
        llm.shutdown()


def test_the_cli_flag() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "float16"])).kv_cache_dtype == "float16"
    assert EngineArgs.from_cli_args(parser.parse_args([])).kv_cache_dtype == "auto"


def test_float16_cache_keeps_the_exact_paths_greedy_tokens() -> None:
    """Float32 activations on the default model, the cache float16 against float32: the
    same 24 greedy tokens (on real text the float16 cache's top-1 token equalled the float32
    cache's at all 3528 positions of tests/data/public_domain_english.txt)."""
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens, dtypes = {}, {}
    for dtype in ("float32", "float16"):
        llm = LLM(gguf_activations="float32", kv_cache_dtype=dtype, max_model_len=256,
                  multiprocess_mode=False)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[dtype] = [o.outputs[0].token_ids for o in outs]
            runner = llm.llm_engine.engine_core.engine_core.model_runner
            dtypes[dtype] = {str(t.dtype) for kv in runner.kv_caches for t in kv}
        finally:
            llm.shutdown()
    assert dtypes == {"float32": {"torch.float32"}, "float16": {"torch.float16"}}
    assert tokens["float16"] == tokens["float32"]
    assert all(len(t) == 24 for t in tokens["float32"])
