"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP with Gemma's conventions.

- embeddings are multiplied by sqrt(hidden_size);
- RMSNorm scales by (1 + w) (`GemmaRMSNorm`; stored as 1 + w once loaded, so the plain
  kernels run); every block has a norm before and after each sub-block;
- the MLP's activation is `hidden_activation` (tanh-approximated GELU);
- q.k is scaled by query_pre_attn_scalar ** -0.5;
- layers alternate between a sliding window and the whole context (`layer_types`;
  Gemma 2: every other layer, Gemma 3: five of every six), Gemma 3's two kinds with
  their own rope base (10k local, 1M global) and a per-head RMSNorm of q and k;
- Gemma 2 caps attention scores (50) and final logits (30) as cap * tanh(x / cap).

Input/output as LlamaForCausalLM. Gemma's layer describes itself to the one-region C
decode stack (`fused_layer`: its extra norms, GELU, per-layer rope, window and score cap).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.config.arch_config import ArchConfig, head_dim_of
from pagellm.model_executor.layers.layernorm import RMSNorm
from pagellm.model_executor.layers.quantization import QuantizationConfig
from pagellm.model_executor.layers.rotary_embedding import (
    RopeTables,
    RotaryEmbedding,
    get_rope_params,
    rope_positions,
)
from pagellm.model_executor.models.fused_decode import FusedLayer
from pagellm.model_executor.models.llama import (
    LayerAttention,
    LayerOptions,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    sliding_window_of,
)
from pagellm.model_executor.weight_utils import LLAMA_GGUF_LAYER_NAMES, GGUFFamily

SLIDING, FULL = "sliding_attention", "full_attention"

# llama.cpp's names, Gemma's norms: ffn_norm is the MLP's input norm, and each sub-block's
# output has one
_GGUF_LAYER_NAMES = {
    **LLAMA_GGUF_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): checkpoints hold w (zero-centred); after loading the weight
    holds 1 + w in float32, the factor Hugging Face computes each call, so the products
    are the same and the C norm kernels apply."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self._offset_applied = False

    def process_weights_after_loading(self) -> None:
        if not self._offset_applied:
            with torch.no_grad():
                self.weight.add_(1.0)
            self._offset_applied = True


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Norms around both sub-blocks: x + post(attn(pre(x))), then the same for the MLP.
    (Llama's `post_attention_layernorm` is the attention output's norm here; the MLP's
    input norm is `pre_feedforward_layernorm`.)"""

    norm_cls = GemmaRMSNorm

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def make_mlp(self, config: Any, layer_idx: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        return LlamaMLP(config, quant_config, prefix, hidden_act=act)

    def forward(
        self, rope: RopeTables, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: `residual` is the stream before this layer's
        input norm adds the previous layer's output to it."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward_single(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.post_attention_layernorm.forward_single(self.self_attn.forward(rope, hidden))
        hidden, residual = self.pre_feedforward_layernorm.forward(hidden, residual)
        return self.post_feedforward_layernorm.forward_single(self.mlp.forward(hidden)), residual

    def fused_layer(self) -> FusedLayer:
        """This layer as the one-region C stack runs it (models/fused_decode.py)."""
        a, m = self.self_attn, self.mlp
        return FusedLayer(self.input_layernorm, self.pre_feedforward_layernorm, a.qkv_proj,
                          a.o_proj, m.gate_up_proj, m.down_proj, a.attn, m.act_fn,
                          q_norm=a.q_norm, k_norm=a.k_norm,
                          post_attn=self.post_attention_layernorm,
                          post_ffn=self.post_feedforward_layernorm)


class GemmaModel(LlamaModel):
    def __init__(self, config: Any, backend: type, opts: LayerOptions,
                 layer_attention: list[LayerAttention],
                 quant_config: QuantizationConfig | None = None, prefix: str = "model") -> None:
        super().__init__(config, backend, opts, layer_attention, quant_config, prefix,
                         layer_cls=GemmaDecoderLayer, norm_cls=GemmaRMSNorm)
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
        """sqrt(hidden) as a float32 scalar, cast to the activations' dtype (HF's)."""
        head_dim = head_dim_of(config)
        max_position = rope_positions(config, int(config.max_position_embeddings))
        self.layer_types = layer_types_of(config)
        self.ropes = nn.ModuleDict({
            kind: RotaryEmbedding(head_dim, max_position, get_rope_params(
                ArchConfig({"rope_parameters": rope_parameters_of(config, kind)})))
            for kind in dict.fromkeys(self.layer_types)
        })  # fmt: skip
        self.rotary_emb = self.ropes[self.layer_types[0]]  # (LlamaModel's one table, unused)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens.forward(input_ids)
        return hidden.mul_(self.embed_scale.to(hidden.dtype))

    def layer_ropes(self) -> list[RotaryEmbedding]:
        return [self.ropes[kind] for kind in self.layer_types]


def layer_types_of(config: Any) -> list[str]:
    """Each layer's kind, FULL or SLIDING: the config's `layer_types`, else its
    `sliding_window_pattern` (every n-th layer full; Gemma 3's default 6, Gemma 2's 2)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    default = 6 if str(getattr(config, "model_type", "")).startswith("gemma3") else 2
    pattern = getattr(config, "sliding_window_pattern", None) or default
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


def rope_parameters_of(config: Any, kind: str) -> dict[str, Any]:
    """The rope settings of one kind of layer: transformers 5 keeps one dict per kind in
    `rope_parameters`; older configs and GGUF metadata have rope_theta / rope_scaling for
    the global layers and `rope_local_base_freq` (default 10k) for the sliding ones."""
    params = getattr(config, "rope_parameters", None) or {}
    if kind in params:
        return dict(params[kind])
    if "rope_theta" in params:  # one setting for every layer (Gemma 2)
        return dict(params)
    if kind == SLIDING and str(getattr(config, "model_type", "")).startswith("gemma3"):
        return {"rope_type": "default",
                "rope_theta": getattr(config, "rope_local_base_freq", None) or 10000.0}
    scaling = getattr(config, "rope_scaling", None) or {}
    return {"rope_type": "default", **scaling, "rope_theta": getattr(config, "rope_theta", None) or 10000.0}


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel
    gguf_family = GGUFFamily(layer_names=_GGUF_LAYER_NAMES, norm_offset=1.0)
    """llama.cpp's converter stores Gemma's norms as 1 + w and keeps q/k rows in HF order."""
    default_caps = (50.0, 30.0)
    """(attention, final) logit caps where the config names none (transformers' Gemma 2
    defaults)."""
    qk_norm = False

    def __init__(self, config: Any, attn_backend: type,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, attn_backend, quant_config)
        self.final_logit_softcapping = _cap(config, "final_logit_softcapping", self.default_caps[1])

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return LayerOptions(qkv_bias=bias, o_bias=bias, qk_norm=cls.qk_norm)

    @classmethod
    def layer_attention_of(cls, config: Any) -> list[LayerAttention]:
        window = sliding_window_of(config)
        scale = query_pre_attn_scalar_of(config) ** -0.5
        cap = _cap(config, "attn_logit_softcapping", cls.default_caps[0])
        return [LayerAttention(scale, window if kind == SLIDING else None, cap)
                for kind in layer_types_of(config)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    default_caps = (None, None)
    qk_norm = True


def _cap(config: Any, key: str, default: float | None) -> float | None:
    """A soft cap from the config: its value where the key is present (None or 0: no
    cap), else the family's default."""
    if key not in vars(config):
        return default
    return getattr(config, key) or None


def query_pre_attn_scalar_of(config: Any) -> float:
    """The config's query_pre_attn_scalar; GGUF metadata has none, and llama.cpp uses
    hidden / heads for the 62-layer Gemma 3 27B and head_dim otherwise."""
    value = getattr(config, "query_pre_attn_scalar", None)
    if value:
        return float(value)
    if config.num_hidden_layers == 62 and str(getattr(config, "model_type", "")).startswith("gemma3"):
        return config.hidden_size / config.num_attention_heads
    return float(head_dim_of(config))
