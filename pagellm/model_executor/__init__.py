"""Model execution: the loader (paths, configs, tokenizers, weights), the registry of
model families, their layers and models. `get_model` is the entry point the model runner
uses; it knows nothing of scheduling."""

from __future__ import annotations

from pagellm.model_executor.loader import (
    DEFAULT_MODEL,
    default_model_path,
    get_model,
    load_generation_config,
    load_hf_config,
    load_tokenizer,
    resolve_model_path,
)
from pagellm.model_executor.registry import ModelRegistry

__all__ = [
    "DEFAULT_MODEL",
    "ModelRegistry",
    "default_model_path",
    "get_model",
    "load_generation_config",
    "load_hf_config",
    "load_tokenizer",
    "resolve_model_path",
]
