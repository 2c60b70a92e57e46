"""Maps Hugging Face `architectures` names to model classes, imported lazily so a family
with heavy or missing dependencies costs nothing until it is used. Adding a family is
one line here plus its module; the engine never changes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the frontend checks architectures without importing torch
    from torch import nn

# architecture name -> (module under pagellm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


class ModelRegistry:
    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(_MODELS)

    @staticmethod
    def is_supported(arch: str) -> bool:
        return arch in _MODELS

    @staticmethod
    def resolve_model_cls(arch: str) -> type[nn.Module]:
        if arch not in _MODELS:
            raise ValueError(
                f"model architecture {arch!r} is not supported; supported: "
                f"{', '.join(ModelRegistry.get_supported_archs())}"
            )
        module_name, cls_name = _MODELS[arch]
        module = importlib.import_module(f"pagellm.model_executor.models.{module_name}")
        return getattr(module, cls_name)
