"""Qwen3 family: the Llama layout plus a per-head RMSNorm on q and k before rope;
q/k/v/o bias follows `attention_bias` (off in released checkpoints)."""

from __future__ import annotations

from typing import Any

from pagellm.model_executor.models.llama import LayerOptions, LlamaForCausalLM
from pagellm.model_executor.weight_utils import GGUFFamily


class Qwen3ForCausalLM(LlamaForCausalLM):
    gguf_family = GGUFFamily()  # llama.cpp keeps Qwen's q/k rows in HF order

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return LayerOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
