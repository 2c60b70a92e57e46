"""BERT family encoders (sentence-transformers' all-MiniLM, BGE, E5 and other `BertModel`
checkpoints): embeddings of tokens, absolute positions and token type 0, then post-norm
layers of bidirectional self-attention and a GELU MLP. An embedding model only (a pooling
engine): each prompt runs whole in one step, so attention needs no KV cache.

Input: flattened token ids and positions of one step [T], every request's prompt from
position 0 to its end (the engine turns chunked prefill and prefix caching off for an
encoder); output: the last layer's hidden states [T, H], which the runner's pooler reads.
Requests are told apart by their positions (each starts at 0), so no attention metadata
is needed; one scaled-dot-product call attends within each request, shorter ones padded
and masked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.model_executor.layers.linear import (
    GELU,
    GELU_TANH,
    RELU,
    Embedding,
    Linear,
    MergedLinear,
)
from pagellm.model_executor.layers.quantization import QuantizationConfig
from pagellm.model_executor.models.llama import load_checkpoint_tensor
from pagellm.utils import PROGRESS

_ACTIVATIONS = {"gelu": GELU, "gelu_new": GELU_TANH, "gelu_pytorch_tanh": GELU_TANH, "relu": RELU}
"""hidden_act -> the MLP's activation, fused into its first product where oneDNN multiplies."""

# Hugging Face's q/k/v names -> the fused projection's part names (llama.STACKED_PARAMS)
_RENAMES = {".attention.self.query.": ".attention.self.q_proj.",
            ".attention.self.key.": ".attention.self.k_proj.",
            ".attention.self.value.": ".attention.self.v_proj."}
_SKIPPED = ("pooler.", "embeddings.position_ids", "cls.")
"""Checkpoint tensors an embedding model does not use: BERT's next-sentence pooler (not
sentence-transformers' pooling), the position-id buffer, a masked-LM head."""


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size, quant_config,
                                         "embeddings.word_embeddings")
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(getattr(config, "type_vocab_size", 2), config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings.forward(input_ids)
        x = x + self.position_embeddings.weight[positions] + self.token_type_embeddings.weight[0]
        return self.LayerNorm.forward(x)


class _SelfAttention(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        h = config.hidden_size
        self.qkv_proj = MergedLinear(h, [h, h, h], True, quant_config, f"{prefix}.qkv_proj")


class _DenseNorm(nn.Module):
    """dense, then LayerNorm of the residual plus it (BERT's post-norm sub-block end)."""

    def __init__(self, in_features: int, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        self.dense = Linear(in_features, config.hidden_size, True, quant_config, f"{prefix}.dense")
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm.forward(self.dense.forward(x) + residual)


class _Attention(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.self = _SelfAttention(config, quant_config, f"{prefix}.self")
        self.output = _DenseNorm(config.hidden_size, config, quant_config, f"{prefix}.output")


class _Intermediate(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, True, quant_config,
                            f"{prefix}.dense")


class BertLayer(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"BertModel: hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[act]
        self.attention = _Attention(config, quant_config, f"{prefix}.attention")
        self.intermediate = _Intermediate(config, quant_config, f"{prefix}.intermediate")
        self.output = _DenseNorm(config.intermediate_size, config, quant_config, f"{prefix}.output")

    def forward(self, x: torch.Tensor, batch: _Requests) -> torch.Tensor:
        qkv = self.attention.self.qkv_proj.forward(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        attended = batch.attend(qkv).reshape(x.shape)
        x = self.attention.output.forward(attended, x)
        return self.output.forward(self.intermediate.dense.forward_activated(x, self.act), x)


class _Requests:
    """The step's requests as a padded batch: request i holds rows starts[i] ..
    starts[i] + lengths[i] - 1 of the flat batch."""

    def __init__(self, positions: torch.Tensor) -> None:
        total = positions.shape[0]
        starts = torch.nonzero(positions == 0).flatten()
        if total == 0 or starts.numel() == 0 or int(starts[0]) != 0:
            raise RuntimeError("an encoder step must hold whole prompts (each from position 0)")
        lengths = torch.diff(starts, append=torch.tensor([total], device=starts.device))
        offsets = torch.arange(total, device=positions.device) - torch.repeat_interleave(starts, lengths)
        if not torch.equal(offsets, positions):
            raise RuntimeError("an encoder step must hold whole prompts (positions 0, 1, 2, ...)")
        self.single = starts.numel() == 1
        if not self.single:
            width = int(lengths.max())
            cols = torch.arange(width, device=positions.device)
            valid = cols[None, :] < lengths[:, None]  # [B, L]
            self.shape = tuple(valid.shape)
            # index_select over flat rows: a third faster than indexing with [B, L] or a
            # boolean mask (the gathers took half of attention's time)
            self.rows = (starts[:, None] + cols[None, :]).clamp_(max=total - 1).flatten()  # [B*L]
            self.valid_rows = valid.flatten().nonzero().flatten()  # [T], the flat order
            self.mask = valid[:, None, None, :]  # keys each query may see

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, 3, H, D] -> attention output [T, H, D], each request by itself."""
        if self.single:
            q, k, v = qkv.permute(1, 2, 0, 3)  # each [H, T, D]
            return F.scaled_dot_product_attention(q, k, v).transpose(0, 1)
        b, width = self.shape
        _, _, h, d = qkv.shape
        padded = qkv.index_select(0, self.rows).view(b, width, 3, h, d)
        q, k, v = padded.permute(2, 0, 3, 1, 4)  # each [B, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return out.transpose(1, 2).reshape(b * width, h, d).index_select(0, self.valid_rows)


class _Encoder(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, quant_config, f"encoder.layer.{i}")
                                   for i in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """Hugging Face's `BertModel` layout and names (the checkpoint's own, with q/k/v fused
    into `qkv_proj` at load); `forward` gives the last layer's hidden states."""

    layer_attention = None
    """No per-layer attention facts: the runner builds no sliding-window groups."""

    def __init__(self, config: Any, attn_backend: type, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BertModel: position_embedding_type {config.position_embedding_type!r} "
                             "is not supported (absolute only)")
        self.config = config
        self.embeddings = BertEmbeddings(config, quant_config)
        self.encoder = _Encoder(config, quant_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 (whole prompts) -> hidden states [T, hidden]."""
        batch = _Requests(positions)
        x = self.embeddings.forward(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer.forward(x, batch)
            PROGRESS.tick()
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("BertModel is an encoder: it pools, it has no logits")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(_SKIPPED):
                continue
            for old, new in _RENAMES.items():
                name = name.replace(old, new)
            loaded.update(load_checkpoint_tensor(self, name, tensor))
        return loaded
