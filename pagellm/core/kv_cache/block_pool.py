"""BlockPool: every KV block's bookkeeping (ref count, content hash, free-list position).

In: allocate / free / touch / cache calls from the KVCacheManager. Out: KVCacheBlock
objects whose ids index the runner's KV tensors. Knows nothing of requests or tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagellm.core.kv_cache.hashing import BlockHash

# Block 0 is the null block: reserved at startup, never handed out, freed or counted as
# free. The model runner pads block tables (and may point padding slots) at block 0, so
# no real request's KV ever lives there.
NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One KV block. ``ref_cnt`` = number of requests whose block table holds it."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and registered in the prefix cache; cleared on
        # eviction. A block with a hash is findable by get_cached_block().
        self.block_hash: BlockHash | None = None
        # Intrusive links of FreeKVCacheBlockQueue; both None while not in the queue.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks themselves.

    O(1) popleft / append / appendleft / remove-from-middle, no allocation. Fake head and
    tail sentinels mean no operation special-cases an empty list. Head = next to reuse.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def _link_between(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already queued"
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Adds at the tail: reused last."""
        assert self._tail.prev_free is not None
        self._link_between(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Adds at the head: reused first."""
        assert self._head.next_free is not None
        self._link_between(block, self._head, self._head.next_free)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise AssertionError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    """Owns all blocks; hands out free ones, evicting prefix-cache entries LRU.

    Free-queue order (head is reused first):
        [unhashed freed blocks (LIFO)] ... [hashed freed blocks, least recently freed first]
    A hashed block at ref 0 is both free and a cache hit candidate; reusing it evicts it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1  # pinned: never reaches the free queue
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[NULL_BLOCK_ID + 1 :])
        # Exactly one block per hash; a second block with the same content (two requests
        # filling the same prefix at once) simply stays unhashed.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    # -- lookup and allocation ---------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops ``num_blocks`` from the head of the free queue with ref_cnt 1 each."""
        if num_blocks > len(self.free_block_queue):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self.free_block_queue)} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        """Drops a block's prefix-cache entry (its content is about to be overwritten)."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits; a hit at ref 0 leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference per block. Callers pass a request's blocks tail first, so
        hashed blocks at the end of a prefix chain are evicted before its head (a missing
        head invalidates everything after it anyway)."""
        for block in ordered_blocks:
            assert not block.is_null, "the null block is never freed"
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self.free_block_queue.appendleft(block)  # no cache value: reuse first
            else:
                self.free_block_queue.append(block)  # keep for hits; LRU eviction

    # -- prefix cache ------------------------------------------------------------------

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Registers ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        ``blocks`` is one request's block table and ``block_hashes`` its chained hashes;
        entries before ``num_cached_blocks`` were registered (or hit) earlier.
        """
        if not self.enable_caching:
            return
        assert num_full_blocks <= len(blocks) and num_full_blocks <= len(block_hashes)
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"{block} re-cached with another hash"
                continue
            if block_hash in self.cached_block_hash_to_block:
                continue  # same content already cached in another block
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash. Only allowed while no block is in use."""
        if len(self.free_block_queue) != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    # -- accounting --------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free blocks, including hashed ones that are evicted on reuse."""
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 .. 1.0)."""
        return 1.0 - len(self.free_block_queue) / self.num_usable_blocks

    def check_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant."""
        free = list(self.free_block_queue)
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == self.free_block_queue.num_free_blocks, (
            f"free queue has duplicates or a stale count: {len(free)} linked, "
            f"{len(free_ids)} distinct, count {self.free_block_queue.num_free_blocks}"
        )
        assert NULL_BLOCK_ID not in free_ids, "null block is in the free queue"
        assert self.null_block.ref_cnt == 1 and self.null_block.block_hash is None, (
            f"null block was handed out or cached: {self.null_block}"
        )
        in_use = [b for b in self.blocks[NULL_BLOCK_ID + 1 :] if b.ref_cnt > 0]
        assert len(free) + len(in_use) == self.num_usable_blocks, (
            f"free ({len(free)}) + in use ({len(in_use)}) != usable ({self.num_usable_blocks})"
        )
        for block in self.blocks[NULL_BLOCK_ID + 1 :]:
            assert block.ref_cnt >= 0, f"negative ref count: {block}"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"{block}: ref 0 must mean in the free queue and vice versa"
            )
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"{block} has a hash but is not its cache entry"
                )
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"cache entry points at {block}"
        assert self.enable_caching or not self.cached_block_hash_to_block, (
            "blocks were cached while prefix caching is off"
        )
