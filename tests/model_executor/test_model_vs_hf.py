"""Model numerics against Hugging Face transformers on the same weights: greedy tokens of
the default GGUF model, and last-position logits of tiny random models of every family
(GQA, tied/untied embeddings, llama3 rope scaling, Mistral's sliding window, qkv bias, q/k
norm, explicit head_dim, Phi-3's fused checkpoint tensors, LongRoPE and partial rotary).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagellm.attention import get_attn_backend
from pagellm.engine.arg_utils import EngineArgs
from pagellm.model_executor.loader import get_model, load_tokenizer
from tests.utils import PagedRunner, make_model_config, token_ids

NEW_TOKENS = 64
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def longrope(rotary_dim: int) -> dict[str, Any]:
    """Phi-3's LongRoPE with distinct short and long divisors for each of the rotary_dim / 2
    frequencies. The tiny cases set original_max_position_embeddings 256 of 512 (factor
    2, attention factor sqrt(1 + ln 2 / ln 256)), above the tested lengths: there
    transformers' choice (short factors while the sequence fits) and pagellm's split by
    position (short below 256, long from 256 on) agree; test_phi3.py tests past it."""
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [1.5 + 0.9 * i for i in range(half)]}


@pytest.fixture(scope="module")
def gguf_pair(default_model_path: str) -> tuple[dict[str, Any], Any, Any]:
    """(pagellm model + config per quantization, HF model, tokenizer) for the default GGUF;
    HF load ~35 s. "none": dequantized to float32 at load; "gguf": the file's blocks on the
    exact path (float32 activations; the default int8 path is held to quality bounds
    against it instead: test_q8_quality.py)."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_model_path)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    ours = {}
    for quantization in ("none", "gguf"):
        mc = make_model_config(default_model_path,
                               quantization=None if quantization == "none" else quantization,
                               gguf_activations="float32")
        ours[quantization] = (get_model(mc, torch.device("cpu"), get_attn_backend("torch")), mc)
    return ours, hf.eval(), load_tokenizer(default_model_path)


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            min_new_tokens=n,
            max_new_tokens=n,
            pad_token_id=hf.config.eos_token_id,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "gguf"])
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_default_gguf_greedy_matches_transformers(
    gguf_pair: tuple[dict[str, Any], Any, Any], kind: str, quantization: str
) -> None:
    """Both weight paths, float32 dequantized at load and the quantized blocks (exact path:
    float32 activations), give transformers' greedy tokens."""
    models, hf, tok = gguf_pair
    ours, mc = models[quantization]
    if kind == "text":
        prompt = tok("The capital of France is")["input_ids"]
    else:
        messages = [{"role": "user", "content": "Write a haiku about paged memory."}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
    expected = _hf_greedy(hf, prompt, NEW_TOKENS)
    eos = hf.generation_config.eos_token_id
    got = PagedRunner(ours, mc).greedy(
        "s", prompt, NEW_TOKENS, banned=[eos] if isinstance(eos, int) else eos
    )
    assert got == expected, (
        f"first divergence at {next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)}"
    )


def _hf_last_logits(model_dir: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0, -1].float()


TINY_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-untied": ("qwen3", {"tie_word_embeddings": False}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "gemma3-untied": ("gemma3", {"tie_word_embeddings": False}),
    "phi3": ("phi3", {"sliding_window": 48}),  # a window on every layer, as Phi-3-mini's 2047
    "phi3-longrope": ("phi3", {"original_max_position_embeddings": 256, "rope_parameters": longrope(16)}),
    # Phi-4-mini: a quarter of each head's dims pass through unrotated, longrope, tied
    "phi4-partial": ("phi3", {"partial_rotary_factor": 0.75, "tie_word_embeddings": True,
                              "original_max_position_embeddings": 256, "rope_parameters": longrope(12)}),
    "qwen2-moe": ("qwen2_moe", {}),
    "qwen3-moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "mixtral-window": ("mixtral", {"sliding_window": 8}),
    "smollm3": ("smollm3", {}),
    "smollm3-window": ("smollm3", {"use_sliding_window": True, "sliding_window": 8}),
}


@pytest.mark.parametrize("case", list(TINY_CASES))
@pytest.mark.parametrize("length", [1, 7, 33, 130])
def test_tiny_model_logits_match_transformers(
    tiny_model: Callable[..., str], case: str, length: int
) -> None:
    family, overrides = TINY_CASES[case]
    model_dir = tiny_model(family, **overrides)
    prompt = token_ids(length)
    mc = make_model_config(model_dir)
    runner = PagedRunner(get_model(mc, torch.device("cpu"), get_attn_backend("torch")), mc)
    runner.add("s", prompt)
    logits = runner.step([("s", length)])
    expected = _hf_last_logits(model_dir, prompt)
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


def test_sliding_window_through_chunks_and_decodes_matches_transformers(
    tiny_model: Callable[..., str],
) -> None:
    """Window 12 over 44 tokens: a first chunk longer than the window, a chunk over cached
    blocks, then single-token decodes; every position's logits against HF's full pass."""
    model_dir = tiny_model("mistral", sliding_window=12)
    tokens = token_ids(44)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0].float()
    mc = make_model_config(model_dir)
    runner = PagedRunner(get_model(mc, torch.device("cpu"), get_attn_backend("torch")), mc)
    assert runner.builder.sliding_window == 12
    runner.add("s", tokens)
    done = 0
    for n in [20, 9] + [1] * 15:
        logits = runner.step([("s", n)])
        done += n
        torch.testing.assert_close(logits[0], expected[done - 1], atol=1e-4, rtol=0, msg=f"pos {done - 1}")


def test_non_positive_sliding_window_is_refused(tiny_model: Callable[..., str]) -> None:
    mc = make_model_config(tiny_model("mistral", sliding_window=0))
    with pytest.raises(ValueError, match="sliding_window must be a positive number of tokens, got 0"):
        get_model(mc, torch.device("cpu"), get_attn_backend("torch"))


def test_qwen_partial_sliding_window_is_refused(tiny_model: Callable[..., str]) -> None:
    mc = make_model_config(tiny_model("qwen2", use_sliding_window=True, sliding_window=16))
    with pytest.raises(ValueError, match="use_sliding_window=True .* is not supported"):
        get_model(mc, torch.device("cpu"), get_attn_backend("torch"))


def test_tiny_configs_exercise_their_feature(tiny_model: Callable[..., str]) -> None:
    """Guards the oracle: each case really has the property it claims to test."""
    from pagellm.model_executor.layers.rotary_embedding import get_rope_params

    mc = make_model_config(tiny_model("llama", rope_parameters=LLAMA3_ROPE))
    assert get_rope_params(mc.hf_config).rope_type == "llama3"
    untied = get_model(
        make_model_config(tiny_model("llama", tie_word_embeddings=False)), torch.device("cpu"),
        get_attn_backend("torch"),
    )
    assert untied.lm_head is not None
    # HF applies the window: without it the last logits of a 33-token prompt differ
    windowed = tiny_model("mistral", sliding_window=8)
    prompt = token_ids(33)
    full = tiny_model("mistral")  # same seed and weights, no window
    assert not torch.allclose(_hf_last_logits(windowed, prompt), _hf_last_logits(full, prompt), atol=1e-3)
    qwen3 = make_model_config(tiny_model("qwen3"))
    assert (
        qwen3.head_dim == 32 != qwen3.hf_config.hidden_size // qwen3.hf_config.num_attention_heads
    )


def _llama_cpp_freq_factors(head_dim: int, rope: dict[str, Any]) -> list[float]:
    """The `rope_freqs` tensor llama.cpp's converter writes for a llama3-scaled model:
    one divisor per inverse frequency (1 for short wavelengths, `factor` for long ones,
    interpolated between)."""
    import math

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def _write_llama_gguf(model_dir: str, out: str, freq_factors: list[float] | None,
                      metadata: dict[str, Any] | None = None, arch: str = "llama") -> str:
    """The tiny HF Llama as a float32 GGUF the way llama.cpp lays it out: GGUF tensor
    names, q/k rows permuted to interleaved pairs, llama3 rope scaling only as
    `rope_freqs`; `metadata` adds keys (str, float or int values)."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from pagellm.model_executor import weight_utils

    cfg = json.loads(open(os.path.join(model_dir, "config.json")).read())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out, arch)
    for key, value in {"block_count": cfg["num_hidden_layers"],
                       "context_length": cfg["max_position_embeddings"],
                       "embedding_length": cfg["hidden_size"],
                       "feed_forward_length": cfg["intermediate_size"],
                       "attention.head_count": heads, "attention.head_count_kv": kv_heads,
                       "vocab_size": cfg["vocab_size"]}.items():  # fmt: skip
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_float32(f"{arch}.rope.freq_base", LLAMA3_ROPE["rope_theta"] if arch == "llama"
                  else rope.get("rope_theta", 10000.0))
    for key, value in (metadata or {}).items():
        {str: w.add_string, float: w.add_float32, int: w.add_uint32}[type(value)](key, value)
    layer_names = {hf: g for g, hf in weight_utils.LLAMA_GGUF_LAYER_NAMES.items()}
    global_names = {hf: g for g, hf in weight_utils._GGUF_GLOBAL_NAMES.items()}
    permuted_heads = {"attn_q": heads, "attn_k": kv_heads}
    for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items():
        stem, suffix = name.rsplit(".", 1)
        n_head = None
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            gguf_part = layer_names[part]
            gguf_name, n_head = f"blk.{layer}.{gguf_part}.{suffix}", permuted_heads.get(gguf_part)
        else:
            gguf_name = f"{global_names[stem]}.{suffix}"
        if n_head:  # rows [head, 2, pair] -> [head, pair, 2]
            pair = t.shape[0] // n_head // 2
            t = t.reshape(n_head, 2, pair, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(gguf_name, np.ascontiguousarray(t, dtype=np.float32))
    if freq_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(freq_factors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_gguf_rope_freqs_apply_llama3_scaling(tiny_model: Callable[..., str], tmp_path,
                                              quantization: str | None) -> None:
    """A Llama 3.x GGUF carries its rope scaling only as the `rope_freqs` divisors; loaded
    from GGUF, the tiny llama3 model must give the logits HF gives from its config, on
    the float path and on the quantized path (its F32 blocks through the kernels, q/k
    rows moved back to HF's order)."""
    model_dir = tiny_model("llama", rope_parameters=LLAMA3_ROPE)
    mc_hf = make_model_config(model_dir)
    head_dim = mc_hf.head_dim
    factors = _llama_cpp_freq_factors(head_dim, LLAMA3_ROPE)
    assert 1.0 in factors and LLAMA3_ROPE["factor"] in factors  # all three bands present
    assert any(1.0 < f < LLAMA3_ROPE["factor"] for f in factors)
    path = _write_llama_gguf(model_dir, str(tmp_path / "tiny-llama3.gguf"), factors)
    mc = make_model_config(path, quantization=quantization, gguf_activations="float32")
    assert mc.hf_config.rope_freq_factors == pytest.approx(factors)
    prompt = token_ids(130)  # past original 64 positions
    runner = PagedRunner(get_model(mc, torch.device("cpu"), get_attn_backend("torch")), mc)
    runner.add("s", prompt)
    logits = runner.step([("s", len(prompt))])
    torch.testing.assert_close(logits[0], _hf_last_logits(model_dir, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_smollm3_gguf_leaves_every_fourth_layer_without_rope(
        tiny_model: Callable[..., str], tmp_path, quantization: str | None) -> None:
    """A SmolLM3 GGUF (llama.cpp's layout: Llama's tensors and permuted q/k rows; the
    no-rope interval fixed at 4, not in the file): the last of four layers attends
    without rope, and the logits equal transformers' on the checkpoint, through the
    one-region stack on the blocks."""
    model_dir = tiny_model("smollm3")
    path = _write_llama_gguf(model_dir, str(tmp_path / "tiny-smollm3.gguf"), None, arch="smollm3")
    mc = make_model_config(path, quantization=quantization, gguf_activations="float32")
    assert mc.architecture == "SmolLM3ForCausalLM"
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    assert [a.rope for a in model.layer_attention] == [True, True, True, False]
    prompt = token_ids(33)
    runner = PagedRunner(model, mc)
    runner.add("s", prompt)
    logits = runner.step([("s", len(prompt))])
    runner.append("s", int(logits[0].argmax()))
    decode = runner.step([("s", 1)])[0]  # a decode through the one-region stack
    torch.testing.assert_close(logits[0], _hf_last_logits(model_dir, prompt), atol=1e-4, rtol=0)
    expected = _hf_last_logits(model_dir, [*prompt, int(logits[0].argmax())])
    torch.testing.assert_close(decode, expected, atol=1e-4, rtol=0)
    if quantization == "gguf":
        assert model.model.fused_decode is not None
        assert model.model.fused_decode._layers[3].cos_table is None


def test_rope_freq_factors_of_wrong_length_are_refused() -> None:
    from pagellm.model_executor.layers.rotary_embedding import RopeParams, compute_inv_freq

    with pytest.raises(
        ValueError, match=r"rope_freq_factors has 3 entries; expected 32 \(head_dim / 2\)"
    ):
        compute_inv_freq(64, RopeParams(10000.0, "default", {}, (1.0, 2.0, 4.0)))


def test_gguf_rope_scaling_keys_are_read_as_llama_cpp_reads_them(tiny_model: Callable[..., str], tmp_path) -> None:
    """A factor without a type (or the older rope.scale_linear) is linear scaling; a type
    pagellm does not implement is refused by name, never run unscaled; a split GGUF is
    refused with the way to merge it."""
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": LLAMA3_ROPE["rope_theta"]}
    model_dir = tiny_model("llama", rope_parameters=linear, max_position_embeddings=128)
    prompt = token_ids(130)
    expected = _hf_last_logits(model_dir, prompt)
    for i, metadata in enumerate(({"llama.rope.scaling.factor": 4.0}, {"llama.rope.scale_linear": 4.0},
                                  {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})):
        mc = make_model_config(_write_llama_gguf(model_dir, str(tmp_path / f"linear{i}.gguf"), None, metadata))
        assert mc.hf_config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
        runner = PagedRunner(get_model(mc, torch.device("cpu"), get_attn_backend("torch")), mc)
        runner.add("s", prompt)
        torch.testing.assert_close(runner.step([("s", len(prompt))])[0], expected, atol=1e-4, rtol=0)
    # linear scaling stretches the context (vLLM's reading): 128 positions x 4
    assert EngineArgs(model=model_dir).create_engine_config().model_config.max_model_len == 512
    long_prompt = token_ids(400)
    runner = PagedRunner(get_model(make_model_config(model_dir, max_model_len=512), torch.device("cpu"),
                                   get_attn_backend("torch")),
                         make_model_config(model_dir, max_model_len=512))
    runner.add("s", long_prompt)
    torch.testing.assert_close(runner.step([("s", len(long_prompt))])[0], _hf_last_logits(model_dir, long_prompt),
                               atol=1e-4, rtol=0)

    yarn = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 128}
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        mc = make_model_config(_write_llama_gguf(model_dir, str(tmp_path / "yarn.gguf"), None, yarn))
        get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    split = _write_llama_gguf(model_dir, str(tmp_path / "m-00001-of-00002.gguf"), None, {"split.count": 2})
    with pytest.raises(ValueError, match=r"part 1 of a GGUF split in 2 files.*llama-gguf-split --merge"):
        make_model_config(split)
