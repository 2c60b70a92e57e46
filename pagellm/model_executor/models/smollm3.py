"""SmolLM3: Llama's layers, with every `no_rope_layer_interval`-th layer (4th) attending
without rotary embeddings (`no_rope_layers[i]` 0), and an optional sliding window on
layers `layer_types` marks sliding. Input/output as LlamaForCausalLM; llama.cpp's
converter lays it out as Llama (q/k rows permuted) and fixes the interval at 4.
"""

from __future__ import annotations

from typing import Any

from pagellm.config.arch_config import head_dim_of
from pagellm.model_executor.models.llama import LayerAttention, LlamaForCausalLM, sliding_window_of


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_attention_of(cls, config: Any) -> list[LayerAttention]:
        n = config.num_hidden_layers
        interval = getattr(config, "no_rope_layer_interval", None) or 4
        uses_rope = getattr(config, "no_rope_layers", None) or [
            int((i + 1) % interval != 0) for i in range(n)]
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        window = sliding_window_of(config) if getattr(config, "use_sliding_window", False) else None
        scale = head_dim_of(config) ** -0.5
        return [LayerAttention(scale, window if types[i] == "sliding_attention" else None,
                               rope=bool(uses_rope[i])) for i in range(n)]
