"""Qwen3 family: the Llama layout plus a per-head RMSNorm on q and k before rope;
q/k/v/o bias follows `attention_bias` (off in released checkpoints)."""

from __future__ import annotations

from typing import Any

from pagellm.model_executor.models.llama import LayerOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return LayerOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
