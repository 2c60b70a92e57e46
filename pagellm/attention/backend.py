"""Attention backend seam (abstract classes, vLLM's shape) and the forward context.

The model runner builds one `CommonAttentionMetadata` per step (tensors describing the
flattened batch); a backend's builder turns it into its own metadata once per step,
and every attention layer reads that metadata through the forward context. Backends
know nothing about requests or scheduling, only token/block layout.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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
    verify_reqs: frozenset[int] = frozenset()
    """Requests whose several rows are a decoded token and proposals after it
    (speculative decoding): each row attends as a one-token decode of its own, so that it
    gives the numbers it would give decoded alone."""


Q8_KV_DTYPE = torch.int8
"""The storage dtype of a q8_0 cache (--kv-cache-dtype q8_0, `cache_torch_dtype`): bytes
holding llama.cpp's q8_0 blocks, every 32 dims of a slot's key or value as 32 int8 values
and a float16 scale, the scales in the same rows after the values (paged_attention.c's
header): a head's row is D + D / 16 bytes wide. Only the C kernels read and write it."""


def cache_torch_dtype(cache_dtype: str) -> torch.dtype:
    """The storage dtype of CacheConfig.cache_dtype (a torch dtype name, or q8_0)."""
    return Q8_KV_DTYPE if cache_dtype == "q8_0" else getattr(torch, cache_dtype)


class AttentionBackend(ABC):
    """A backend is a class, never instantiated: selected once by name
    (`pagellm.attention.get_attn_backend`) and handed to both the model, whose attention
    layers make its impl, and the model runner, which makes its builder and KV cache."""

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """The name it is registered and selected under (`--attention-backend`)."""

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        """The per-step metadata builder, made once by the model runner."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        """The per-layer forward, made once by every attention layer."""

    @staticmethod
    @abstractmethod
    def allocate_kv_cache(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's (K, V) cache, uninitialised, each seen as [num_blocks, block_size,
        num_kv_heads, head_dim]; the storage behind those views is the layout its impl
        reads (the impl may refuse any other)."""

    @staticmethod
    def kv_cache_block_bytes(block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
        """Bytes one block of one layer's cache takes (K and V together) in the storage
        `allocate_kv_cache` makes: what the runner budgets by. A backend whose layout pads
        or keeps scales says so here."""
        return 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


class AttentionMetadataBuilder(ABC):
    """Turns each step's CommonAttentionMetadata into the backend's own metadata, once
    per step for all layers. Made as `cls(block_size, device, sliding_window=None)`."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """The backend's metadata for this step; layers read it from the forward context."""


class AttentionImpl(ABC):
    """One attention layer's forward. Made by the layer as `cls(num_heads, head_dim,
    scale, num_kv_heads, sliding_window=None, logits_soft_cap=None)`: the layer's own
    facts (Gemma's layers differ in window; Gemma 2 caps scores as
    `cap * tanh(score / cap)`). The window also shaped the metadata the layer is handed
    (`ForwardContext.metadata_for`)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, kv_heads, head_dim]
        metadata: Any,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Writes this step's key/value into `kv_cache` through the metadata's slot
        mapping, then attends each query row to its request's context."""


@dataclass
class ForwardContext:
    """What attention layers read during one forward: per-step metadata and the caches."""

    attn_metadata: Any
    """The metadata of the first layer's window (every layer's, where all share one)."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # indexed by layer
    generated_rows: slice | torch.Tensor | None = None
    """Rows whose input is a generated token (one-token decodes past the prompt), as the
    model runner knows them; None: not given (then `decode_rows` reads the metadata)."""

    metadata_by_window: dict[int | None, Any] | None = None
    """Where layers differ in sliding window: each window's metadata (None: one for all)."""

    def metadata_for(self, window: int | None) -> Any:
        """The metadata built for layers of sliding window `window` (None: full context)."""
        if self.metadata_by_window is None:
            return self.attn_metadata
        return self.metadata_by_window[window]

    @property
    def decode_rows(self) -> slice | torch.Tensor | None:
        """Rows of the step's flattened batch that decode a generated token: the runner's
        `generated_rows`, else the one-token rows of the backend's metadata
        (`decode_rows`; a prompt's last token read alone counts there too). None: none."""
        if self.generated_rows is not None:
            return self.generated_rows
        return getattr(self.attn_metadata, "decode_rows", None)


_forward_context: ForwardContext | None = None


class AttentionGroups:
    """One metadata builder per distinct sliding window among a model's layers (vLLM's
    KV cache groups, with one cache layout for all): `build` makes each window's
    metadata once per step. `windows` lists every layer's window (None: full context)."""

    def __init__(self, backend: type[AttentionBackend], block_size: int, device: torch.device,
                 windows: list[int | None]) -> None:
        self.windows = windows
        distinct = list(dict.fromkeys(windows))
        self.builders = {w: backend.get_builder_cls()(block_size, device, sliding_window=w)
                         for w in distinct}
        self.primary = self.builders[distinct[0]]
        """The first layer's builder (`ForwardContext.attn_metadata`)."""

    def build(self, common: CommonAttentionMetadata) -> tuple[Any, dict[int | None, Any] | None]:
        """(the first layer's metadata, every window's where there are several)."""
        if len(self.builders) == 1:
            return self.primary.build(common), None
        by_window = {w: b.build(common) for w, b in self.builders.items()}
        return by_window[self.windows[0]], by_window


def model_layer_windows(model: Any) -> list[int | None]:
    """Each layer's sliding window as the model declares it (`layer_attention`; a model
    without it attends over the whole context)."""
    facts = getattr(model, "layer_attention", None)
    return [f.sliding_window for f in facts] if facts else [None]


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any, kv_caches: list,
                        generated_rows: slice | torch.Tensor | None = None,
                        metadata_by_window: dict[int | None, Any] | None = None) -> Iterator[None]:
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, kv_caches, generated_rows, metadata_by_window)
    try:
        yield
    finally:
        _forward_context = prev


def current_forward_context() -> ForwardContext | None:
    """The forward pass under way, or None outside one (e.g. the logits head)."""
    return _forward_context


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("get_forward_context() called outside a model forward pass")
    return _forward_context
