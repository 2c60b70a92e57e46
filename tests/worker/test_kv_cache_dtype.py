"""--kv-cache-dtype: what `auto` resolves to, the bytes a block takes, bad values refused,
and an engine on a float16 cache giving the float32 cache's greedy tokens on real text
(the exact path: float32 activations; the kernels themselves are tested in
tests/attention/test_paged_decode_kernel.py)."""

from __future__ import annotations

import argparse

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.arg_utils import EngineArgs
from pagellm.worker.model_runner import ModelRunner


def _cache_dtype(**kw) -> str:
    return EngineArgs(max_model_len=256, **kw).create_engine_config().cache_config.cache_dtype


def test_auto_is_float16_on_the_int8_path_and_float32_on_the_exact_paths(tiny_model) -> None:
    assert _cache_dtype(gguf_activations="q8") == "float16"  # the default model, int8 rows
    assert _cache_dtype(gguf_activations="float32") == "float32"  # GGUF, exact
    assert _cache_dtype(model=tiny_model("llama")) == "float32"  # float weights
    assert _cache_dtype(gguf_activations="float32", kv_cache_dtype="bfloat16") == "bfloat16"
    assert _cache_dtype(gguf_activations="q8", kv_cache_dtype="float32") == "float32"


def test_a_float16_block_takes_half_the_bytes() -> None:
    sizes = {}
    for dtype in ("float32", "float16"):
        config = EngineArgs(max_model_len=256, kv_cache_dtype=dtype).create_engine_config()
        sizes[dtype] = ModelRunner(config).kv_bytes_per_block()
    m = config.model_config  # SmolLM2-135M: 30 layers, 3 KV heads of 64, 16 slots
    assert sizes["float32"] == 2 * m.num_layers * 16 * m.num_kv_heads * m.head_dim * 4 == 737280
    assert sizes["float16"] == sizes["float32"] // 2


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "int8", "half"])
def test_other_values_are_refused_by_name(value: str) -> None:
    hint = " (fp8 caches are not supported)." if value.startswith("fp8") else "."
    with pytest.raises(ValueError) as err:
        EngineArgs(kv_cache_dtype=value).verify_args()
    assert str(err.value) == f"kv_cache_dtype must be one of auto, float32, float16, bfloat16; got {value!r}{hint}"


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
