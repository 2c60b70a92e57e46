"""KVCacheManager: prefix hits, exact block counts, allocation failure, freeing."""

from __future__ import annotations

import pytest

from pagellm.core.kv_cache.hashing import get_request_block_hasher
from pagellm.core.kv_cache.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams

BLOCK = 16


def make_manager(num_blocks: int = 33, caching: bool = True, max_len: int = 1024) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK, enable_caching=caching, max_model_len=max_len)


def make_request(req_id: str, tokens: list[int], **params: object) -> Request:
    return Request(
        req_id,
        tokens,
        SamplingParams(**params),  # type: ignore[arg-type]
        block_hasher=get_request_block_hasher(BLOCK),
    )


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: look up hits, allocate, advance."""
    hits, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    new_ids = kv.allocate_slots(req, num_new, num_hit, hits)
    kv.check_invariants()
    if new_ids is not None:
        kv.record_prefix_lookup(req, num_hit)
        req.num_computed_tokens = num_hit + num_new
    return new_ids


PREFIX = list(range(1000, 1064))  # 64 tokens = 4 full blocks


def test_shared_64_token_prompt_hits_48_tokens() -> None:
    kv = make_manager()
    a = make_request("a", PREFIX)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert admit(kv, a) is not None
    assert len(kv.get_block_ids("a")) == 4

    b = make_request("b", PREFIX)
    hits, num_hit = kv.get_computed_blocks(b)
    # The last token is recomputed, so the 4th block (which holds it) is not a hit.
    assert num_hit == 48 and [x.block_id for x in hits] == kv.get_block_ids("a")[:3]
    new_ids = kv.allocate_slots(b, 64 - 48, num_hit, hits)
    kv.check_invariants()
    assert new_ids is not None and len(new_ids) == 1
    assert kv.get_block_ids("b")[:3] == kv.get_block_ids("a")[:3]
    assert [blk.ref_cnt for blk in hits] == [2, 2, 2]


def test_longer_prompt_sharing_the_prefix_hits_all_64() -> None:
    kv = make_manager()
    admit(kv, make_request("a", PREFIX))
    b = make_request("b", PREFIX + list(range(5000, 5010)))
    _, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 64


def test_hits_stop_at_first_differing_block() -> None:
    kv = make_manager()
    admit(kv, make_request("a", PREFIX))
    tokens = list(PREFIX)
    tokens[20] = 7  # inside block 1
    _, num_hit = kv.get_computed_blocks(make_request("b", tokens))
    assert num_hit == 16


def test_hits_survive_free_and_count_as_evictable() -> None:
    kv = make_manager(num_blocks=6)  # 5 usable
    a = make_request("a", PREFIX)
    admit(kv, a)
    kv.free(a)
    kv.check_invariants()
    assert kv.get_num_free_blocks() == 5

    # 96 tokens: 4 cached blocks hit (at ref 0, still in the free queue) + 2 new.
    # Only 1 block is free once the hits are taken, so this must fail cleanly.
    c = make_request("c", PREFIX + list(range(32)))
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 64
    assert kv.allocate_slots(c, 32, num_hit, hits) is None
    kv.check_invariants()
    assert kv.get_num_free_blocks() == 5 and kv.get_block_ids("c") == []
    assert all(blk.ref_cnt == 0 and blk.block_hash is not None for blk in hits)

    # 80 tokens fit: 4 hits + 1 new block.
    d = make_request("d", PREFIX + list(range(16)))
    assert admit(kv, d) is not None
    assert len(kv.get_block_ids("d")) == 5 and kv.get_num_free_blocks() == 0


def test_allocation_failure_returns_none_without_leaking() -> None:
    kv = make_manager(num_blocks=5)  # 4 usable
    a = make_request("a", list(range(40)))  # 3 blocks
    assert admit(kv, a) is not None
    b = make_request("b", list(range(100, 140)))  # 3 blocks, only 1 free
    assert admit(kv, b) is None
    assert kv.get_num_free_blocks() == 1
    assert "b" not in kv.req_to_blocks
    kv.free(b)  # freeing a request without blocks is harmless
    kv.check_invariants()


def test_exact_block_counts_as_tokens_grow() -> None:
    kv = make_manager(caching=False)
    req = make_request("r", list(range(17)))
    new_ids = admit(kv, req)
    assert new_ids is not None and len(new_ids) == 2  # 17 tokens -> 2 blocks
    for step in range(15):  # tokens 17..31 still fit in 2 blocks
        req.append_output_token_ids(step)
        assert kv.allocate_slots(req, 1) == []
        req.num_computed_tokens += 1
    req.append_output_token_ids(99)
    new_ids = kv.allocate_slots(req, 1)  # token 32 starts block 3
    assert new_ids is not None and len(new_ids) == 1
    assert len(kv.get_block_ids("r")) == 3
    kv.check_invariants()


def test_free_returns_every_block() -> None:
    kv = make_manager(num_blocks=17)
    reqs = [make_request(f"r{i}", PREFIX[: 20 + 10 * i]) for i in range(4)]
    for r in reqs:
        assert admit(kv, r) is not None
    assert kv.usage > 0
    for r in reqs:
        kv.free(r)
        kv.check_invariants()
    assert kv.get_num_free_blocks() == 16 and kv.usage == 0.0
    assert kv.req_to_blocks == {} and kv.num_cached_blocks == {}


def test_generated_tokens_are_cached_once_their_block_fills() -> None:
    kv = make_manager()
    req = make_request("r", list(range(10)))
    admit(kv, req)
    for tok in range(10, 17):  # sample tokens 10..16; KV for 10..15 gets computed
        req.append_output_token_ids(tok)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        kv.check_invariants()
    # Block 0 holds tokens 0..15, all computed now: a new prompt 0..16 hits it.
    _, num_hit = kv.get_computed_blocks(make_request("q", list(range(17))))
    assert num_hit == 16


def test_prompt_logprobs_and_disabled_caching_skip_the_lookup() -> None:
    kv = make_manager()
    admit(kv, make_request("a", PREFIX))
    assert kv.get_computed_blocks(make_request("b", PREFIX, prompt_logprobs=1)) == ([], 0)
    off = make_manager(caching=False)
    admit(off, make_request("a", PREFIX))
    assert off.get_computed_blocks(make_request("b", PREFIX)) == ([], 0)
    assert off.block_pool.cached_block_hash_to_block == {}


def test_prefix_cache_stats_count_tokens() -> None:
    kv = make_manager()
    admit(kv, make_request("a", PREFIX))
    admit(kv, make_request("b", PREFIX))
    stats = kv.make_prefix_cache_stats()
    assert (stats.queries, stats.hits) == (128, 48)
    stats = kv.make_prefix_cache_stats()
    assert (stats.queries, stats.hits) == (0, 0)


def test_reset_prefix_cache() -> None:
    kv = make_manager()
    a = make_request("a", PREFIX)
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", PREFIX)) == ([], 0)
    kv.check_invariants()


def test_allocation_past_max_model_len_is_refused() -> None:
    kv = make_manager(max_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        kv.allocate_slots(make_request("r", list(range(40))), 40)
    kv.check_invariants()


def test_invariants_catch_ref_count_mismatch() -> None:
    kv = make_manager()
    admit(kv, make_request("a", PREFIX))
    kv.req_to_blocks["a"][0].ref_cnt += 1
    with pytest.raises(AssertionError, match="held by 1"):
        kv.check_invariants()


def test_cdiv_is_ceiling_division_for_ints_and_tensors() -> None:
    import torch

    from pagellm.utils import cdiv

    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert cdiv(torch.tensor([0, 3, 4, 5]), 4).tolist() == [0, 1, 1, 2]
