"""Phi-3 beyond the tiny-model logits of test_model_vs_hf.py: LongRoPE past the
pre-training length (pagellm's split by position, built from transformers' own longrope
frequencies), a GGUF written from a tiny Phi-3 the way llama.cpp lays it out (fused
attn_qkv and ffn_up tensors in Q8_0 blocks, rope_factors tensors, partial rotary as
rope.dimension_count), fused checkpoint tensors through the loader, and which models
take the one-region C decode stack.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagellm.attention import get_attn_backend
from pagellm.model_executor.loader import get_model
from tests.model_executor.test_model_vs_hf import longrope
from tests.utils import PagedRunner, make_model_config, token_ids

ORIGINAL = 64
"""original_max_position_embeddings of the tests past it (of 512 positions: factor 8)."""

VARIANTS: dict[str, dict[str, Any]] = {
    # Phi-3.5-mini's shape: longrope, whole-head rotary, a window on every layer, untied
    "phi3": {"sliding_window": 48, "original_max_position_embeddings": ORIGINAL,
             "rope_parameters": longrope(16)},
    # Phi-4-mini's: 3/4 of each head rotates, longrope, tied embeddings, no window
    "phi4": {"partial_rotary_factor": 0.75, "tie_word_embeddings": True,
             "original_max_position_embeddings": ORIGINAL, "rope_parameters": longrope(12)},
}


def _hf(model_dir: str, state: dict[str, torch.Tensor] | None = None) -> Any:
    """transformers' model of `model_dir` (its weights replaced by `state` where given),
    its rope made pagellm's split: positions below original_max_position_embeddings take
    the short factors, later ones the long (transformers' own longrope frequencies and
    attention factor; unpatched, it takes the long ones for every position of a sequence
    longer than that)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        hf.load_state_dict(state, strict=False)
    original = hf.config.rope_parameters["original_max_position_embeddings"]
    short, scale = ROPE_INIT_FUNCTIONS["longrope"](hf.config, None)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, None, seq_len=original + 1)
    assert not torch.equal(short, long)

    def split_rope(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = position_ids[..., None].float()
        freqs = torch.where(pos < original, pos * short, pos * long)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    hf.model.rotary_emb.forward = split_rope
    return hf


def _logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_longrope_past_original_length_splits_by_position(tiny_model: Callable[..., str],
                                                          variant: str) -> None:
    """100 tokens over a pre-training length of 64: a 40-token chunk, a 30-token chunk
    across 64, then decodes (the C stack where rotary covers whole heads): every
    position's logits are those of transformers' model with the rope split by position.
    Below 64 tokens that is transformers' own choice; past it, transformers' differs."""
    model_dir = tiny_model("phi3", **VARIANTS[variant])
    tokens = token_ids(100)
    expected = _logits(_hf(model_dir), tokens)
    mc = make_model_config(model_dir)
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    runner = PagedRunner(model, mc)
    runner.add("s", tokens)
    done = 0
    for n in [40, 30] + [1] * 30:
        logits = runner.step([("s", n)])
        done += n
        torch.testing.assert_close(logits[0], expected[done - 1], atol=1e-4, rtol=0, msg=f"pos {done - 1}")
    assert (model.model.fused_decode is not None) == (variant == "phi3")
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(plain, tokens[:60])[-1], expected[59], atol=1e-4, rtol=0)
    assert not torch.allclose(_logits(plain, tokens)[-1], expected[-1], atol=1e-2)


def test_tiny_phi3_configs_exercise_their_feature(tiny_model: Callable[..., str]) -> None:
    """Guards the oracle: transformers' logits change with the window, with partial
    rotary and with longrope's attention factor, so matching them tests each."""
    from transformers import AutoModelForCausalLM

    prompt = token_ids(130)

    def last(**overrides: Any) -> torch.Tensor:
        hf = AutoModelForCausalLM.from_pretrained(tiny_model("phi3", **overrides), dtype=torch.float32)
        return _logits(hf.eval(), prompt)[-1]

    plain = last()
    assert not torch.allclose(last(sliding_window=48), plain, atol=1e-3)
    assert not torch.allclose(last(partial_rotary_factor=0.75), plain, atol=1e-3)
    # short factors of 1: only the attention factor sqrt(1 + ln 2 / ln 256) differs
    unit = last(original_max_position_embeddings=256,
                rope_parameters={**longrope(16), "short_factor": [1.0] * 8})
    assert not torch.allclose(unit, plain, atol=1e-3)
    scaled = last(original_max_position_embeddings=256, rope_parameters=longrope(16))
    assert not torch.allclose(scaled, unit, atol=1e-3)
    mc = make_model_config(tiny_model("phi3", partial_rotary_factor=0.75))
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    assert model.model.rotary_emb.rotary_dim == 12 and model.model.rotary_emb.cos_cache.shape == (512, 12)


def _write_phi3_gguf(model_dir: str, out: str) -> dict[str, torch.Tensor]:
    """The tiny HF Phi-3 as llama.cpp's converter writes it (convert_hf_to_gguf.py's
    Phi3MiniModel): GGUF names with q|k|v and gate|up kept fused (attn_qkv, ffn_up), 2-D
    weights in Q8_0 blocks, q/k rows in HF order, rotary dims as rope.dimension_count,
    LongRoPE as rope_factors_long/short tensors with the original context and the
    attention factor, the window as attention.sliding_window (0: none). Returns the HF
    state dict with each quantized weight replaced by its blocks' dequantized values."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads(open(os.path.join(model_dir, "config.json")).read())
    rope = cfg["rope_parameters"]
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
    original, max_pos = cfg["original_max_position_embeddings"], cfg["max_position_embeddings"]
    scale = max_pos / original
    w = gguf.GGUFWriter(out, "phi3")
    for key, value in {"context_length": max_pos, "rope.scaling.original_context_length": original,
                       "embedding_length": hidden, "feed_forward_length": cfg["intermediate_size"],
                       "block_count": cfg["num_hidden_layers"], "attention.head_count": heads,
                       "attention.head_count_kv": cfg["num_key_value_heads"],
                       "rope.dimension_count": rope_dims,
                       "attention.sliding_window": cfg["sliding_window"] or 0}.items():  # fmt: skip
        w.add_uint32(f"phi3.{key}", value)
    w.add_float32("phi3.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32("phi3.rope.freq_base", rope["rope_theta"])
    w.add_float32("phi3.rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(original)))
    layer_names = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv",
                   "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                   "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    global_names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    reference = {}
    for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items():
        stem, suffix = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[part]}.{suffix}"
        else:
            gguf_name = f"{global_names[stem]}.{suffix}"
        t = np.ascontiguousarray(t, dtype=np.float32)
        if t.ndim == 1:
            w.add_tensor(gguf_name, t)
            reference[name] = torch.from_numpy(t)
            continue
        kind = gguf.GGMLQuantizationType.Q8_0
        blocks = gguf.quants.quantize(t, kind)
        w.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
        reference[name] = torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(t.shape).copy())
    for kind in ("long", "short"):
        w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


@pytest.mark.parametrize("quantization", [None, "gguf"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_phi3_gguf_blocks_match_transformers(tiny_model: Callable[..., str], tmp_path,
                                             variant: str, quantization: str | None) -> None:
    """Loaded from the written GGUF, dequantized (None) or on its Q8_0 blocks with float32
    activations ("gguf"), a 100-token prompt over the pre-training length of 64 gives the
    logits of transformers' model (rope split by position) on the checkpoint holding the
    blocks' values. The config the file implies is the checkpoint's; on "gguf" each fused
    linear keeps one Q8_0 group over all its parts, still the file's mapping."""
    import gguf

    model_dir = tiny_model("phi3", **VARIANTS[variant])
    path = str(tmp_path / f"tiny-{variant}.gguf")
    reference = _write_phi3_gguf(model_dir, path)
    mc = make_model_config(path, quantization=quantization, gguf_activations="float32")
    hf_cfg = make_model_config(model_dir).hf_config
    assert mc.architecture == "Phi3ForCausalLM"
    scaling = mc.hf_config.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIGINAL
    for key in ("long_factor", "short_factor"):
        assert scaling[key] == pytest.approx(hf_cfg.rope_parameters[key])
    assert getattr(mc.hf_config, "partial_rotary_factor", 1.0) == hf_cfg.rope_parameters["partial_rotary_factor"]
    assert mc.hf_config.sliding_window == hf_cfg.sliding_window
    assert mc.hf_config.tie_word_embeddings == hf_cfg.tie_word_embeddings
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    if quantization == "gguf":
        for linear in (model.model.layers[0].self_attn.qkv_proj, model.model.layers[1].mlp.gate_up_proj):
            (group,) = linear.weight_groups
            assert group.qtype == gguf.GGMLQuantizationType.Q8_0 and group.rows == linear.out_features
            assert not group.data.flags.writeable  # a view of the read-only mapping, not a copy
    prompt = token_ids(100)
    runner = PagedRunner(model, mc)
    runner.add("s", prompt)
    logits = runner.step([("s", len(prompt))])[0]
    expected = _logits(_hf(model_dir, reference), prompt)[-1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_fused_checkpoint_tensor_of_wrong_rows_is_refused(tiny_model: Callable[..., str]) -> None:
    """A qkv_proj tensor whose rows are not q + k + v names itself and both counts; a
    whole gate_up_proj tensor reports both parts loaded."""
    from pagellm.model_executor.registry import ModelRegistry

    mc = make_model_config(tiny_model("phi3"))
    model = ModelRegistry.resolve_model_cls(mc.architecture)(mc.hf_config, get_attn_backend("torch"))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj.weight: .*a fused "
                                         r"tensor of 100 rows; the parts \[64, 32, 32\] take 128"):
        model.load_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(100, 64))])
    names = model.load_weights([("model.layers.0.mlp.gate_up_proj.weight", torch.zeros(256, 64))])
    assert names == {"model.layers.0.mlp.gate_up_proj.weight#0", "model.layers.0.mlp.gate_up_proj.weight#1"}
