"""Paged-attention backend on torch tensors (the CPU default), with the C kernels of
pagellm/kernels for the KV write and decode attention where they build.

The builder turns one step's CommonAttentionMetadata into index tensors and masks once
per step; the impl then, for every layer, writes the step's K/V into the paged cache
through the slot mapping and attends: all single-token decodes together, reading K and V
straight out of their blocks (see `_decode`), each prompt chunk on its own with a causal
mask that is offset by the request's cached prefix. Knows token/block layout, never
requests.

Cache storage (`allocate_kv_cache`) in the cache dtype (float32, or float16 / bfloat16
with --kv-cache-dtype: values are rounded as they are written and widened as they are
read; or q8_0, int8 rows with their scales that only the C kernels touch, `Q8_KV_DTYPE`),
both exposed as logical [num_blocks, block_size, KVH, D] views:

    K  [KVH, num_blocks, D, block_size]   a block's keys transposed: one row per (head,
                                          block, dim), block_size wide
    V  [KVH, num_blocks, block_size, D]   one row per (head, slot), D wide
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from pagellm.attention.backend import (
    Q8_KV_DTYPE,
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagellm.platforms import platform_of
from pagellm.utils import cdiv


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
    window: int | None = None
    """The sliding window that cuts into the chunk (None: none does)."""
    device: torch.device | None = None

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """[q_len, seq_len] bool, True = may attend; None when plain causal (ctx_len is 0
        and no sliding window cuts into the chunk). Built on first use: a step whose prompt
        chunks the C kernel attends (PromptRows) never needs it."""
        if self.ctx_len == 0 and self.window is None:
            return None
        # Query row r sits at position ctx_len + r and sees keys 0 .. ctx_len + r
        # (with a window W, only the last W of them).
        q_pos = torch.arange(self.ctx_len, self.seq_len, device=self.device)
        k_pos = torch.arange(self.seq_len, device=self.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if self.window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - self.window
        return mask


@dataclass
class DecodeBatch:
    """All requests with exactly one new token, attended together.

    Each request attends over `num_blocks` blocks (as many as the longest one reads) as
    one padded row of num_blocks * block_size keys; `mask` hides the slots at or past
    its seq_len. With a sliding window W a row starts at the block holding position
    seq_len - W (blocks before it are not read) and the mask also hides the positions
    before seq_len - W.
    """

    rows: slice | torch.Tensor
    """Rows of the decode tokens in the flattened batch (a slice when contiguous)."""
    block_table: torch.Tensor  # [B, num_blocks]
    mask: torch.Tensor  # [B, 1, num_blocks * block_size] bool, True = real key
    req_blocks: list[int]
    """Blocks each request actually reads (ceil(seq_len / block_size), less the blocks
    skipped before a sliding window)."""
    slot_lo: torch.Tensor | None = None
    slot_hi: torch.Tensor | None = None
    """[B] int64: the real keys of request b are slots [slot_lo, slot_hi) of its padded
    row (what `mask` says, as bounds for the C kernel)."""
    max_slots: int = 0
    lookups: _DecodeLookups | None = None
    """Cache row indices and score bias; made by the first layer of the step (they need
    the cache's geometry) and reused by the others."""


@dataclass
class _DecodeLookups:
    """Which cache rows each bag of `_decode` sums. A bag is one (request b, query head
    h, block j) for the scores and one (b, h) for the output; only the blocks a request
    uses get bags, so a short request next to a long one costs its own length.

    P = H * sum_b(blocks of b): the (b, h, j) triples in that order.
    """

    key_rows: torch.Tensor
    """[P, D]: for triple (b, h, j) the D rows (one per dim d) of the K storage viewed as
    [KVH * num_blocks_total * D, bs]."""
    value_rows: torch.Tensor
    """[P * bs]: every slot of every triple, as a row of the V storage viewed as
    [KVH * num_blocks_total * bs, D]; bag (b, h) is its run of blocks_b * bs entries."""
    value_offsets: torch.Tensor
    """[B * H] start of each (b, h) bag in value_rows."""
    query_repeats: torch.Tensor
    """[B * H] blocks of each (b, h): how often its query row weights a score bag."""
    padded_pos: torch.Tensor | None
    """[P] position of each triple among the B * H * num_blocks padded ones; None when
    every request uses all num_blocks blocks (nothing to scatter)."""
    bias: torch.Tensor
    """`mask` as an additive score bias (0 or -inf) [B, 1, L] in the model dtype."""


@dataclass
class RowAttention:
    """Every query row of a step as a one-token decode of its own: row t reads the slots
    [slot_lo[t], slot_hi[t]) of its padded row `block_table[t]`, the keys its position
    sees (itself included, once the step's K/V are in the cache). A prompt chunk's rows
    share their request's blocks and differ in slot_hi. The one-region decode stack
    (models/fused_decode.py) attends a mixed step this way with its decode kernel."""

    block_table: torch.Tensor  # [T, num_blocks]
    slot_lo: torch.Tensor  # [T] int64
    slot_hi: torch.Tensor  # [T] int64
    max_slots: int


@dataclass
class PromptRows:
    """The step's prompt chunks for the C prompt attention (pg_paged_prefill): chunk c's
    rows [row0[c], row1[c]) attend through block row table[c], its first row seeing
    first_hi[c] slots (its cached prefix and itself), each later row one more."""

    row0: torch.Tensor  # [C] int64
    row1: torch.Tensor  # [C] int64
    first_hi: torch.Tensor  # [C] int64
    table: torch.Tensor  # [C, max_blocks] int64
    window: int  # 0: none


@dataclass
class TorchAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_actual_tokens]
    slot_blocks: torch.Tensor  # slot_mapping // block_size
    slot_offsets: torch.Tensor  # slot_mapping % block_size
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]
    decode_only: bool = False
    """Every row is a decode, in request order: the decode output is the whole output."""
    rows: RowAttention | None = None
    """Every row as its own decode (`RowAttention`), made for steps with a prompt chunk
    and at most `ROW_ATTENTION_MAX_ROWS` rows."""
    prompt: PromptRows | None = None
    """The prompt chunks as the C prompt attention takes them (None without chunks)."""

    @property
    def decode_rows(self) -> slice | torch.Tensor | None:
        """Rows of the one-token decodes (ForwardContext.decode_rows)."""
        return None if self.decode is None else self.decode.rows


ROW_ATTENTION_MAX_ROWS = 256
"""Steps with prompt chunks up to this many rows get `RowAttention`; it is also the
largest step the one-region stack takes (models/fused_decode.py). Above it a step is a
prefill whose products are large enough for oneDNN's blocking."""


class TorchAttentionMetadataBuilder(AttentionMetadataBuilder):
    def __init__(
        self, block_size: int, device: torch.device, sliding_window: int | None = None
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.sliding_window = sliding_window
        """The query at position p sees keys p - W + 1 .. p (W = sliding_window, as in
        Mistral's config and transformers' masks); None = keys 0 .. p."""

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        qsl, seq_lens, verify = common.query_start_loc_cpu, common.seq_lens_cpu, common.verify_reqs
        # (request, token row, sequence length with it) of each row that attends as a decode
        decodes = [(i, qsl[i], seq_lens[i]) for i in range(common.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        prefill_reqs = [i for i in range(common.num_reqs) if qsl[i + 1] - qsl[i] > 1 and i not in verify]
        if verify:  # each verify row as a decode at its own position, in row order
            decodes += [(i, t, seq_lens[i] - (qsl[i + 1] - 1 - t)) for i in verify for t in range(qsl[i], qsl[i + 1])]
            decodes.sort(key=lambda d: d[1])
        decode = self._build_decode(common, decodes) if decodes else None
        slots = common.slot_mapping[: common.num_actual_tokens]
        return TorchAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=slots,
            slot_blocks=slots // self.block_size,
            slot_offsets=slots % self.block_size,
            decode=decode,
            prefills=[self._build_prefill(common, i) for i in prefill_reqs],
            # with no prompt chunks every row is a decode (or a verify row), in row order
            decode_only=decode is not None and not prefill_reqs,
            rows=(self._build_rows(common)
                  if prefill_reqs and common.num_actual_tokens <= ROW_ATTENTION_MAX_ROWS
                  else None),
            prompt=self._build_prompt(common, prefill_reqs) if prefill_reqs else None,
        )

    def _build_prompt(self, common: CommonAttentionMetadata, reqs: list[int]) -> PromptRows:
        qsl, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu
        idx = torch.tensor(reqs, dtype=torch.long)
        return PromptRows(
            row0=torch.tensor([qsl[i] for i in reqs], dtype=torch.long),
            row1=torch.tensor([qsl[i + 1] for i in reqs], dtype=torch.long),
            first_hi=torch.tensor([seq_lens[i] - (qsl[i + 1] - qsl[i]) + 1 for i in reqs], dtype=torch.long),
            table=common.block_table.index_select(0, idx.to(common.block_table.device)).contiguous(),
            window=self.sliding_window or 0,
        )

    def _build_rows(self, common: CommonAttentionMetadata) -> RowAttention:
        """Row t of request i sits at position p = seq_len_i - q_len_i + (t - start_i) and
        sees keys [p + 1 - W, p + 1) (from 0 without a window W): its padded row starts
        at the block holding the first of them, as `_build_decode` lays out a decode."""
        qsl = torch.as_tensor(common.query_start_loc_cpu[: common.num_reqs + 1], dtype=torch.long)
        q_lens = qsl[1:] - qsl[:-1]
        seq_lens = torch.as_tensor(common.seq_lens_cpu[: common.num_reqs], dtype=torch.long)
        req = torch.repeat_interleave(torch.arange(common.num_reqs), q_lens)
        t = torch.arange(common.num_actual_tokens)
        end = seq_lens[req] - (qsl[1:][req] - t) + 1  # keys up to position p: p + 1 of them
        bs, window = self.block_size, self.sliding_window
        start = (end - window).clamp_(min=0) if window else torch.zeros_like(end)
        first = start // bs
        num_blocks = int(((end + bs - 1) // bs - first).max())
        table = common.block_table.index_select(0, req.to(self.device))
        cols = (first[:, None] + torch.arange(num_blocks)).clamp_(max=table.shape[1] - 1)
        lo, hi = start - first * bs, end - first * bs
        return RowAttention(
            block_table=table.gather(1, cols.to(self.device)).contiguous(), slot_lo=lo,
            slot_hi=hi, max_slots=int((hi - lo).max()),
        )

    def _build_decode(self, common: CommonAttentionMetadata, decodes: list[tuple[int, int, int]]) -> DecodeBatch:
        """decodes: (request, token row, sequence length including the row) per row."""
        reqs = [d[0] for d in decodes]
        token_rows = [d[1] for d in decodes]
        rows: slice | torch.Tensor
        if token_rows == list(range(token_rows[0], token_rows[0] + len(reqs))):
            rows = slice(token_rows[0], token_rows[0] + len(reqs))
        else:
            rows = torch.tensor(token_rows, dtype=torch.long, device=self.device)
        bs, window = self.block_size, self.sliding_window
        seq_lens = [d[2] for d in decodes]
        # With a window, blocks wholly before it are skipped: request b's padded row
        # starts at its block first[b] (0 without a window).
        first = [max(0, n - window) // bs if window else 0 for n in seq_lens]
        req_blocks = [cdiv(n, bs) - f for n, f in zip(seq_lens, first)]  # blocks read
        num_blocks = max(req_blocks)
        req_idx = torch.tensor(reqs, dtype=torch.long, device=self.device)
        table = common.block_table.index_select(0, req_idx)
        start = torch.tensor(first, dtype=torch.long, device=self.device)[:, None]
        if any(first):
            cols = (start + torch.arange(num_blocks, device=self.device)).clamp_(max=table.shape[1] - 1)
            block_table = table.gather(1, cols)
        else:
            block_table = table[:, :num_blocks]
        # Slot s of padded row b holds position first[b] * bs + s: a real key iff that is
        # below seq_len (and, with a window W, at least seq_len - W).
        pos = start * bs + torch.arange(num_blocks * bs, device=self.device)
        lens = torch.tensor(seq_lens, dtype=torch.long, device=self.device)[:, None]
        mask = pos < lens
        if window is not None:
            mask &= pos >= lens - window
        hi = [n - f * bs for n, f in zip(seq_lens, first)]
        lo = [max(0, h - window) if window else 0 for h in hi]
        return DecodeBatch(
            rows=rows, block_table=block_table.contiguous(), mask=mask[:, None, :],
            req_blocks=req_blocks, slot_lo=torch.tensor(lo, dtype=torch.long),
            slot_hi=torch.tensor(hi, dtype=torch.long), max_slots=max(end - start for start, end in zip(lo, hi)),
        )

    def _build_prefill(self, common: CommonAttentionMetadata, i: int) -> PrefillChunk:
        start, end = common.query_start_loc_cpu[i], common.query_start_loc_cpu[i + 1]
        seq_len = common.seq_lens_cpu[i]
        ctx_len = seq_len - (end - start)
        window = self.sliding_window
        if window is not None and seq_len <= window:
            window = None  # it cuts into nothing
        block_ids = None
        if ctx_len > 0:
            num_blocks = cdiv(seq_len, self.block_size)
            block_ids = common.block_table[i, :num_blocks]
        return PrefillChunk(start, end, ctx_len, seq_len, block_ids, window, self.device)


class TorchAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        """Informational: the window is applied through the metadata the layer hands in."""
        self.logits_soft_cap = logits_soft_cap
        """Scores become cap * tanh(score / cap) before the mask and softmax (Gemma 2);
        None: plain scores. The C decode kernel caps them itself; SDPA takes no cap, so a
        capped layer's prompt chunks attend with `_prefill_math`."""
        self.group = num_heads // num_kv_heads  # query heads per KV head (GQA)
        self.kernels = platform_of("cpu").kernels()
        """pagellm's C kernels for CPU caches (decode and the cache write), or None: the
        torch ops below then do the same work."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D] -> [T, H, D]."""
        k_store, v_store = self.cache_storage(kv_cache)
        n = metadata.num_actual_tokens
        lib = self.kernels if _c_ready(k_store, key, value, metadata.slot_mapping) else None
        if lib is not None:
            kvh, nb, _, bs = k_store.shape
            lib.pg_write_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), n,
                            kvh, self.head_dim, KV_TYPE_CODES[k_store.dtype], k_store.data_ptr(),
                            v_store.data_ptr(), nb, bs, metadata.slot_mapping.data_ptr())
        elif k_store.dtype == Q8_KV_DTYPE:
            raise RuntimeError(
                "a q8_0 KV cache is read and written by pagellm's C kernels only: they need float32 "
                f"K/V rows on the CPU (got {key.dtype} on {key.device})"
            )
        else:
            _write_kv(key[:n], value[:n], k_store, v_store, metadata)
        c_layout = query.stride(2) == 1 and query.stride(1) == self.head_dim
        if k_store.dtype == Q8_KV_DTYPE and not c_layout:
            query, c_layout = query.contiguous(), True  # only the C attention reads this cache
        c_decode = lib is not None and c_layout
        dec = metadata.decode
        torch_decode = self._decode if k_store.dtype == query.dtype else self._decode_widened
        if metadata.decode_only and dec and n == query.shape[0]:
            if c_decode:
                return self._decode_c(lib, query, k_store, v_store, dec)
            return torch_decode(query, k_store, v_store, dec)  # no scatter needed
        out = query.new_zeros(query.shape) if n < query.shape[0] else torch.empty_like(query)
        if dec is not None:  # the decode rows of a mixed step: the same kernel as above
            out[dec.rows] = (self._decode_c(lib, query[dec.rows], k_store, v_store, dec)
                             if c_decode else torch_decode(query, k_store, v_store, dec))
        prompt = metadata.prompt
        if (c_decode and prompt is not None and out.is_contiguous() and k_store.shape[-1] == 16
                and lib.pg_paged_prefill_ready(self.head_dim)):
            self._prefill_c(lib, query, k_store, v_store, prompt, out)
            return out
        for chunk in metadata.prefills:
            out[chunk.token_start : chunk.token_end] = self._prefill(
                query, key, value, k_store, v_store, chunk
            )
        return out

    def cache_storage(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's physical K [KVH, nb, D, bs] and V [KVH, nb, bs, D] (`_storage`),
        worked out once (the runner keeps the tensors); what the one-region C stack
        points its layers at."""
        cached = self.__dict__.get("_store")
        if cached is None or cached[0] is not kv_cache[0]:
            cached = self._store = (kv_cache[0], *_storage(*kv_cache))
        return cached[1], cached[2]

    def _prefill_c(self, lib: Any, query: torch.Tensor, k_store: torch.Tensor,
                   v_store: torch.Tensor, prompt: PromptRows, out: torch.Tensor) -> None:
        """Every prompt chunk of the step in one C call (pg_paged_prefill), from the cache
        the chunks' K/V were just written to: several rows of a chunk share each K and V
        load, and each row gets the numbers the decode kernel would give it alone (the
        same chains of operations), where SDPA sums in another order."""
        kvh, nb, _, _ = k_store.shape
        rc = lib.pg_paged_prefill(
            query.data_ptr(), query.stride(0), prompt.row0.shape[0], prompt.row0.data_ptr(),
            prompt.row1.data_ptr(), prompt.first_hi.data_ptr(), self.num_heads, kvh, self.head_dim,
            KV_TYPE_CODES[k_store.dtype], k_store.data_ptr(), v_store.data_ptr(), nb,
            prompt.table.data_ptr(), prompt.table.stride(0), prompt.window, self.scale,
            self.logits_soft_cap or 0.0, out.data_ptr(),
        )
        if rc != 0:
            raise MemoryError("pg_paged_prefill could not allocate its scratch")

    def _decode_c(
        self, lib: Any, query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
        dec: DecodeBatch,
    ) -> torch.Tensor:
        """`_decode` as one C call (pg_paged_decode): per (request, head) the scores over
        its slots, softmax and the weighted V rows, without index tensors."""
        b, h, d = query.shape
        kvh, nb, _, bs = k_store.shape
        out = torch.empty(b, h, d, dtype=torch.float32)
        table = dec.block_table
        rc = lib.pg_paged_decode(
            query.data_ptr(), query.stride(0), b, h, kvh, d, KV_TYPE_CODES[k_store.dtype],
            k_store.data_ptr(),
            v_store.data_ptr(), nb, bs, table.data_ptr(), table.stride(0),
            dec.slot_lo.data_ptr(), dec.slot_hi.data_ptr(), dec.max_slots, self.scale,
            self.logits_soft_cap or 0.0, out.data_ptr(),
        )
        if rc == -2:
            raise ValueError(f"the C decode attention reads a q8_0 cache only in blocks of 16 with heads of "
                             f"32-256 dims in steps of 32 (got blocks of {bs}, {d} dims)")
        if rc != 0:
            raise MemoryError("paged decode attention: out of memory for the score buffer")
        return out

    def _decode(
        self, query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, dec: DecodeBatch
    ) -> torch.Tensor:
        """One query token per request against its whole context, read from the blocks
        in place with `embedding_bag` (a weighted sum of table rows per bag):

            scores[b, h, j*bs + s] = sum_d  (scale * q[b, h, d]) * K[kvh, block_j, d, s]
                 one bag per (b, h, j): D rows of bs keys, weighted by the query
            out[b, h, :]           = sum_l  p[b, h, l] * V[kvh, slot_l, :]
                 one bag per (b, h): a row per slot, weighted by the probabilities

        Nothing the size of the context is copied (gathering K/V first, then matmuls,
        moves every key three times through memory), and the query-head groups of GQA
        read the same rows while they are in cache. Scores live in a padded
        [B, H, num_blocks * bs] tensor only for the softmax.
        """
        q = query[dec.rows]
        b, h = q.shape[0], self.num_heads
        kvh, nb, d, bs = k_store.shape
        padded_len = dec.block_table.shape[1] * bs
        if dec.lookups is None:
            dec.lookups = self._lookups(dec, nb, d, bs, q.dtype)
        look = dec.lookups
        # query row (b, h) weights each of its blocks' score bags
        weights = (q * self.scale).reshape(b * h, d).repeat_interleave(
            look.query_repeats, dim=0, output_size=look.key_rows.shape[0]
        )
        packed = F.embedding_bag(
            look.key_rows, k_store.view(-1, bs), mode="sum", per_sample_weights=weights
        )  # [P, bs]
        if look.padded_pos is None:
            scores = packed.view(b, h, padded_len)
        else:
            scores = packed.new_full((b * h * padded_len // bs, bs), float("-inf"))
            scores.index_copy_(0, look.padded_pos, packed)
            scores = scores.view(b, h, padded_len)
        if self.logits_soft_cap is not None:
            scores = _soft_cap(scores, self.logits_soft_cap)
        probs = torch.softmax(scores.add_(look.bias), dim=-1)
        if look.padded_pos is not None:
            probs = probs.view(-1, bs).index_select(0, look.padded_pos)
        out = F.embedding_bag(
            look.value_rows,
            v_store.view(-1, d),
            look.value_offsets,
            mode="sum",
            per_sample_weights=probs.reshape(-1),
        )
        return out.view(b, h, d)

    def _decode_widened(
        self, query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, dec: DecodeBatch
    ) -> torch.Tensor:
        """`_decode` for a cache stored in another dtype than the queries (a float16 cache
        without the C kernels): the blocks each request reads, gathered and widened, then
        two batched products over its padded row of keys."""
        q = query[dec.rows] * self.scale  # [B, H, D]
        b, kvh, d = q.shape[0], self.num_kv_heads, self.head_dim
        table = dec.block_table
        n = table.shape[1] * k_store.shape[3]
        k = k_store[:, table].to(q.dtype).permute(1, 0, 2, 4, 3).reshape(b, kvh, n, d)
        v = v_store[:, table].to(q.dtype).permute(1, 0, 2, 3, 4).reshape(b, kvh, n, d)
        if self.group > 1:  # [B, KVH, L, D] -> [B, H, L, D]
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        scores = torch.einsum("bhd,bhld->bhl", q, k)
        if self.logits_soft_cap is not None:
            scores = _soft_cap(scores, self.logits_soft_cap)
        probs = torch.softmax(scores.masked_fill_(~dec.mask, float("-inf")), dim=-1)
        return torch.einsum("bhl,bhld->bhd", probs, v)

    def _lookups(
        self, dec: DecodeBatch, nb: int, d: int, bs: int, dtype: torch.dtype
    ) -> _DecodeLookups:
        device = dec.block_table.device
        b, num_blocks = dec.block_table.shape
        h = self.num_heads
        kv_head = torch.arange(h, device=device) // self.group  # [H]
        # (kv head, block) pair of every padded (b, h, j): its index among KVH * nb blocks
        head_block = kv_head[None, :, None] * nb + dec.block_table[:, None, :]  # [B, H, n]
        req_blocks = torch.tensor(dec.req_blocks, device=device)
        padded_pos = None
        if min(dec.req_blocks) < num_blocks:
            used = torch.arange(num_blocks, device=device)[None, :] < req_blocks[:, None]
            used = used[:, None, :].expand(b, h, num_blocks).reshape(-1)
            padded_pos = used.nonzero().squeeze(1)
            head_block = head_block.reshape(-1)[padded_pos]
        head_block = head_block.reshape(-1, 1)  # [P, 1]
        index_dtype = torch.int32 if self.num_kv_heads * nb * max(d, bs) < 2**31 else torch.int64
        key_rows = head_block * d + torch.arange(d, device=device)
        value_rows = head_block * bs + torch.arange(bs, device=device)
        query_repeats = req_blocks.repeat_interleave(h)  # [B * H]
        bag_sizes = query_repeats * bs
        value_offsets = torch.cumsum(bag_sizes, 0) - bag_sizes
        zeros = torch.zeros(dec.mask.shape, dtype=dtype, device=device)
        return _DecodeLookups(
            key_rows=key_rows.to(index_dtype),
            value_rows=value_rows.reshape(-1).to(index_dtype),
            value_offsets=value_offsets.to(index_dtype),
            query_repeats=query_repeats,
            padded_pos=padded_pos,
            bias=zeros.masked_fill_(~dec.mask, float("-inf")),
        )

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_store: torch.Tensor,
        v_store: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        s, e = chunk.token_start, chunk.token_end
        q = query[s:e].transpose(0, 1)  # [H, q_len, D]
        if chunk.block_ids is None:  # nothing cached: the chunk's own K/V are all its keys
            k, v = key[s:e].transpose(0, 1), value[s:e].transpose(0, 1)  # [KVH, L, D]
        else:  # cached prefix + this chunk, read back from the blocks
            kvh, _, d, bs = k_store.shape
            n = chunk.block_ids.shape[0]
            k = k_store.index_select(1, chunk.block_ids).transpose(-1, -2).to(q.dtype)  # [KVH, n, bs, D]
            v = v_store.index_select(1, chunk.block_ids).to(q.dtype)
            k = k.reshape(kvh, n * bs, d)[:, : chunk.seq_len]
            v = v.reshape(kvh, n * bs, d)[:, : chunk.seq_len]
        if self.logits_soft_cap is not None:
            return _prefill_math(q, k, v, chunk, self.scale, self.logits_soft_cap, self.group)
        gqa = {}
        if self.group > 1 and _SDPA_GQA:  # query head h reads KV head h // group in place
            gqa = {"enable_gqa": True}
        elif self.group > 1:  # [KVH, L, D] -> [H, L, D]: each KV head copied `group` times
            k = k.repeat_interleave(self.group, dim=0)
            v = v.repeat_interleave(self.group, dim=0)
        # With a batch dim the CPU flash kernel runs; 3-D inputs fall back to the math
        # path, 2x slower at 128 tokens and 4x at 512.
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=chunk.mask, is_causal=chunk.mask is None,
            scale=self.scale, **gqa,
        )
        return o[0].transpose(0, 1)  # [q_len, H, D]


def _soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap), Hugging Face's order of operations (in place)."""
    return scores.div_(cap).tanh_().mul_(cap)


def _prefill_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk,
                  scale: float, cap: float, group: int) -> torch.Tensor:
    """A prompt chunk's attention with capped scores, as Hugging Face's eager attention
    computes it: q [H, q_len, D], k/v [KVH, L, D] -> [q_len, H, D]."""
    if group > 1:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = _soft_cap(torch.matmul(q, k.transpose(1, 2)) * scale, cap)  # [H, q_len, L]
    q_len, n_keys = q.shape[1], k.shape[1]
    mask = chunk.mask
    if mask is None:
        mask = torch.ones(q_len, n_keys, dtype=torch.bool).tril_(n_keys - q_len)
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
"""scaled_dot_product_attention takes `enable_gqa` (torch 2.5+)."""


KV_TYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
"""Cache dtypes the C kernels read and write, as their `kv_type` (paged_attention.c's
PG_KV_*). int8 storage is a q8_0 cache (`Q8_KV_DTYPE`)."""

def _row_width(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one head's row of a slot in the cache: head_dim, or for a q8_0 cache its
    bytes (the int8 values and their float16 scales), in the geometry the kernels read."""
    if dtype != Q8_KV_DTYPE:
        return head_dim
    if block_size != 16 or head_dim % 32 or head_dim > 256:
        raise ValueError(f"a q8_0 KV cache takes blocks of 16 and heads of 32-256 dims in steps of 32 "
                         f"(got blocks of {block_size}, {head_dim} dims)")
    return head_dim + head_dim // 16


def _c_ready(k_store: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slots: torch.Tensor) -> bool:
    """The C kernels take float32, float16 or bfloat16 CPU caches, float32 K/V rows whose
    heads are contiguous, and int64 slots."""
    return (
        k_store.dtype in KV_TYPE_CODES
        and k_store.device.type == "cpu"
        and slots.dtype == torch.int64 and slots.is_contiguous()
        and key.dtype == value.dtype == torch.float32
        and key.stride(2) == 1 and value.stride(2) == 1
        and key.stride(1) == key.shape[2] and value.stride(1) == value.shape[2]
    )


def _storage(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The physical K [KVH, nb, D, bs] and V [KVH, nb, bs, D] behind the logical
    [nb, bs, KVH, D] views that `allocate_kv_cache` returns."""
    k_store, v_store = k_cache.permute(2, 0, 3, 1), v_cache.permute(2, 0, 1, 3)
    if not (k_store.is_contiguous() and v_store.is_contiguous()):
        raise ValueError(
            "the torch attention backend needs the KV cache layout of "
            "TorchAttentionBackend.allocate_kv_cache"
        )
    return k_store, v_store


def _write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    metadata: TorchAttentionMetadata,
) -> None:
    """Stores the step's key/value [T, KVH, D] at their slots
    (slot = block_id * block_size + offset)."""
    kvh, nb, d, bs = k_store.shape
    # the indexed dims come first in the target: [T, KVH, D]
    k_store[:, metadata.slot_blocks, :, metadata.slot_offsets] = key.to(k_store.dtype)
    v_rows = value.transpose(0, 1).to(v_store.dtype).contiguous()  # [KVH, T, D]
    v_store.view(kvh, nb * bs, d).index_copy_(1, metadata.slot_mapping, v_rows)


class TorchAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "torch"

    @staticmethod
    def get_builder_cls() -> type[TorchAttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[TorchAttentionImpl]:
        return TorchAttentionImpl

    @staticmethod
    def allocate_kv_cache(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's (K, V) cache, uninitialised, as logical [num_blocks, block_size,
        KVH, D] views over the storage described in the module docstring (a q8_0 cache's
        rows are `_row_width` bytes wide: D + D / 16)."""
        width = _row_width(block_size, head_dim, dtype)
        k = torch.empty((num_kv_heads, num_blocks, width, block_size), dtype=dtype, device=device)
        v = torch.empty((num_kv_heads, num_blocks, block_size, width), dtype=dtype, device=device)
        return k.permute(1, 3, 0, 2), v.permute(1, 2, 0, 3)

    @staticmethod
    def kv_cache_block_bytes(block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
        return 2 * block_size * num_kv_heads * _row_width(block_size, head_dim, dtype) * dtype.itemsize
