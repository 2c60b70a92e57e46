"""KVCacheManager: each request's block table on top of the BlockPool, plus prefix caching.

In: requests and token counts from the scheduler. Out: block ids (for the runner's block
tables), prefix-cache hits and usage. Knows no scheduling policy and no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagellm.core.request import Request
from pagellm.utils import cdiv


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, in tokens."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        max_model_len: int,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # request id -> block table. Block i holds tokens [i*block_size, (i+1)*block_size).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many leading blocks of its table are registered (or were hits)
        # in the prefix cache; the next cache_blocks() call starts there.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    # -- prefix-cache lookup -----------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        Returns (blocks, num_computed_tokens). The blocks are not yet referenced: pass
        them to allocate_slots() in the same scheduling step. The hit never covers the
        last token, which must run through the model to produce logits:

            tokens      |  b0  |  b1  |  b2  |  b3 (full) |
            max hit     |<------ num_tokens - 1 ------->|   -> 3 blocks at most
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # chained hashes: nothing after a miss can hit
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Counts a lookup in the hit-rate statistics. The scheduler calls it once per
        request, when it is first admitted: not for each step it waits for blocks, nor
        for its recomputation after a preemption (both would inflate the counts)."""
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens

    # -- allocation --------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Grows the request's block table to hold the tokens computed by this step.

        Token layout after the call (request.num_computed_tokens not yet advanced):

            | computed | new computed (hits) | new tokens (run this step) |
            |<- num_computed_tokens ->|<- num_new_computed_tokens ->|<- num_new_tokens ->|

        Returns the ids of the freshly allocated blocks (prefix hits excluded; use
        get_block_ids() for the whole table), or None, changing nothing, when the pool
        cannot supply them.
        """
        new_computed_blocks = new_computed_blocks or []
        assert len(new_computed_blocks) * self.block_size == num_new_computed_tokens
        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if num_total_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id} would hold {num_total_tokens} tokens, "
                f"above max_model_len={self.max_model_len}"
            )
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_new_blocks = max(
            0, cdiv(num_total_tokens, self.block_size) - len(req_blocks) - len(new_computed_blocks)
        )
        # Hits sitting at ref 0 are in the free queue; touching them removes them from
        # it, so they cannot also be counted as room for fresh blocks.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        self.req_to_blocks[request.request_id] = req_blocks
        if new_computed_blocks:
            # Hits are already in the cache; registration resumes after them.
            num_computed_blocks = (request.num_computed_tokens + num_new_computed_tokens) // (
                self.block_size
            )
            prev = self.num_cached_blocks.get(request.request_id, 0)
            self.num_cached_blocks[request.request_id] = max(prev, num_computed_blocks)
        # Register blocks that are full once this step has run (its KV is written
        # before any later step can read a hit on it). Never past the known tokens.
        self.cache_blocks(request, min(num_total_tokens, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's blocks that are full within its first
        ``num_computed_tokens`` tokens and have a hash."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id, [])
        num_full_blocks = min(
            num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks)
        )
        num_cached = self.num_cached_blocks.get(req_id, 0)
        if num_full_blocks <= num_cached:
            return
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full_blocks)
        self.num_cached_blocks[req_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Releases the request's whole block table (tail first, see BlockPool)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    # -- queries -----------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Returns the lookups since the previous call and starts a new count."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def check_invariants(self) -> None:
        """Pool invariants, plus: every block's ref count equals the number of block
        tables holding it, and no table holds the null block or a block twice."""
        self.block_pool.check_invariants()
        holders: dict[int, int] = {}
        for req_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(set(ids)) == len(ids), f"{req_id} holds a block twice: {ids}"
            assert all(not b.is_null for b in blocks), f"{req_id} holds the null block"
            assert self.num_cached_blocks.get(req_id, 0) <= len(blocks), (
                f"{req_id}: {self.num_cached_blocks.get(req_id)} cached > {len(blocks)} blocks"
            )
            for block_id in ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.block_pool.blocks:
            if block.is_null:
                continue
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"{block}: held by {holders.get(block.block_id, 0)} requests"
            )
        stale = set(self.num_cached_blocks) - set(self.req_to_blocks)
        assert not stale, f"cache counters for requests without blocks: {stale}"
