"""Qwen2 family: the Llama layout with a bias on the q/k/v projections (none on o_proj).
Input/output as LlamaForCausalLM."""

from __future__ import annotations

from typing import Any

from pagellm.model_executor.models.llama import LayerOptions, LlamaForCausalLM
from pagellm.model_executor.weight_utils import GGUFFamily


class Qwen2ForCausalLM(LlamaForCausalLM):
    gguf_family = GGUFFamily()  # llama.cpp keeps Qwen's q/k rows in HF order

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return LayerOptions(qkv_bias=True, o_bias=False, qk_norm=False)
