"""Reference paged-attention backend in plain PyTorch (the CPU default).

The builder turns one step's CommonAttentionMetadata into index tensors and masks once
per step; the impl then, for every layer, writes the step's K/V into the paged cache
through the slot mapping and attends: all single-token decodes in one padded batched
`scaled_dot_product_attention`, each prompt chunk on its own with a causal mask that is
offset by the request's cached prefix. Knows token/block layout, never requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.attention.backend import CommonAttentionMetadata


@dataclass
class PrefillChunk:
    """One request whose step covers more than one token.

    rows (flattened batch):  token_start ........ token_end      (q_len rows)
    positions:               ctx_len ............ seq_len - 1
    keys attended:           0 ..................... seq_len - 1
    """

    token_start: int
    token_end: int
    ctx_len: int
    """Tokens already in the cache before this chunk (prefix-cache hit or earlier chunks)."""
    seq_len: int
    block_ids: torch.Tensor | None
    """[ceil(seq_len / block_size)] blocks holding the whole sequence; None when ctx_len is 0
    (the chunk then attends only to its own fresh K/V)."""
    mask: torch.Tensor | None
    """[q_len, seq_len] bool, True = may attend; None when ctx_len is 0 (plain causal)."""


@dataclass
class DecodeBatch:
    """All requests with exactly one new token, attended together.

    Each request's keys are gathered from its first `num_blocks` blocks into a padded
    [num_blocks * block_size] row; `mask` hides the slots at or past its seq_len.
    """

    rows: slice | torch.Tensor
    """Rows of the decode tokens in the flattened batch (a slice when contiguous)."""
    block_table: torch.Tensor  # [B, num_blocks]
    mask: torch.Tensor  # [B, 1, num_blocks * block_size] bool, True = real key
    head_rows: torch.Tensor | None = None
    """[KVH * B * num_blocks] rows of the head-major cache view (see _gather_decode);
    computed by the first layer of the step and reused by the others."""
    bias: torch.Tensor | None = None
    """`mask` as an additive score bias (0 or -inf) in the model dtype; first layer."""
    chunks: list[tuple[int, int, DecodeBatch]] | None = None
    """(start, end, sub-batch) slices of the requests attended together; first layer."""


@dataclass
class TorchAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_actual_tokens]
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]
    decode_only: bool = False
    """Every row is a decode, in request order: the decode output is the whole output."""


class TorchAttentionMetadataBuilder:
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        qsl = common.query_start_loc_cpu
        decode_reqs = [i for i in range(common.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        prefill_reqs = [i for i in range(common.num_reqs) if qsl[i + 1] - qsl[i] > 1]
        decode = self._build_decode(common, decode_reqs) if decode_reqs else None
        return TorchAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            decode=decode,
            prefills=[self._build_prefill(common, i) for i in prefill_reqs],
            # with no prompt chunks, request i's single token is row i
            decode_only=decode is not None and not prefill_reqs,
        )

    def _build_decode(self, common: CommonAttentionMetadata, reqs: list[int]) -> DecodeBatch:
        qsl = common.query_start_loc_cpu
        token_rows = [qsl[i] for i in reqs]
        rows: slice | torch.Tensor
        if token_rows == list(range(token_rows[0], token_rows[0] + len(reqs))):
            rows = slice(token_rows[0], token_rows[0] + len(reqs))
        else:
            rows = torch.tensor(token_rows, dtype=torch.long, device=self.device)
        seq_lens = [common.seq_lens_cpu[i] for i in reqs]
        num_blocks = -(-max(seq_lens) // self.block_size)  # ceil: blocks of the longest
        req_idx = torch.tensor(reqs, dtype=torch.long, device=self.device)
        block_table = common.block_table.index_select(0, req_idx)[:, :num_blocks]
        # Slot s of a padded row is a real key iff s < seq_len.
        slots = torch.arange(num_blocks * self.block_size, device=self.device)
        lens = torch.tensor(seq_lens, dtype=torch.long, device=self.device)
        mask = (slots[None, :] < lens[:, None])[:, None, :]
        return DecodeBatch(rows=rows, block_table=block_table, mask=mask)

    def _build_prefill(self, common: CommonAttentionMetadata, i: int) -> PrefillChunk:
        start, end = common.query_start_loc_cpu[i], common.query_start_loc_cpu[i + 1]
        seq_len = common.seq_lens_cpu[i]
        ctx_len = seq_len - (end - start)
        if ctx_len == 0:
            return PrefillChunk(start, end, 0, seq_len, None, None)
        num_blocks = -(-seq_len // self.block_size)
        block_ids = common.block_table[i, :num_blocks]
        # Query row r sits at position ctx_len + r and sees keys 0 .. ctx_len + r.
        q_pos = torch.arange(ctx_len, seq_len, device=self.device)
        k_pos = torch.arange(seq_len, device=self.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        return PrefillChunk(start, end, ctx_len, seq_len, block_ids, mask)


class TorchAttentionImpl:
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads  # query heads per KV head (GQA)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D] -> [T, H, D]."""
        k_cache, v_cache = kv_cache
        n = metadata.num_actual_tokens
        self._write_kv(key[:n], value[:n], k_cache, v_cache, metadata.slot_mapping)
        if metadata.decode_only and metadata.decode and n == query.shape[0]:
            return self._decode(query, k_cache, v_cache, metadata.decode)  # no scatter needed
        out = query.new_zeros(query.shape) if n < query.shape[0] else torch.empty_like(query)
        if metadata.decode is not None:
            out[metadata.decode.rows] = self._decode(query, k_cache, v_cache, metadata.decode)
        for chunk in metadata.prefills:
            out[chunk.token_start : chunk.token_end] = self._prefill(
                query, key, value, k_cache, v_cache, chunk
            )
        return out

    @staticmethod
    def _write_kv(
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        # slot = block_id * block_size + offset indexes the [num_blocks * block_size]
        # token rows of a cache.
        nb, bs, kvh, d = k_cache.shape
        for cache, new in ((k_cache, key), (v_cache, value)):
            phys = cache.permute(2, 0, 1, 3)
            if phys.is_contiguous():  # head-major storage [KVH, nb, bs, D]
                phys.view(kvh, nb * bs, d).index_copy_(1, slot_mapping, new.transpose(0, 1))
            else:  # block-major storage [nb, bs, KVH, D]
                cache.view(-1, kvh, d).index_copy_(0, slot_mapping, new)

    def _decode(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: DecodeBatch
    ) -> torch.Tensor:
        """One query token per request against its whole (padded) context.

        The requests go in chunks whose gathered K/V stay in cache (DECODE_CHUNK_BYTES)
        between the gather and the matmuls that read them; gathering the whole batch at
        once makes both passes go to memory and costs ~2x at B=64.
        """
        q = query[dec.rows]
        if dec.chunks is None:
            dec.chunks = _decode_chunks(dec, self.num_kv_heads * self.head_dim * q.element_size())
        if len(dec.chunks) == 1:
            return self._decode_chunk(q, k_cache, v_cache, dec)
        out = torch.empty_like(q)
        for start, end, chunk in dec.chunks:
            out[start:end] = self._decode_chunk(q[start:end], k_cache, v_cache, chunk)
        return out

    def _decode_chunk(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: DecodeBatch
    ) -> torch.Tensor:
        """Plain batched matmuls over [KVH, B] rather than scaled_dot_product_attention:
        with one query row per head the fused CPU kernels spend more time on bookkeeping
        than on the math (measured 2.5 ms vs 1.4 ms per layer at B=64, 160 keys)."""
        b = q.shape[0]
        kvh, d = self.num_kv_heads, self.head_dim
        k, v = _gather_decode(k_cache, dec), _gather_decode(v_cache, dec)  # [KVH, B, L, D]
        # GQA without copying K/V: query head h = kv * group + g, so [B, H, D] is
        # [B, KVH, group, D] and each KV head serves its `group` query rows.
        q = q.reshape(b, kvh, self.group, d).transpose(0, 1)  # [KVH, B, group, D]
        if dec.bias is None:
            zeros = torch.zeros(dec.mask.shape, dtype=q.dtype, device=q.device)
            dec.bias = zeros.masked_fill_(~dec.mask, float("-inf"))  # [B, 1, L]
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(self.scale).add_(dec.bias)
        probs = torch.softmax(scores, dim=-1)  # [KVH, B, group, L]
        o = torch.matmul(probs, v)  # [KVH, B, group, D]
        return o.transpose(0, 1).reshape(b, self.num_heads, d)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        s, e = chunk.token_start, chunk.token_end
        q = query[s:e].transpose(0, 1)  # [H, q_len, D]
        if chunk.block_ids is None:  # nothing cached: the chunk's own K/V are all its keys
            k, v = key[s:e], value[s:e]
        else:  # cached prefix + this chunk, read back from the blocks
            kvh, d = self.num_kv_heads, self.head_dim
            k = k_cache.index_select(0, chunk.block_ids).view(-1, kvh, d)[: chunk.seq_len]
            v = v_cache.index_select(0, chunk.block_ids).view(-1, kvh, d)[: chunk.seq_len]
        # [L, KVH, D] -> [H, L, D]: each KV head repeated for its `group` query heads.
        k = k.transpose(0, 1).repeat_interleave(self.group, dim=0)
        v = v.transpose(0, 1).repeat_interleave(self.group, dim=0)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=self.scale
        )
        return o.transpose(0, 1)  # [q_len, H, D]


DECODE_CHUNK_BYTES = 2 << 20
"""Target size of one chunk's gathered keys (the values take as much again)."""
DECODE_CHUNK_MIN_REQS = 4
"""Fewest requests per chunk, so long contexts do not degrade into one small matmul per
request."""


def _decode_chunks(dec: DecodeBatch, bytes_per_key: int) -> list[tuple[int, int, DecodeBatch]]:
    """Splits the decode batch into runs of requests whose padded keys fill about
    DECODE_CHUNK_BYTES."""
    b, num_keys = dec.mask.shape[0], dec.mask.shape[-1]
    size = max(DECODE_CHUNK_MIN_REQS, DECODE_CHUNK_BYTES // (num_keys * bytes_per_key))
    if size >= b:
        return [(0, b, dec)]
    chunks = []
    for start in range(0, b, size):
        end = min(start + size, b)
        sub = DecodeBatch(slice(start, end), dec.block_table[start:end], dec.mask[start:end])
        chunks.append((start, end, sub))
    return chunks


def _gather_decode(cache: torch.Tensor, dec: DecodeBatch) -> torch.Tensor:
    """Keys (or values) of every decode request, padded: [KVH, B, num_blocks * bs, D].

    With head-major storage ([KVH, nb, bs, D] physically), each block of one KV head is
    one contiguous row of bs * D values, so one index_select over rows
        row(h, block) = h * nb + block
    copies exactly what attention reads, and the result is contiguous: the batched
    matmuls over [KVH, B] take it without another copy.
    """
    nb, bs, kvh, d = cache.shape
    b, n = dec.block_table.shape
    phys = cache.permute(2, 0, 1, 3)
    if not phys.is_contiguous():  # block-major storage: gather blocks, then transpose
        blocks = cache.index_select(0, dec.block_table.reshape(-1))
        return blocks.view(b, n * bs, kvh, d).permute(2, 0, 1, 3)
    if dec.head_rows is None:
        heads = torch.arange(kvh, device=cache.device)[:, None] * nb
        dec.head_rows = (heads + dec.block_table.reshape(1, -1)).reshape(-1)
    rows = phys.view(kvh * nb, bs * d).index_select(0, dec.head_rows)  # [KVH * B * n, bs * D]
    return rows.view(kvh, b, n * bs, d)


class TorchAttentionBackend:
    name = "torch"

    @staticmethod
    def get_builder_cls() -> type[TorchAttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[TorchAttentionImpl]:
        return TorchAttentionImpl
