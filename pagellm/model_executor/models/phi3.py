"""Phi-3 family (Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini): Llama's layer with

- q|k|v and gate|up stored fused in the checkpoint (`qkv_proj`, `gate_up_proj`; the
  fused linears cut them into their parts at load, `linear.split_rows`);
- LongRoPE for the long-context models (short factors below the pre-training length,
  long ones from it on: rotary_embedding.RotaryEmbedding says how that differs from
  transformers past that length);
- partial rotary on Phi-4-mini (`partial_rotary_factor` 0.75: only the first 3/4 of each
  head's dims turn), which the one-region C decode stack does not run (it rotates whole
  heads: fused_decode refuses such tables), so those models take the module path;
- a sliding window on every layer where the config sets one (Phi-3-mini: 2047), as
  transformers applies it.

Input/output as LlamaForCausalLM.
"""

from __future__ import annotations

from pagellm.model_executor.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagellm.model_executor.weight_utils import LLAMA_GGUF_LAYER_NAMES, GGUFFamily

# llama.cpp's converter keeps Phi-3's fused tensors fused (`ffn_up` is gate|up, gate rows
# first) and q/k rows in HF order; some files split attn_qkv into q/k/v
_GGUF_LAYER_NAMES = {
    **LLAMA_GGUF_LAYER_NAMES,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}


class Phi3ForCausalLM(LlamaForCausalLM):
    gguf_family = GGUFFamily(layer_names=_GGUF_LAYER_NAMES)
    get_sliding_window = MistralForCausalLM.get_sliding_window
    """`sliding_window` on every layer, as transformers' Phi-3 masks them all."""
