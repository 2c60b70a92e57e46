"""Qwen2-MoE, Qwen3-MoE and Mixtral: the Qwen2 / Qwen3 / Llama attention with a
mixture-of-experts feed-forward (layers/fused_moe.py) in the layers that have one.

- `mlp.gate`: the router, a [num_experts, hidden] linear; each token takes the top
  `num_experts_per_tok` experts by softmax probability (Qwen3-MoE renormalises them,
  `norm_topk_prob`);
- `mlp.experts`: SiLU-gated MLPs of `moe_intermediate_size` (Mixtral: `intermediate_size`;
  its checkpoints name the block `block_sparse_moe` and the projections w1 / w3 / w2, and
  it always renormalises its top 2);
- Qwen2-MoE also runs a shared expert on every token, scaled by
  sigmoid(`shared_expert_gate`(x)).
Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step`, keep a dense MLP.

Input/output as LlamaForCausalLM. Each chosen expert runs once a step for all its
tokens; with GGUF experts (and no shared expert) the whole step runs in the one-region
C stack (decode_step.c's moe_ffn), else layer by layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.model_executor.layers.fused_moe import FusedMoE
from pagellm.model_executor.layers.linear import Linear
from pagellm.model_executor.layers.quantization import QuantizationConfig
from pagellm.model_executor.models.fused_decode import FusedLayer
from pagellm.model_executor.models.llama import (
    LayerOptions,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    MistralForCausalLM,
)
from pagellm.model_executor.weight_utils import LLAMA_GGUF_LAYER_NAMES, GGUFFamily

_GGUF_LAYER_NAMES = {
    **LLAMA_GGUF_LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


def num_experts_of(config: Any) -> int:
    """num_experts (GGUF metadata, older configs) or num_local_experts (transformers 5)."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0))


class SparseMoeBlock(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None, prefix: str,
                 renormalize: bool, shared_expert: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.gate = Linear(h, num_experts_of(config), False, quant_config, f"{prefix}.gate")
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.experts = FusedMoE(num_experts_of(config), config.num_experts_per_tok, h, inter,
                                renormalize, quant_config, f"{prefix}.experts")
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert:
            shared = dict(vars(config), intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(type(config)(shared), quant_config, f"{prefix}.shared_expert")
            self.shared_expert_gate = Linear(h, 1, False, quant_config, f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.forward(x, self.gate.forward(x))
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(x)
            out = out + torch.sigmoid(self.shared_expert_gate.forward(x)) * shared
        return out


class MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: Any, layer_idx: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        sparse = (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
                  and num_experts_of(config) > 0
                  and (layer_idx + 1) % (getattr(config, "decoder_sparse_step", 1) or 1) == 0)
        if not sparse:
            return LlamaMLP(config, quant_config, prefix)
        model_type = str(getattr(config, "model_type", ""))
        qwen2 = model_type.startswith("qwen2")
        renormalize = model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", not qwen2))
        return SparseMoeBlock(config, quant_config, prefix, renormalize=renormalize,
                              shared_expert=qwen2 and bool(getattr(config, "shared_expert_intermediate_size", 0)))

    def fused_layer(self) -> FusedLayer | None:
        """Dense layers are Llama's; a layer with experts in GGUF blocks gives its router
        and experts; a shared expert (Qwen2-MoE) or float experts keep the module path."""
        mlp = self.mlp
        if not isinstance(mlp, SparseMoeBlock):
            return super().fused_layer()
        if mlp.shared_expert is not None or not mlp.experts.gguf:
            return None
        a = self.self_attn
        return FusedLayer(self.input_layernorm, self.post_attention_layernorm, a.qkv_proj,
                          a.o_proj, None, None, a.attn, mlp.experts.act, q_norm=a.q_norm,
                          k_norm=a.k_norm, router=mlp.gate, moe=mlp.experts)


class MoeModel(LlamaModel):
    def __init__(self, config: Any, backend: type, opts: LayerOptions, layer_attention: list,
                 quant_config: QuantizationConfig | None = None, prefix: str = "model") -> None:
        super().__init__(config, backend, opts, layer_attention, quant_config, prefix,
                         layer_cls=MoeDecoderLayer)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_cls = MoeModel
    gguf_family = GGUFFamily(layer_names=_GGUF_LAYER_NAMES)  # q/k rows in HF order
    supports_tensor_parallel = False  # the experts are not split across ranks yet

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return LayerOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """As LlamaForCausalLM's, with the experts' tensors handed to their FusedMoE:
        `...mlp.experts.{e}.{gate,up,down}_proj.weight` one expert at a time (HF) or
        `...mlp.experts.{gate,up,down}_proj.weight` stacked (GGUF)."""
        moes: dict[str, FusedMoE] = {}

        def others() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                head, sep, tail = name.partition(".experts.")
                if not sep or not head.endswith(".mlp"):
                    yield name, tensor
                    continue
                moe = moes.setdefault(head, self.get_submodule(f"{head}.experts"))
                parts = tail.removesuffix(".weight").split(".")
                expert, projection = (None, parts[0]) if len(parts) == 1 else (int(parts[0]), parts[1])
                try:
                    moe.load_expert(projection, expert, tensor)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from e

        loaded = super().load_weights(others())
        for head, moe in moes.items():
            loaded.update(f"{head}.experts.{p}" for p in moe.loaded_weights())
        return loaded


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return LayerOptions(qkv_bias=True, o_bias=False, qk_norm=False)



_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                  ".w2.": ".down_proj."}


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    """Mixtral: Llama's attention (llama.cpp's converter permutes its q/k rows; its GGUF
    architecture is `llama` with `llama.expert_count`), 8 experts, top 2 renormalised,
    every layer sparse; Mistral's optional sliding window."""

    gguf_family = GGUFFamily(layer_names=_GGUF_LAYER_NAMES, permuted_qk=True)

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return LayerOptions(qkv_bias=False, o_bias=False, qk_norm=False)

    get_sliding_window = MistralForCausalLM.get_sliding_window

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                if ".block_sparse_moe." in name:
                    for old, new in _MIXTRAL_NAMES.items():
                        name = name.replace(old, new)
                yield name, tensor

        return super().load_weights(renamed())
