"""Maps Hugging Face `architectures` names to model classes, imported lazily so a family
with heavy or missing dependencies costs nothing until it is used, and GGUF
`general.architecture` names to the same entries. Adding a family is one line here plus
its module (which owns its layers, its checkpoint names and its GGUF tensor names); the
engine never changes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # the frontend checks architectures without importing torch
    from torch import nn


class _Entry(NamedTuple):
    module: str
    """Module under pagellm.model_executor.models."""
    cls: str
    gguf_arch: str | None
    """llama.cpp's `general.architecture` for the family, None: no GGUF support."""
    model_type: str
    """transformers' config `model_type` (what a GGUF-derived config is given)."""
    encoder_only: bool = False
    """Bidirectional attention over a whole prompt, no KV cache: embeddings only."""


_MODELS: dict[str, _Entry] = {
    "LlamaForCausalLM": _Entry("llama", "LlamaForCausalLM", "llama", "llama"),
    "MistralForCausalLM": _Entry("llama", "MistralForCausalLM", "mistral", "mistral"),
    "Qwen2ForCausalLM": _Entry("qwen2", "Qwen2ForCausalLM", "qwen2", "qwen2"),
    "Qwen3ForCausalLM": _Entry("qwen3", "Qwen3ForCausalLM", "qwen3", "qwen3"),
    "Qwen2MoeForCausalLM": _Entry("moe", "Qwen2MoeForCausalLM", "qwen2moe", "qwen2_moe"),
    "Qwen3MoeForCausalLM": _Entry("moe", "Qwen3MoeForCausalLM", "qwen3moe", "qwen3_moe"),
    # a Mixtral GGUF says `llama` (with llama.expert_count): weight_utils.gguf_architecture
    "MixtralForCausalLM": _Entry("moe", "MixtralForCausalLM", None, "mixtral"),
    "SmolLM3ForCausalLM": _Entry("smollm3", "SmolLM3ForCausalLM", "smollm3", "smollm3"),
    "Gemma2ForCausalLM": _Entry("gemma", "Gemma2ForCausalLM", "gemma2", "gemma2"),
    "Gemma3ForCausalLM": _Entry("gemma", "Gemma3ForCausalLM", "gemma3", "gemma3_text"),
    "Phi3ForCausalLM": _Entry("phi3", "Phi3ForCausalLM", "phi3", "phi3"),
    "BertModel": _Entry("bert", "BertModel", None, "bert", encoder_only=True),
}


class ModelRegistry:
    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(_MODELS)

    @staticmethod
    def is_supported(arch: str) -> bool:
        return arch in _MODELS

    @staticmethod
    def is_encoder_only(arch: str) -> bool:
        """Whether the family is an encoder (pooling only; whole prompts, no KV cache)."""
        return arch in _MODELS and _MODELS[arch].encoder_only

    @staticmethod
    def gguf_architectures() -> dict[str, tuple[str, str]]:
        """GGUF general.architecture -> (HF architectures name, model_type)."""
        return {e.gguf_arch: (arch, e.model_type) for arch, e in _MODELS.items() if e.gguf_arch}

    @staticmethod
    def resolve_model_cls(arch: str) -> type[nn.Module]:
        if arch not in _MODELS:
            raise ValueError(
                f"model architecture {arch!r} is not supported; supported: "
                f"{', '.join(ModelRegistry.get_supported_archs())}"
            )
        entry = _MODELS[arch]
        module = importlib.import_module(f"pagellm.model_executor.models.{entry.module}")
        return getattr(module, entry.cls)
