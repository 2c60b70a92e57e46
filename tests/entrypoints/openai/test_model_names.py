"""The ids a server lists and accepts, from the model's path (no model loaded)."""

from __future__ import annotations

import pytest

from pagellm.model_executor.model_names import gguf_model_id, served_model_names


@pytest.mark.parametrize(("file", "expected"), [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("/models/Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
    ("qwen2.5-0.5b-instruct-q8_0.gguf", "qwen2.5-0.5b-instruct"),
    ("mistral-7b-instruct-v0.2.IQ4_XS.gguf", "mistral-7b-instruct-v0.2"),
    ("tinyllama-1.1b.F16.gguf", "tinyllama-1.1b"),
    ("Qwen3-0.6B-BF16.gguf", "Qwen3-0.6B"),
    ("model.gguf", "model"),
    ("Q4_0.gguf", "Q4_0"),  # nothing would be left: keep the name
])
def test_gguf_model_id_drops_extension_and_quantization(file: str, expected: str) -> None:
    assert gguf_model_id(file) == expected


def test_default_gguf_names(default_model_path: str) -> None:
    names = served_model_names(None, default_model_path, [])
    assert names.served == ["SmolLM2-135M-Instruct"]
    assert names.aliases == ["SmolLM2-135M-Instruct.Q4_1.gguf", "Smollm2 135M 8k Lc100K Mix1 Ep2"]
    given_as_path = served_model_names(default_model_path, default_model_path, [])
    assert given_as_path.aliases == ["SmolLM2-135M-Instruct.Q4_1.gguf", default_model_path,
                                     "Smollm2 135M 8k Lc100K Mix1 Ep2"]


def test_served_model_name_replaces_every_default(default_model_path: str) -> None:
    names = served_model_names(None, default_model_path, ["a", "b"])
    assert (names.served, names.aliases) == (["a", "b"], [])


def test_directory_and_hub_id_keep_their_name(tmp_path) -> None:
    assert served_model_names(None, str(tmp_path) + "/", []).served == [tmp_path.name]
    assert served_model_names("org/model", str(tmp_path), []).served == ["org/model"]
