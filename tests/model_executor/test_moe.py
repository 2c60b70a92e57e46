"""Mixture-of-experts GGUF files (Qwen3-MoE in llama.cpp's `qwen3moe` layout: a router
per layer, each projection of all experts one 3-D tensor; Mixtral under `llama`): logits
against transformers
on the checkpoint holding the blocks' values, the experts kept in their blocks (views of
the file, no float copy), an expert type without a kernel dequantized with one log line,
and a synthetic file's int8 decodes batched as they run alone. The engine on a tiny
Qwen3-MoE checkpoint: test_family_engines.py; logits of Qwen2-/Qwen3-MoE checkpoints:
test_model_vs_hf.py.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.attention import get_attn_backend
from pagellm.model_executor.loader import get_model
from tests.utils import PagedRunner, make_model_config, token_ids


def _write_moe_gguf(model_dir: str, out: str, expert_type: str,
                    arch: str = "qwen3moe") -> dict[str, torch.Tensor]:
    """The tiny HF Qwen3-MoE (arch "qwen3moe") or Mixtral ("llama": q/k rows permuted,
    `llama.expert_count`) as llama.cpp's converter writes it (GGUF names, experts
    stacked [E, rows, cols] in `expert_type` blocks, other weights Q8_0, the router and
    norms F32). Returns the state dict (Qwen's module names) holding each quantized
    weight's dequantized values (the reference)."""
    import gguf
    from safetensors.numpy import load_file

    from pagellm.benchmarks.synthetic_gguf import random_blocks
    from pagellm.model_executor import weight_utils
    from pagellm.model_executor.models.moe import _GGUF_LAYER_NAMES, _MIXTRAL_NAMES

    cfg = json.loads(open(os.path.join(model_dir, "config.json")).read())
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out, arch)
    keys = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": heads, "attention.head_count_kv": kv_heads,
            "expert_count": n_exp, "expert_used_count": cfg["num_experts_per_tok"]}
    if arch == "qwen3moe":
        keys["attention.key_length"] = cfg["head_dim"]
    if arch in ("qwen3moe", "qwen2moe"):
        keys["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if arch == "qwen2moe":
        keys["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    permuted = {"attn_q": heads, "attn_k": kv_heads} if arch == "llama" else {}
    layer_names = {hf: g for g, hf in _GGUF_LAYER_NAMES.items()}
    global_names = {hf: g for g, hf in weight_utils._GGUF_GLOBAL_NAMES.items()}
    rng = np.random.default_rng(3)
    reference: dict[str, torch.Tensor] = {}
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    stacked: dict[tuple[str, str], list[np.ndarray]] = {}
    for name, t in tensors.items():
        for old, new in _MIXTRAL_NAMES.items():
            name = name.replace(old, new) if ".block_sparse_moe." in name or ".mlp.experts." in name else name
        stem, suffix = name.rsplit(".", 1)
        t = np.ascontiguousarray(t, dtype=np.float32)
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.PROJ.weight
            layer, expert, proj = stem.split(".")[2], int(stem.split(".")[5]), stem.split(".")[6]
            stacked.setdefault((layer, proj), [None] * n_exp)[expert] = t
            continue
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[part]}.{suffix}"
        else:
            gguf_name = f"{global_names[stem]}.{suffix}"
        if t.ndim == 1 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            w.add_tensor(gguf_name, t)
            reference[name] = torch.from_numpy(t)
            continue
        q8 = gguf.GGMLQuantizationType.Q8_0
        reference[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t, q8), q8).copy())
        n_head = permuted.get(gguf_name.split(".")[2]) if gguf_name.startswith("blk.") else None
        if n_head:  # llama.cpp's q/k rows: [head, 2, pair] -> [head, pair, 2]
            pair = t.shape[0] // n_head // 2
            t = np.ascontiguousarray(t.reshape(n_head, 2, pair, -1).swapaxes(1, 2).reshape(t.shape))
        blocks = gguf.quants.quantize(t, q8)
        w.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=q8)
    kind = gguf.GGMLQuantizationType[expert_type]
    for (layer, proj), experts in stacked.items():
        t = np.stack(experts)  # [E, rows, cols]
        e, rows, cols = t.shape
        if expert_type in ("Q8_0", "Q4_0"):
            blocks = gguf.quants.quantize(t.reshape(e * rows, cols), kind)
        else:  # types gguf cannot quantize: random blocks, the reference their values
            blocks = random_blocks(expert_type, e * rows, cols, rng, scale=0.1)
        values = gguf.quants.dequantize(blocks, kind).reshape(e, rows, cols)
        blocks = blocks.reshape(e, rows, -1)
        short = proj.removesuffix("_proj")
        w.add_tensor(f"blk.{layer}.ffn_{short}_exps.weight", blocks, raw_shape=blocks.shape, raw_dtype=kind)
        for k in range(e):
            reference[f"model.layers.{layer}.mlp.experts.{k}.{proj}.weight"] = torch.from_numpy(values[k].copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


def _hf_logits(model_dir: str, reference: dict[str, torch.Tensor], prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_state = hf.state_dict()
    # transformers 5 keeps each layer's experts as 3-D gate_up / down parameters
    for key in [k for k in reference if ".mlp.experts." in k]:
        layer, expert, proj = key.split(".")[2], int(key.split(".")[5]), key.split(".")[6]
        value = reference.pop(key)
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.{expert}.{proj}.weight" in hf_state:
            reference[f"{prefix}.{expert}.{proj}.weight"] = value
        elif proj == "down_proj":
            hf_state[f"{prefix}.down_proj"][expert].copy_(value)
        else:
            half = value.shape[0]
            rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
            hf_state[f"{prefix}.gate_up_proj"][expert, rows].copy_(value)
    missing, unexpected = hf.load_state_dict({**hf_state, **reference}, strict=True), None
    assert not missing.missing_keys and unexpected is None
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0, -1]


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_qwen3_moe_gguf_matches_transformers(tiny_model: Callable[..., str], tmp_path,
                                             quantization: str | None) -> None:
    """Every layer with experts (llama.cpp's qwen3moe has no dense layers): loaded from
    the written GGUF, dequantized (None) or on its blocks with float32 activations
    ("gguf": the experts Q8_0, views of the file's mapping), the logits of a 40-token
    prompt equal transformers' on the blocks' values."""
    model_dir = tiny_model("qwen3_moe", mlp_only_layers=[])
    path = str(tmp_path / "tiny-qwen3moe.gguf")
    reference = _write_moe_gguf(model_dir, path, "Q8_0")
    mc = make_model_config(path, quantization=quantization, gguf_activations="float32")
    assert mc.architecture == "Qwen3MoeForCausalLM"
    assert (mc.hf_config.num_experts, mc.hf_config.num_experts_per_tok,
            mc.hf_config.moe_intermediate_size) == (8, 2, 32)
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    experts = model.model.layers[0].mlp.experts
    if quantization == "gguf":
        (gate, up), (down,) = experts.expert_groups[3]
        assert {gate.qtype, up.qtype, down.qtype} == {8}  # Q8_0 blocks, not float
        assert not gate.data.flags.owndata and gate.data.base is not None  # a view of the file
    prompt = token_ids(40)
    runner = PagedRunner(model, mc)
    runner.add("s", prompt)
    logits = runner.step([("s", len(prompt))])[0]
    torch.testing.assert_close(logits, _hf_logits(model_dir, reference, prompt), atol=1e-4, rtol=0)


def test_mixtral_gguf_under_the_llama_architecture_matches_transformers(
        tiny_model: Callable[..., str], tmp_path) -> None:
    """llama.cpp files Mixtral as `llama` with `llama.expert_count`: read as Mixtral (8
    experts, top 2 renormalised, q/k rows permuted back), on the blocks with float32
    activations, the logits equal transformers' on the blocks' values."""
    model_dir = tiny_model("mixtral")
    path = str(tmp_path / "tiny-mixtral.gguf")
    reference = _write_moe_gguf(model_dir, path, "Q8_0", arch="llama")
    mc = make_model_config(path, quantization="gguf", gguf_activations="float32")
    assert (mc.architecture, mc.hf_config.num_experts, mc.hf_config.num_experts_per_tok) == (
        "MixtralForCausalLM", 8, 2)
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    prompt = token_ids(40)
    runner = PagedRunner(model, mc)
    runner.add("s", prompt)
    logits = runner.step([("s", len(prompt))])[0]
    torch.testing.assert_close(logits, _hf_logits(model_dir, reference, prompt), atol=1e-4, rtol=0)
    assert model.model.fused_decode is not None  # its experts run in the one-region stack


def test_qwen2_moe_gguf_with_its_shared_expert_matches_transformers(
        tiny_model: Callable[..., str], tmp_path) -> None:
    """A Qwen2-MoE GGUF: q/k/v biases, top 2 of 8 experts not renormalised, and the
    shared expert (ffn_*_shexp) behind its sigmoid gate (ffn_gate_inp_shexp): on the
    blocks with float32 activations, the logits equal transformers' on the blocks'
    values."""
    model_dir = tiny_model("qwen2_moe", mlp_only_layers=[])
    path = str(tmp_path / "tiny-qwen2moe.gguf")
    reference = _write_moe_gguf(model_dir, path, "Q8_0", arch="qwen2moe")
    mc = make_model_config(path, quantization="gguf", gguf_activations="float32")
    assert (mc.architecture, mc.hf_config.shared_expert_intermediate_size) == ("Qwen2MoeForCausalLM", 64)
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    assert model.model.layers[0].mlp.shared_expert is not None
    assert not model.model.layers[0].mlp.experts.renormalize
    prompt = token_ids(40)
    runner = PagedRunner(model, mc)
    runner.add("s", prompt)
    logits = runner.step([("s", len(prompt))])[0]
    torch.testing.assert_close(logits, _hf_logits(model_dir, reference, prompt), atol=1e-4, rtol=0)


def test_expert_type_without_a_kernel_is_dequantized_with_one_log_line(
        tiny_model: Callable[..., str], tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """IQ4_NL has no CPU kernel here: its expert tensors become float32 at load, said once,
    and the logits still equal transformers' on the blocks' values."""
    model_dir = tiny_model("qwen3_moe", mlp_only_layers=[])
    path = str(tmp_path / "tiny-qwen3moe-iq4nl.gguf")
    reference = _write_moe_gguf(model_dir, path, "IQ4_NL")
    mc = make_model_config(path, quantization="gguf", gguf_activations="float32")
    root = logging.getLogger("pagellm")  # (it does not propagate to the root logger)
    root.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="pagellm"):
            model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    finally:
        root.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "no CPU kernel for IQ4_NL" in r.getMessage()]
    assert lines == [f"{path}: no CPU kernel for IQ4_NL; its tensors (first: blk.0.ffn_down_exps.weight) "
                     "are dequantized to float32 at load"]
    assert model.model.layers[1].mlp.experts.expert_groups[0][1][0].qtype == 0  # F32
    prompt = token_ids(20)
    runner = PagedRunner(model, mc)
    runner.add("s", prompt)
    torch.testing.assert_close(runner.step([("s", len(prompt))])[0],
                               _hf_logits(model_dir, reference, prompt), atol=1e-4, rtol=0)


def test_synthetic_moe_int8_decodes_batch_as_they_run_alone(tmp_path) -> None:
    """A synthetic Q4_K_M Qwen3-MoE file on the default int8 path: four requests batched
    give the tokens each gives alone (a decode row's int8 products, and the experts it
    picks, do not depend on the step's other rows)."""
    from pagellm.benchmarks.synthetic_gguf import SHAPES, write_qwen3_moe_gguf

    path = str(tmp_path / "tiny-moe.gguf")
    write_qwen3_moe_gguf(path, SHAPES["tiny-moe"], "q4_k_m", seed=4)
    llm = LLM(path, multiprocess_mode=False, max_model_len=128, gguf_activations="q8")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompts = [{"prompt_token_ids": token_ids(n, offset)[:n]} for n, offset in
                   ((9, 3), (17, 5), (4, 7), (30, 11))]
        prompts = [{"prompt_token_ids": [t % 500 + 2 for t in p["prompt_token_ids"]]} for p in prompts]
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert batched == alone
        assert len({tuple(t) for t in batched}) > 1  # the prompts lead somewhere different
    finally:
        llm.shutdown()
