"""Attention backend seam and the forward context.

The model runner builds one `CommonAttentionMetadata` per step (host tensors describing
the flattened batch); a backend's builder turns it into its own metadata once per step,
and every attention layer reads that metadata through the forward context. Backends
know nothing about requests or scheduling, only token/block layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class CommonAttentionMetadata:
    """Layout of one step's flattened batch.

    Tokens of request i occupy rows query_start_loc[i] : query_start_loc[i+1] of the
    flattened input. Request i has seq_lens[i] tokens of context once this step's tokens
    are written (cached prefix + this step's chunk), so its first new token sits at
    position seq_lens[i] - query_len(i).

        request:   |------ cached (context) ------|--- this step (query) ---|
        position:  0                         ctx_len                    seq_len
    """

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64, on the model device
    seq_lens: torch.Tensor  # [num_reqs] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64; unused entries are 0
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64: block_id * block_size + offset
    query_start_loc_cpu: list[int]  # host copies, for per-request Python loops
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int


class AttentionMetadataBuilder(Protocol):
    def build(self, common: CommonAttentionMetadata) -> Any: ...


class AttentionImpl(Protocol):
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, kv_heads, head_dim]
        metadata: Any,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


@dataclass
class ForwardContext:
    """What attention layers read during one forward: per-step metadata and the caches."""

    attn_metadata: Any
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # indexed by layer


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any, kv_caches: list) -> Iterator[None]:
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, kv_caches)
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("get_forward_context() called outside a model forward pass")
    return _forward_context
