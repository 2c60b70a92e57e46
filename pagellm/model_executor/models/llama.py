"""Llama family (Llama 2/3, SmolLM, TinyLlama, Mistral): decoder-only transformer with
RMSNorm, rotary embeddings, grouped-query attention and a SiLU-gated MLP.

Input: flattened token ids and positions of one step [T]; output: hidden states [T, H].
Qwen2 and Qwen3 reuse these modules with two switches (q/k/v bias, per-head q/k norm);
Gemma brings its own decoder layer and norms (`LlamaModel(layer_cls=, norm_cls=)`) and
per-layer attention facts (`LayerAttention`: scale, sliding window, score cap).
Paged attention state comes from the forward context, never from arguments. Inside a
forward, submodules are called through `.forward`: nn.Module.__call__'s hook handling
costs ~2 us a call, and a decode step makes ~11 such calls per layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.config.arch_config import head_dim_of, num_kv_heads_of
from pagellm.model_executor.layers.activation import get_act_and_mul
from pagellm.model_executor.layers.attention import Attention
from pagellm.model_executor.layers.layernorm import RMSNorm
from pagellm.model_executor.layers.linear import Embedding, Linear, MergedLinear
from pagellm.model_executor.layers.logits import compute_logits
from pagellm.model_executor.layers.quantization import QuantizationConfig
from pagellm.model_executor.layers.rotary_embedding import RopeTables, RotaryEmbedding, get_rope
from pagellm.model_executor.models.fused_decode import FusedDecodeStack, FusedLayer
from pagellm.model_executor.parallel_state import building_with, current_group
from pagellm.model_executor.weight_utils import GGUFFamily
from pagellm.utils import PROGRESS

# (fused module, checkpoint module, shard index): checkpoint weights of the right-hand
# projection are copied into one part of the fused weight. A tensor named for the fused
# module itself (Phi-3 stores qkv_proj, gate_up_proj) fills all its parts.
STACKED_PARAMS: list[tuple[str, str, int]] = [
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


@dataclass(frozen=True)
class LayerOptions:
    """How a family's attention block differs from Llama's."""

    qkv_bias: bool
    """Bias on the fused q/k/v projection."""
    o_bias: bool
    """Bias on the output projection."""
    qk_norm: bool
    """Per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)."""


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention facts, handed to its AttentionImpl."""

    scale: float
    """Multiplies q.k (head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)."""
    sliding_window: int | None = None
    """Keys a query sees, itself included; None: the whole context."""
    logits_soft_cap: float | None = None
    """Scores become cap * tanh(score / cap) (Gemma 2); None: uncapped."""
    rope: bool = True
    """Whether q and k are rotated (SmolLM3 leaves every 4th layer without rope)."""


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        backend: type,
        opts: LayerOptions,
        attn: LayerAttention,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        norm_cls: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        # under tensor parallelism this rank's heads: q|k|v split by heads (column
        # parallel), o_proj over this rank's heads' columns (row parallel, summed)
        tp = current_group()
        _, self.num_heads = tp.shard(config.num_attention_heads, "num_attention_heads")
        _, self.num_kv_heads = tp.shard(num_kv_heads_of(config), "num_key_value_heads")
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.head_splits = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        q_full, kv_full = self.q_size * tp.size, self.kv_size * tp.size
        self.qkv_proj = MergedLinear(
            config.hidden_size, [q_full, kv_full, kv_full], opts.qkv_bias,
            quant_config, f"{prefix}.qkv_proj", parallel="column",
        )
        self.o_proj = Linear(q_full, config.hidden_size, opts.o_bias, quant_config,
                             f"{prefix}.o_proj", parallel="row")
        eps = config.rms_norm_eps
        self.use_rope = attn.rope
        self.q_norm = norm_cls(self.head_dim, eps) if opts.qk_norm else None
        self.k_norm = norm_cls(self.head_dim, eps) if opts.qk_norm else None
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            attn.scale,
            self.num_kv_heads,
            layer_idx,
            backend,
            attn.sliding_window,
            attn.logits_soft_cap,
        )

    def forward(self, rope: RopeTables, hidden: torch.Tensor) -> torch.Tensor:
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj.forward(hidden)
        # [T, H + KVH + KVH, D]: q heads, k heads, v heads side by side, so one rotation
        # (in place) covers q and k
        heads = qkv.view(hidden.shape[0], h + 2 * kvh, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            self._qk_norm(heads)
        if self.use_rope:
            RotaryEmbedding.rotate_(heads, h + kvh, rope)
        q, k, v = heads.split(self.head_splits, 1)
        return self.o_proj.forward(self.attn.forward(q, k, v))


    def _qk_norm(self, heads: torch.Tensor) -> None:
        """Per-head norm of the q and k heads of heads [T, H + 2 KVH, D], in place: one C
        pass over contiguous float32 heads (`pg_head_rms_norm`), else the norms' own
        forward on each half."""
        h, kvh, qn, kn = self.num_heads, self.num_kv_heads, self.q_norm, self.k_norm
        lib = qn.kernels if heads.is_cpu else None  # the norm's CPU kernels
        if (lib is not None and heads.dtype == torch.float32 == qn.weight.dtype == kn.weight.dtype
                and heads.stride(2) == 1 and heads.stride(1) == self.head_dim):
            lib.pg_head_rms_norm(heads.data_ptr(), heads.stride(0), heads.shape[0], h, kvh,
                                 self.head_dim, qn.weight.data_ptr(), kn.weight.data_ptr(),
                                 qn.variance_epsilon)
            return
        heads[:, :h] = qn.forward_single(heads[:, :h])
        heads[:, h : h + kvh] = kn.forward_single(heads[:, h : h + kvh])


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", hidden_act: str | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias, quant_config,
                                         f"{prefix}.gate_up_proj", parallel="column")
        self.act_fn = get_act_and_mul(hidden_act or getattr(config, "hidden_act", "silu"))
        self.down_proj = Linear(inter, config.hidden_size, bias, quant_config,
                                f"{prefix}.down_proj", parallel="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.gate_up_proj.forward_gated(x, self.act_fn))


class LlamaDecoderLayer(nn.Module):
    norm_cls: type[RMSNorm] = RMSNorm
    """The layer's norms (and q/k norms) class (Gemma's scales by 1 + w)."""

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
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, backend, opts, attn, quant_config,
                                        f"{prefix}.self_attn", norm_cls=self.norm_cls)
        self.mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        self.input_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config: Any, layer_idx: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        """The feed-forward block (a family with experts makes its own here)."""
        return LlamaMLP(config, quant_config, prefix)

    def forward(
        self, rope: RopeTables, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block. `residual` carries the un-normalised stream; each norm first
        adds the previous sub-block's output to it (x + f(norm(x)) overall)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward_single(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(rope, hidden)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual

    def fused_layer(self) -> FusedLayer:
        """This layer as the one-region C stack runs it (models/fused_decode.py)."""
        a, m = self.self_attn, self.mlp
        return FusedLayer(self.input_layernorm, self.post_attention_layernorm, a.qkv_proj,
                          a.o_proj, m.gate_up_proj, m.down_proj, a.attn, m.act_fn,
                          q_norm=a.q_norm, k_norm=a.k_norm, rope=a.use_rope)


class LlamaModel(nn.Module):
    """Embedding, the decoder layers (`layer_cls`, one per entry of `layer_attention`)
    and the final norm (`norm_cls`). Subclasses change how tokens are embedded (`embed`)
    and which rope tables each layer gets (`rope_tables`)."""

    def __init__(self, config: Any, backend: type, opts: LayerOptions,
                 layer_attention: list[LayerAttention],
                 quant_config: QuantizationConfig | None = None, prefix: str = "model",
                 layer_cls: type[nn.Module] = LlamaDecoderLayer,
                 norm_cls: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.tp = current_group()
        """The tensor-parallel group of the layers' shards (one rank: the whole model)."""
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, quant_config,
                                      f"{prefix}.embed_tokens", vocab_parallel=True)
        self.rotary_emb = get_rope(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            layer_cls(config, i, backend, opts, attn, quant_config, f"{prefix}.layers.{i}")
            for i, attn in enumerate(layer_attention)
        )
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.fused_decode: FusedDecodeStack | None = None
        """All layers of a decode step in one C call (models/fused_decode.py), where the
        loaded weights and kernels allow it; made at the first forward."""
        self._fused_checked = False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.forward(input_ids)

    def layer_ropes(self) -> list[RotaryEmbedding]:
        """Each layer's rope (one shared by all layers here)."""
        return [self.rotary_emb] * len(self.layers)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[RopeTables]:
        """Each layer's rope inputs for the step, made once per distinct rope."""
        made: dict[int, RopeTables] = {}
        tables = []
        for rope in self.layer_ropes():
            if id(rope) not in made:
                made[id(rope)] = rope.tables(positions, dtype)
            tables.append(made[id(rope)])
        return tables

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        ropes = self.rope_tables(positions, hidden.dtype)  # once per step
        if not self._fused_checked and not torch.compiler.is_compiling():
            # the one-region C stack has no place for the ranks' sums between layers
            fused = FusedDecodeStack.build(self) if self.tp.size == 1 else None
            self.fused_decode, self._fused_checked = fused, True
        fused = None
        if self.fused_decode is not None and not torch.compiler.is_compiling():
            fused = self.fused_decode.run(hidden, ropes)
        if fused is not None:
            hidden, residual = fused
        else:
            residual: torch.Tensor | None = None
            for layer, rope in zip(self.layers, ropes):
                hidden, residual = layer.forward(rope, hidden, residual)
                PROGRESS.tick()  # a long prefill step shows progress a layer at a time
        hidden, _ = self.norm.forward(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Causal LM head over LlamaModel. Families override `layer_options`,
    `layer_attention_of` (per-layer facts), `model_cls` and `gguf_family`."""

    model_cls: type[LlamaModel] = LlamaModel
    supports_tensor_parallel = True
    """Whether the family's layers take a rank's shard (parallel_state); a family whose
    layers do not (the MoE families' experts) sets False and is refused above one rank."""
    gguf_family = GGUFFamily(permuted_qk=True)
    """What llama.cpp's converter did to this family's tensors (weight_utils)."""

    def __init__(self, config: Any, attn_backend: type,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.layer_attention = self.layer_attention_of(config)
        """Each layer's attention facts (the model runner reads the windows)."""
        self.model = self.model_cls(config, attn_backend, self.layer_options(config),
                                    self.layer_attention, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, quant_config,
                                  "lm_head", parallel="vocab")

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return LayerOptions(qkv_bias=bias, o_bias=bias, qk_norm=False)

    @classmethod
    def layer_attention_of(cls, config: Any) -> list[LayerAttention]:
        """One entry per layer: head_dim ** -0.5 and the family's one window."""
        attn = LayerAttention(head_dim_of(config) ** -0.5, cls.get_sliding_window(config))
        return [attn] * config.num_hidden_layers

    @classmethod
    def get_sliding_window(cls, config: Any) -> int | None:
        """Llama attends over the whole context. Qwen configs can ask for a window on
        only some layers (`use_sliding_window` with `max_window_layers`), which the
        attention backend cannot express: refused rather than silently attending to all."""
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                f"{cls.__name__}: use_sliding_window=True (a window on layers from "
                "max_window_layers on) is not supported; set it to false to attend over the "
                "whole context"
            )
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 -> hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        assert self.lm_head is not None, "process_weights_after_loading sets the tied head"
        return compute_logits(hidden, self.lm_head)

    def process_weights_after_loading(self) -> None:
        """Tied embeddings: the head becomes a Linear over the embedding's weight (shared,
        not copied), so it takes the same kernels as an untied head."""
        if self.lm_head is None:
            embed = self.model.embed_tokens
            with building_with(embed.tp):  # the rows of the vocabulary the table keeps
                self.lm_head = Linear(embed.embedding_dim, embed.full_num_embeddings, False,
                                      self.quant_config, "lm_head", parallel="vocab")
            embed.tie_head(self.lm_head)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Hand checkpoint tensors (Hugging Face names) to the layers that own them; the
        parts of fused layers by shard index, or all at once from a tensor stored fused.
        Returns the names that were filled (`layer.weight#i` for part i of a fused layer)."""
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store a copy of the embedding
            loaded.update(load_checkpoint_tensor(self, name, tensor))
        return loaded


def load_checkpoint_tensor(model: nn.Module, name: str, tensor: Any) -> list[str]:
    """Load one checkpoint tensor; returns the names it landed in: one, or every part of a
    fused layer for a tensor of the whole layer (the layer splits it: shard None)."""
    module_name, _, param_name = name.rpartition(".")
    shard: int | None = None
    for fused, part, index in STACKED_PARAMS:
        if module_name.endswith(f".{part}"):
            module_name, shard = module_name[: -len(part)] + fused, index
            break
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise KeyError(f"unexpected checkpoint tensor {name!r}") from None
    loader = getattr(module, "weight_loader", None)
    if loader is not None:
        # the names the layer expects: `weight` for a plain layer, `weight#i` for part i
        expected = module.expected_weights()
        if shard is not None:
            targets = [t for t in (param_name, f"{param_name}#{shard}") if t in expected][:1]
        else:  # the layer's own name: its one weight, or all its parts
            targets = [t for t in expected if t.partition("#")[0] == param_name]
            shard = 0 if len(targets) == 1 else None
        if not targets:
            raise KeyError(f"unexpected checkpoint tensor {name!r}")
        try:
            loader(param_name, shard, tensor)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        return [f"{module_name}.{t}" for t in targets]
    param = getattr(module, param_name, None)
    if not isinstance(param, nn.Parameter):
        raise KeyError(f"unexpected checkpoint tensor {name!r}")
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
    return [name]


def sliding_window_of(config: Any) -> int | None:
    """config.sliding_window (None: the whole context), refused unless positive."""
    window = getattr(config, "sliding_window", None)
    if window is not None and window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window}")
    return window


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral shares Llama's layout; every layer attends only to the last
    `config.sliding_window` positions when that is set (Mistral 7B v0.1: 4096)."""

    @classmethod
    def get_sliding_window(cls, config: Any) -> int | None:
        return sliding_window_of(config)
