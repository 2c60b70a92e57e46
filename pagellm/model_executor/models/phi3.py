"""Phi-3 family (Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini): Llama's layer with

- q|k|v and gate|up stored fused in the checkpoint (`qkv_proj`, `gate_up_proj`; the
  fused linears cut them into their parts at load, `linear.split_rows`);
- LongRoPE for the long-context models (short factors below the pre-training length,
  long ones from it on: rotary_embedding.RotaryEmbedding says how that differs from
  transformers past that length);
- partial rotary on Phi-4-mini (`partial_rotary_factor` 0.75: only the first 3/4 of each
  head's dims turn), which the one-region C decode stack does not run (it rotates whole
  heads), so those models take the module path;
- a sliding window on every layer where the config sets one (Phi-3-mini: 2047), as
  transformers applies it.

Input/output as LlamaForCausalLM.
"""

from __future__ import annotations

from typing import Any

from pagellm.model_executor.arch_config import head_dim_of
from pagellm.model_executor.layers.quantization import QuantizationConfig
from pagellm.model_executor.layers.rotary_embedding import get_rope_params
from pagellm.model_executor.models.fused_decode import FusedLayer
from pagellm.model_executor.models.llama import (
    LayerAttention,
    LayerOptions,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from pagellm.model_executor.weight_utils import GGUFFamily

# llama.cpp's converter keeps Phi-3's fused tensors fused (`ffn_up` is gate|up, gate rows
# first) and q/k rows in HF order; some files split attn_qkv into q/k/v
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}


class Phi3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block; describes itself to the C decode stack only where rotary
    covers whole heads."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        backend: type,
        opts: LayerOptions,
        attn: LayerAttention,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(config, layer_idx, backend, opts, attn, quant_config, prefix)
        head_dim = head_dim_of(config)
        self.partial_rotary = int(head_dim * get_rope_params(config).partial_rotary_factor) < head_dim

    def fused_layer(self) -> FusedLayer | None:
        return None if self.partial_rotary else super().fused_layer()


class Phi3Model(LlamaModel):
    def __init__(self, config: Any, backend: type, opts: LayerOptions,
                 layer_attention: list[LayerAttention],
                 quant_config: QuantizationConfig | None = None, prefix: str = "model") -> None:
        super().__init__(config, backend, opts, layer_attention, quant_config, prefix,
                         layer_cls=Phi3DecoderLayer)


class Phi3ForCausalLM(LlamaForCausalLM):
    model_cls = Phi3Model
    gguf_family = GGUFFamily(layer_names=_GGUF_LAYER_NAMES)

    @classmethod
    def get_sliding_window(cls, config: Any) -> int | None:
        """`sliding_window` on every layer (transformers' Phi-3 masks all of them);
        None: the whole context."""
        window = getattr(config, "sliding_window", None)
        if window is not None and window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {window}")
        return window
