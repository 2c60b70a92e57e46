"""The attention layer of every model: reads this step's metadata and its own layer's
paged KV cache from the forward context and hands them to the backend implementation.
It knows its layer index and head shapes, nothing about requests or blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import get_forward_context


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        backend: type,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        """Keys a query sees, itself included (None: the whole context)."""
        self.impl = backend.get_impl_cls()(num_heads, head_dim, scale, num_kv_heads,
                                           sliding_window, logits_soft_cap)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H * D]."""
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_idx]
        out = self.impl.forward(q, k, v, kv_cache, ctx.metadata_for(self.sliding_window))
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
