"""BlockPool, its free queue and block hashing: ref counts, eviction order, invariants."""

from __future__ import annotations

import hashlib
from array import array

import pytest

from pagellm.core.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagellm.core.kv_cache.hashing import NONE_HASH, get_request_block_hasher, hash_block_tokens
from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def fake_hash(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def cache(pool: BlockPool, blocks: list[KVCacheBlock], hashes: list[bytes]) -> None:
    pool.cache_full_blocks(blocks, hashes, 0, len(hashes))
    pool.check_invariants()


# -- free queue ---------------------------------------------------------------------------


def test_free_queue_popleft_append_remove_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.appendleft(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q] == [2, 1, 3, 4, 0]
    with pytest.raises(AssertionError):
        q.remove(KVCacheBlock(9))  # never queued
    for _ in range(5):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


# -- allocation and ref counts ------------------------------------------------------------


def test_allocate_and_free_tracks_ref_counts() -> None:
    pool = BlockPool(num_blocks=10, enable_caching=True)
    assert pool.get_num_free_blocks() == 9  # block 0 is the null block
    blocks = pool.get_new_blocks(3)
    pool.check_invariants()
    assert ids(blocks) == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 6
    assert pool.get_usage() == pytest.approx(3 / 9)

    pool.touch(blocks[:2])  # a second request shares two of them
    pool.check_invariants()
    assert [b.ref_cnt for b in blocks] == [2, 2, 1]
    pool.free_blocks(blocks)
    pool.check_invariants()
    assert [b.ref_cnt for b in blocks] == [1, 1, 0]
    assert pool.get_num_free_blocks() == 7
    pool.free_blocks(blocks[:2])
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 9 and pool.get_usage() == 0.0


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert 0 not in ids(blocks)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(AssertionError):
        pool.free_blocks([pool.null_block])
    pool.check_invariants()


def test_double_free_raises() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])


def test_touch_of_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [fake_hash(1), fake_hash(2)])
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 4
    hit = pool.get_cached_block(fake_hash(1))
    assert hit is blocks[0]
    pool.touch([hit])
    pool.check_invariants()
    assert hit.ref_cnt == 1 and pool.get_num_free_blocks() == 3
    # The remaining free blocks never include the touched one.
    assert hit not in pool.get_new_blocks(3)
    pool.check_invariants()


# -- eviction order -----------------------------------------------------------------------


def test_unhashed_freed_blocks_are_reused_before_hashed_ones() -> None:
    pool = BlockPool(num_blocks=10, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # ids 1..4; free queue now [5..9]
    cache(pool, blocks[:2], [fake_hash(1), fake_hash(2)])  # 1, 2 full; 3, 4 partial
    pool.free_blocks(reversed(blocks))
    pool.check_invariants()
    # Unhashed 3, 4 go to the head; hashed 2 then 1 to the tail (tail of chain first).
    assert ids(list(pool.free_block_queue)) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert ids(pool.get_new_blocks(7)) == [3, 4, 5, 6, 7, 8, 9]
    assert pool.get_cached_block(fake_hash(1)) is blocks[0]
    assert pool.get_cached_block(fake_hash(2)) is blocks[1]
    # Now the cached ones are reused, and their hashes evicted, block 2 first.
    (reused,) = pool.get_new_blocks(1)
    pool.check_invariants()
    assert reused.block_id == 2 and reused.block_hash is None
    assert pool.get_cached_block(fake_hash(2)) is None
    assert pool.get_cached_block(fake_hash(1)) is blocks[0]


def test_lru_eviction_of_freed_hashed_blocks() -> None:
    pool = BlockPool(num_blocks=7, enable_caching=True)  # 6 usable
    first = pool.get_new_blocks(2)
    second = pool.get_new_blocks(2)
    cache(pool, first, [fake_hash(10), fake_hash(11)])
    cache(pool, second, [fake_hash(20), fake_hash(21)])
    pool.free_blocks(reversed(second))  # freed earlier -> evicted earlier
    pool.free_blocks(reversed(first))
    pool.check_invariants()
    assert ids(pool.get_new_blocks(2)) == [5, 6]  # never-used blocks first
    evicted = pool.get_new_blocks(3)
    pool.check_invariants()
    assert ids(evicted) == [4, 3, 2]  # second's tail, second's head, first's tail
    assert pool.get_cached_block(fake_hash(10)) is first[0]
    for h in (fake_hash(11), fake_hash(20), fake_hash(21)):
        assert pool.get_cached_block(h) is None


def test_duplicate_content_stays_unhashed() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    cache(pool, [a], [fake_hash(1)])
    cache(pool, [b], [fake_hash(1)])
    assert pool.get_cached_block(fake_hash(1)) is a
    assert b.block_hash is None


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [fake_hash(1), fake_hash(2)])
    assert pool.get_cached_block(fake_hash(1)) is None
    assert all(b.block_hash is None for b in blocks)


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [fake_hash(1), fake_hash(2)])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(fake_hash(1)) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    pool.check_invariants()
    assert pool.get_cached_block(fake_hash(1)) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_num_free_blocks() == 4


# -- invariant checker --------------------------------------------------------------------


def _pool_with_cached_blocks() -> tuple[BlockPool, list[KVCacheBlock]]:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks[:2], [fake_hash(1), fake_hash(2)])
    return pool, blocks


def test_invariants_catch_negative_ref_count() -> None:
    pool, blocks = _pool_with_cached_blocks()
    blocks[2].ref_cnt = -1
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_invariants_catch_in_use_block_in_free_queue() -> None:
    pool, blocks = _pool_with_cached_blocks()
    pool.free_block_queue.append(blocks[2])  # ref 1 but free
    with pytest.raises(AssertionError, match="free"):
        pool.check_invariants()


def test_invariants_catch_leaked_block() -> None:
    pool, blocks = _pool_with_cached_blocks()
    blocks[2].ref_cnt = 0  # ref 0 but not in the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_invariants_catch_inconsistent_hash_map() -> None:
    pool, blocks = _pool_with_cached_blocks()
    pool.cached_block_hash_to_block[fake_hash(1)] = blocks[2]
    with pytest.raises(AssertionError, match="cache entry"):
        pool.check_invariants()
    pool, blocks = _pool_with_cached_blocks()
    blocks[2].block_hash = fake_hash(3)  # hashed but not registered
    with pytest.raises(AssertionError, match="not its cache entry"):
        pool.check_invariants()


def test_invariants_catch_null_block_handed_out() -> None:
    pool, _ = _pool_with_cached_blocks()
    pool.null_block.ref_cnt = 2
    with pytest.raises(AssertionError, match="null block"):
        pool.check_invariants()


# -- hashing ------------------------------------------------------------------------------


def test_hashes_are_chained_and_deterministic() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert isinstance(h1, bytes) and len(h1) == 32
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_block_hash_is_sha256_of_parent_count_and_tokens_only() -> None:
    # The whole encoding, spelled out: a change to it (or an input added to it) shows here.
    tokens = [1, 2, 70000]
    expected = hashlib.sha256(NONE_HASH)
    expected.update((3).to_bytes(4, "little"))
    expected.update(array("q", tokens).tobytes())
    assert hash_block_tokens(None, tokens) == expected.digest()


def test_request_block_hasher_hashes_only_new_full_blocks() -> None:
    hasher = get_request_block_hasher(4)
    req = Request("r", list(range(10)), SamplingParams(max_tokens=8), block_hasher=hasher)
    assert len(req.block_hashes) == 2  # tokens 0..7; 8, 9 are a partial block
    assert req.block_hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], [4, 5, 6, 7])
    req.append_output_token_ids(10)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([11, 12, 13, 14, 15])  # fills block 2 and block 3
    assert len(req.block_hashes) == 4
    assert req.block_hashes[3] == hash_block_tokens(req.block_hashes[2], [12, 13, 14, 15])
    # Same tokens through another path give the same chain.
    other = Request("o", list(range(16)), SamplingParams(), block_hasher=hasher)
    assert other.block_hashes == req.block_hashes
