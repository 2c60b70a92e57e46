"""The torch paged-attention backend in one mixed step: a prompt split into 3 chunks, a
prompt that starts after a cached prefix (shared blocks), and decodes of different
lengths, interleaved, must give the logits each sequence gets when run alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagellm.attention import get_attn_backend, torch_backend
from pagellm.model_executor.loader import get_model
from tests.utils import PagedRunner, make_model_config


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 1009 + i * 7919) % 49000 + 100 for i in range(n)]


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 20})],
    ids=["llama", "qwen3", "mistral-window20"],
)
def test_mixed_batch_matches_sequences_run_alone(
    tiny_model: Callable[..., str], family: str, overrides: dict
) -> None:
    mc = make_model_config(tiny_model(family, **overrides))
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))

    def alone(tokens: list[int]) -> torch.Tensor:
        runner = PagedRunner(model, mc, seed=1)
        runner.add("x", tokens)
        return runner.step([("x", len(tokens))])[0]

    prefix = _tokens(1, 40)
    seqs = {
        "P": prefix,  # owner of the prefix that B reuses
        "A": _tokens(2, 45),  # prefilled in chunks of 16, 16, 13
        "B": prefix[:32] + _tokens(3, 18),  # first 2 blocks cached, 18 new tokens
        "C": _tokens(4, 5),  # short prompt, then decodes
        "D": _tokens(5, 20),  # longer prompt, then decodes
    }
    runner = PagedRunner(model, mc)
    for name in ("P", "A", "C", "D"):
        runner.add(name, seqs[name])
    steps: list[list[tuple[str, int]]] = [
        [("P", 40), ("C", 5), ("D", 20), ("A", 16)],
        [("A", 16), ("C", 1), ("B", 18), ("D", 1)],  # decodes not contiguous in the batch
        [("C", 1), ("D", 1), ("A", 13), ("B", 1)],  # decodes contiguous, B now decoding
    ]
    for i, step in enumerate(steps):
        if i == 1:
            runner.add_with_prefix("B", seqs["B"], src_id="P", num_blocks=2)
        for name, n in step:
            if n == 1 and runner.seqs[name].num_computed == len(seqs[name]):
                token = _tokens(10 + i, 1)[0] + len(name)
                seqs[name] = seqs[name] + [token]
                runner.append(name, token)
        logits = runner.step(step)
        for row, (name, _) in enumerate(step):
            upto = runner.seqs[name].num_computed
            torch.testing.assert_close(
                logits[row], alone(seqs[name][:upto]), atol=1e-4, rtol=0, msg=f"step {i} {name}"
            )


def test_prefix_blocks_are_shared_not_rewritten(tiny_model: Callable[..., str]) -> None:
    """A chunk after a cached prefix writes only its own slots (block ids of the prefix
    are shared with the owner, whose cache contents must stay unchanged)."""
    mc = make_model_config(tiny_model("llama"))
    runner = PagedRunner(get_model(mc, torch.device("cpu"), get_attn_backend("torch")), mc)
    prefix = _tokens(7, 32)
    runner.add("P", prefix)
    runner.step([("P", 32)])
    shared = runner.seqs["P"].blocks[:2]
    before = [k[shared].clone() for k, _ in runner.kv_caches]
    runner.add_with_prefix("B", prefix + _tokens(8, 5), src_id="P", num_blocks=2)
    runner.step([("B", 5)])
    for (k, _), old in zip(runner.kv_caches, before):
        assert torch.equal(k[shared], old)


def test_written_kv_reads_back_through_the_logical_view() -> None:
    """Whatever the storage order, cache[block, offset, kv_head] is the token's K/V."""
    backend = torch_backend.TorchAttentionBackend
    k_cache, v_cache = backend.allocate_kv_cache(6, 4, 2, 8, torch.float32, torch.device("cpu"))
    k_cache.zero_(), v_cache.zero_()
    assert k_cache.shape == v_cache.shape == (6, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5 * 4 + 3, 0 * 4 + 1, 2 * 4 + 0])  # (block, offset) = (5,3) (0,1) (2,0)
    k_store, v_store = torch_backend._storage(k_cache, v_cache)
    metadata = torch_backend.TorchAttentionMetadata(3, slots, slots // 4, slots % 4, None, [])
    torch_backend._write_kv(key, value, k_store, v_store, metadata)
    for t, (block, offset) in enumerate([(5, 3), (0, 1), (2, 0)]):
        assert torch.equal(k_cache[block, offset], key[t])
        assert torch.equal(v_cache[block, offset], value[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3  # nothing else written


def test_foreign_cache_layout_is_refused() -> None:
    cache = torch.zeros(6, 4, 2, 8)  # block-major: not what allocate_kv_cache returns
    with pytest.raises(ValueError, match="allocate_kv_cache"):
        torch_backend._storage(cache, cache)


def test_sliding_window_decode_skips_blocks_before_the_window() -> None:
    """Window 20, block size 16: a 100-token request reads only blocks 5 and 6 (positions
    80..111, keys 80..99 unmasked); a 10-token one next to it reads its single block."""
    from pagellm.attention.backend import CommonAttentionMetadata

    table = torch.tensor([[40, 41, 42, 43, 44, 45, 46], [7, 0, 0, 0, 0, 0, 0]])
    common = CommonAttentionMetadata(
        num_reqs=2, num_actual_tokens=2, query_start_loc=torch.tensor([0, 1, 2]),
        seq_lens=torch.tensor([100, 10]), block_table=table,
        slot_mapping=torch.tensor([46 * 16 + 3, 7 * 16 + 9]), query_start_loc_cpu=[0, 1, 2],
        seq_lens_cpu=[100, 10], max_query_len=1, max_seq_len=100, block_size=16,
    )  # fmt: skip
    builder = torch_backend.TorchAttentionMetadataBuilder(16, torch.device("cpu"), sliding_window=20)
    dec = builder.build(common).decode
    assert dec.req_blocks == [2, 1]
    assert dec.block_table[0].tolist() == [45, 46]
    assert dec.block_table[1, 0].item() == 7
    assert dec.mask[0, 0].nonzero().flatten().tolist() == list(range(0, 20))  # 80..99
    assert dec.mask[1, 0].nonzero().flatten().tolist() == list(range(0, 10))
    full = torch_backend.TorchAttentionMetadataBuilder(16, torch.device("cpu")).build(common).decode
    assert full.req_blocks == [7, 1] and int(full.mask[0, 0].sum()) == 100
