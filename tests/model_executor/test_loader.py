"""Loader behaviour: path resolution, the GGUF config and tokenizer cache, and that
every failure (missing file, corrupt GGUF, unsupported architecture or quantization,
unreachable hub) raises an error naming the file and the problem."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pagellm.attention import get_attn_backend
from pagellm.model_executor import loader
from pagellm.model_executor.loader import (
    get_model,
    load_generation_config,
    load_hf_config,
    load_tokenizer,
    resolve_model_path,
)
from tests.utils import make_model_config


def _write_gguf(path: Path, arch: str, tensor_type: str = "F32") -> str:
    """A tiny one-layer GGUF whose token embedding has `tensor_type`."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    hidden, vocab = 256, 8
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": hidden,
                       "feed_forward_length": 512, "attention.head_count": 2,
                       "attention.head_count_kv": 2, "vocab_size": vocab}.items():  # fmt: skip
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    if tensor_type == "F32":
        w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    else:  # raw quantized bytes: rows of hidden / block_size blocks of type_size bytes
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((vocab, hidden // block * size), dtype=np.uint8)
        w.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_resolve_default_and_local_paths(default_model_path: str, tmp_path: Path) -> None:
    assert resolve_model_path(None) == default_model_path
    assert default_model_path.endswith(loader.DEFAULT_MODEL) and os.path.isfile(default_model_path)
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("name", ["/nonexistent/dir/model", "missing-model.gguf", "./rel/model"])
def test_missing_local_path_names_it(name: str) -> None:
    with pytest.raises(FileNotFoundError, match=f"{name}: no such model file or directory"):
        resolve_model_path(name)


def test_missing_gguf_file_is_named(tmp_path: Path) -> None:
    path = str(tmp_path / "gone.gguf")
    with pytest.raises(FileNotFoundError, match=f"{path}: no such GGUF file"):
        load_hf_config(path)


def test_hub_id_offline_says_not_found_and_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path("pagellm-test/no-such-model")
    msg = str(err.value)
    assert "pagellm-test/no-such-model" in msg
    assert "not found locally" in msg and "hub could not be reached" in msg


@pytest.mark.parametrize("kind", ["random", "truncated", "empty"])
def test_corrupt_gguf_is_rejected(default_model_path: str, tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.gguf"
    if kind == "random":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif kind == "truncated":  # the header stops inside the tokenizer vocabulary
        with open(default_model_path, "rb") as f:
            path.write_bytes(f.read(100_000))
    else:
        path.write_bytes(b"")
    with pytest.raises(ValueError, match=f"{path}: not a valid GGUF file"):
        load_hf_config(str(path))


def test_unsupported_architecture_in_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ValueError) as err:
        load_hf_config(str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path / "config.json") in msg and "'GPT2LMHeadModel'" in msg
    assert "unsupported model architecture" in msg and "LlamaForCausalLM" in msg


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(
        ValueError, match=f"{path}: unsupported GGUF architecture 'gpt2'; supported: "
                          "gemma2, gemma3, llama, mistral, phi3, qwen2, qwen2moe, qwen3, qwen3moe, smollm3$"
    ):
        load_hf_config(path)


def test_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no config.json"):
        load_hf_config(str(tmp_path))


def test_directory_without_weights(tiny_model, tmp_path: Path) -> None:  # noqa: ANN001
    src = tiny_model("llama")
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no \\*.safetensors weights found"):
        get_model(make_model_config(str(tmp_path)), torch.device("cpu"), get_attn_backend("torch"))


def test_unsupported_quantization_type_names_file_tensor_and_type(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "iq2.gguf", "llama", tensor_type="IQ2_XXS")
    with pytest.raises(ValueError) as err:
        get_model(make_model_config(path, max_model_len=64), torch.device("cpu"), get_attn_backend("torch"))
    msg = str(err.value)
    assert msg.startswith(
        f"{path}: tensor 'token_embd.weight' has unsupported quantization type IQ2_XXS"
    )


def test_gguf_missing_tensors_are_named(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "partial.gguf", "llama")
    with pytest.raises(ValueError, match=f"{path}: checkpoint lacks weights: .*model.layers.0"):
        get_model(make_model_config(path, max_model_len=64), torch.device("cpu"), get_attn_backend("torch"))


def test_default_gguf_config_and_generation_config(default_model_path: str) -> None:
    cfg = load_hf_config(default_model_path)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (30, 576, 3)
    assert cfg.tie_word_embeddings is True and cfg.vocab_size == 49152
    assert load_generation_config(default_model_path)["eos_token_id"] == 2


def test_gguf_tokenizer_is_cached(
    default_model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    first = load_tokenizer(default_model_path)
    cached = list((tmp_path / "tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer_config.json").is_file()
    start = time.perf_counter()
    second = load_tokenizer(default_model_path)
    assert time.perf_counter() - start < 5.0
    text = "Hello, world! 日本語"
    assert first(text)["input_ids"] == second(text)["input_ids"]
    assert second.chat_template and second.chat_template == first.chat_template
    assert second.eos_token_id == 2


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_matches_gguf_reference(qtype: str) -> None:
    """Our slab-wise dequantization equals gguf.quants.dequantize bit for bit."""
    import gguf
    from gguf.quants import dequantize

    from pagellm.model_executor.weight_utils import _dequantize

    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    rows, cols = 4100, 512  # several slabs, last one partial
    raw = np.random.default_rng(1).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    # keep fp16/bf16 scales finite: clear the top exponent bit of every byte (values stay random)
    raw &= 0x3F
    if qtype == "F16":  # GGUFReader hands F16 tensors out as float16, the rest as bytes
        raw = raw.view(np.float16)
    ours = _dequantize(raw, t).reshape(rows, cols)
    np.testing.assert_array_equal(
        ours, np.asarray(dequantize(raw, t), dtype=np.float32).reshape(rows, cols)
    )
