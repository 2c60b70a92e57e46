"""Sampler tests on hand-made logits: each processing step changes exactly what it should.

The oracle is plain torch (argmax, log_softmax) or a hand-computed distribution.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pagellm.kernels import load_kernels
from pagellm.sample import ops
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.ops import apply_penalties, apply_top_k_top_p
from pagellm.sample.sampler import Sampler, compute_prompt_logprobs, gather_logprobs

V = 32


def make_metadata(batch: int, **overrides: Any) -> SamplingMetadata:
    """All-greedy, no-penalty metadata; keyword arguments override fields."""
    fields: dict[str, Any] = dict(
        temperature=None,
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        min_p=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        presence_penalties=None,
        frequency_penalties=None,
        repetition_penalties=None,
        prompt_token_ids=None,
        output_token_ids=[[] for _ in range(batch)],
    )
    fields.update(overrides)
    return SamplingMetadata(**fields)


def random_metadata(batch: int, temperature: float = 1.0, **overrides: Any) -> SamplingMetadata:
    return make_metadata(
        batch,
        temperature=torch.full((batch,), temperature),
        all_greedy=False,
        all_random=True,
        **overrides,
    )


def logits_for(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed))


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> list[int]:
    return Sampler().forward(logits, metadata).sampled_token_ids.tolist()


@pytest.fixture(params=["c", "torch"])
def sampling_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a random-sampling test through the C kernels (kernels/sampling.c) and through
    the torch composition they replace (what runs where they do not apply)."""
    if request.param == "torch":
        monkeypatch.setattr(ops, "_row_kernels", lambda logits: None)
    elif load_kernels() is None:
        pytest.skip("no C compiler: the torch path is the only one")
    return request.param


def test_greedy_is_argmax_and_leaves_input_untouched() -> None:
    logits = logits_for(4)
    before = logits.clone()
    out = Sampler().forward(logits, make_metadata(4))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_top_k_1_equals_greedy(sampling_path: str) -> None:
    logits = logits_for(8, seed=1)
    metadata = random_metadata(8, top_k=torch.ones(8, dtype=torch.int64))
    assert sample(logits, metadata) == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_take_argmax(sampling_path: str) -> None:
    logits = logits_for(4, seed=2)
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    metadata = make_metadata(4, temperature=temperature, all_greedy=False, all_random=False)
    out = sample(logits, metadata)
    assert out[0] == logits[0].argmax().item() and out[2] == logits[2].argmax().item()


def seeded_draws(batch: int, row: int, seed: int, steps: int) -> list[int]:
    """Draws `steps` tokens for a seeded request placed at `row` of a batch."""
    logits = logits_for(batch, seed=3)
    logits[row] = logits_for(1, seed=4)[0]  # the seeded request's logits, same everywhere
    generators = {row: torch.Generator().manual_seed(seed)}
    draws = []
    for _ in range(steps):
        metadata = random_metadata(batch, generators=generators)
        draws.append(sample(logits, metadata)[row])
    return draws


def test_seeded_sampling_is_reproducible_and_batch_independent(sampling_path: str) -> None:
    alone = seeded_draws(batch=1, row=0, seed=1234, steps=20)
    assert alone == seeded_draws(batch=1, row=0, seed=1234, steps=20)
    assert alone == seeded_draws(batch=4, row=2, seed=1234, steps=20)
    assert len(set(alone)) > 1  # it really samples
    assert alone != seeded_draws(batch=1, row=0, seed=99, steps=20)


def test_sampling_follows_the_distribution(sampling_path: str) -> None:
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    gens = {0: torch.Generator().manual_seed(0)}
    counts = torch.bincount(torch.tensor(sample(logits, random_metadata(4000, generators=gens))))
    freq = counts.float() / 4000
    assert abs(freq[0] - 0.6) < 0.04 and abs(freq[1] - 0.3) < 0.04
    assert len(counts) <= 3  # zero-probability tokens are never drawn


HAND_PROBS = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2])  # sorted desc: 1, 3, 4, 2, 0


def kept_tokens(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.3, {1}), (0.5, {1, 3}), (0.7, {1, 3, 4}), (0.9, {1, 3, 4, 2}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_the_smallest_nucleus(top_p: float, expected: set[int]) -> None:
    logits = HAND_PROBS.log().unsqueeze(0)
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([top_p]))
    assert kept_tokens(out) == expected
    # Surviving logits are unchanged, in their original columns.
    assert torch.equal(out[0, list(expected)], logits[0, list(expected)])


def test_top_k_keeps_k_best_per_row() -> None:
    logits = HAND_PROBS.log().unsqueeze(0).repeat(3, 1)
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, 0, 4]), None)
    assert kept_tokens(out[0:1]) == {1, 3}
    assert kept_tokens(out[1:2]) == {0, 1, 2, 3, 4}  # 0 = off
    assert kept_tokens(out[2:3]) == {1, 3, 4, 2}


def test_min_p_excludes_tokens_below_threshold_through_sampler(sampling_path: str) -> None:
    # min_p=0.45 of max 0.4 -> threshold 0.18: tokens 1 (0.4), 3 (0.25), 4 (0.2) survive.
    logits = HAND_PROBS.log().unsqueeze(0).repeat(2000, 1)
    metadata = random_metadata(
        2000, min_p=torch.full((2000,), 0.45), generators={0: torch.Generator().manual_seed(1)}
    )
    assert set(sample(logits, metadata)) == {1, 3, 4}


def test_top_p_through_sampler(sampling_path: str) -> None:
    logits = HAND_PROBS.log().unsqueeze(0).repeat(2000, 1)
    metadata = random_metadata(2000, top_p=torch.full((2000,), 0.7))
    assert set(sample(logits, metadata)) == {1, 3, 4}


def test_repetition_penalty_on_prompt_and_output_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0]])
    prompt = torch.tensor([[0, 1, 6, 6]])  # padded with vocab_size = 6
    expected = torch.tensor([[1.0, -4.0, 1.0, -4.0, 1.0, 1.0]])
    apply_penalties(
        logits, prompt, [[2, 3, 3]], torch.zeros(1), torch.zeros(1), torch.tensor([2.0])
    )
    assert torch.equal(logits, expected)


def test_presence_and_frequency_penalties_only_count_output_tokens() -> None:
    logits = torch.zeros(1, 6)
    prompt = torch.tensor([[5, 5, 5]])
    apply_penalties(
        logits, prompt, [[1, 2, 2, 2]], torch.tensor([0.5]), torch.tensor([0.25]), torch.ones(1)
    )
    assert logits.tolist() == [[0.0, -0.75, -1.25, 0.0, 0.0, 0.0]]


def test_penalties_through_sampler_flip_the_argmax() -> None:
    logits = torch.tensor([[3.0, 2.9] + [0.0] * (V - 2)])
    metadata = make_metadata(
        1,
        no_penalties=False,
        presence_penalties=torch.tensor([1.0]),
        frequency_penalties=torch.tensor([0.0]),
        repetition_penalties=torch.tensor([1.0]),
        prompt_token_ids=torch.tensor([[V]]),
        output_token_ids=[[0]],
    )
    assert sample(logits, metadata) == [1]


def test_logit_bias() -> None:
    logits = torch.zeros(2, V)
    metadata = make_metadata(2, logit_bias={0: {7: 5.0}, 1: {3: 1.0, 9: 2.0}})
    assert sample(logits, metadata) == [7, 9]


def test_allowed_token_ids_mask() -> None:
    logits = logits_for(2, seed=5)
    mask = torch.ones(2, V, dtype=torch.bool)
    mask[0, [4, 5]] = False
    mask[1, :] = False  # row 1 is unrestricted
    out = sample(logits, make_metadata(2, allowed_token_ids_mask=mask))
    assert out[0] == 4 + int(logits[0, 5] > logits[0, 4])
    assert out[1] == logits[1].argmax().item()


def test_min_tokens_blocks_eos_until_reached() -> None:
    logits = torch.zeros(2, V)
    logits[:, 0] = 10.0  # EOS = 0 is the favourite
    logits[:, 3] = 5.0
    metadata = make_metadata(
        2,
        output_token_ids=[[1, 2], [1, 2, 3]],
        min_tokens={0: (3, {0}), 1: (3, {0})},  # row 1 already has 3 tokens
    )
    assert sample(logits, metadata) == [3, 0]


def test_bad_words_ban_last_token_only_after_matching_prefix() -> None:
    logits = torch.zeros(3, V)
    logits[:, 9] = 5.0
    logits[:, 8] = 4.0
    bad = [[4, 5, 9]]  # banned word: 4 5 9
    metadata = make_metadata(
        3,
        output_token_ids=[[1, 4, 5], [4, 6], []],
        bad_words_token_ids={0: bad, 1: bad, 2: [[8], [9]]},
    )
    assert sample(logits, metadata) == [8, 9, 0]


def test_logprobs_are_raw_topk_with_sampled_rank() -> None:
    logits = logits_for(3, seed=6)
    metadata = make_metadata(
        3,
        max_num_logprobs=4,
        logit_bias={1: {int(logits[1].argmin()): 100.0}},  # row 1 samples its worst token
    )
    out = Sampler().forward(logits, metadata)
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert sampled[1].item() == logits[1].argmin().item()
    assert out.logprobs.token_ids.shape == (3, 5)
    assert torch.equal(out.logprobs.token_ids[:, 0], sampled)
    top = raw.topk(4, dim=-1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], top.values)
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    assert out.logprobs.ranks.tolist() == [1, V, 1]
    lists = out.logprobs.tolists()
    assert lists.ranks == [1, V, 1] and len(lists.logprob_token_ids[0]) == 5


def test_logprobs_zero_topk_returns_sampled_only() -> None:
    out = Sampler().forward(logits_for(2), make_metadata(2, max_num_logprobs=0))
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (2, 1)


def test_compute_prompt_logprobs() -> None:
    logits = logits_for(5, seed=7)
    targets = torch.tensor([3, 1, 4, 1, 5])
    result = compute_prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, dim=-1)
    expected_ranks = [int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate(targets.tolist())]
    assert result.ranks.tolist() == expected_ranks
    assert result.token_ids[:, 0].tolist() == targets.tolist()
    torch.testing.assert_close(result.logprobs[:, 0], raw[torch.arange(5), targets])
    assert math.isclose(float(result.logprobs[0, 1]), float(raw[0].max()), rel_tol=1e-6)


def test_argmax_kernel_equals_torch_argmax() -> None:
    """ops.argmax (the C kernel on float32 CPU rows) picks what torch.argmax picks: the
    first index on ties, within a lane of eight and across lanes, the first NaN."""
    from pagellm.sample.ops import argmax

    gen = torch.Generator().manual_seed(0)
    for rows, width in [(1, 1), (3, 7), (2, 8), (4, 9), (5, 17), (51, 49152), (2, 49155)]:
        x = torch.randn(rows, width, generator=gen)
        assert torch.equal(argmax(x), x.argmax(dim=-1)), (rows, width)
    x = torch.zeros(8, 37)
    x[1] = float("-inf")  # every value -inf: index 0
    x[2, 5] = x[2, 13] = 3.0  # two lanes tie: the lower index
    x[3, 10] = x[3, 2] = 4.0  # the later lane holds the lower index
    x[4, 30] = x[4, 34] = 2.0  # in the tail after the lanes
    x[5, 21] = float("nan")
    x[5, 3] = float("nan")
    x[5, 0] = float("inf")
    x[6, 36] = float("nan")  # a NaN in the tail only
    x[7] = torch.arange(37.0) % 5  # 4.0 first at index 4
    assert argmax(x).tolist() == [0, 0, 5, 2, 30, 3, 36, 4]
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    wide = torch.randn(4, 100, generator=gen)
    assert torch.equal(argmax(wide[:, :61]), wide[:, :61].argmax(dim=-1))  # rows 100 apart


def draw(logits: torch.Tensor, uniform: list[float], top_k: list[int] | None = None,
         top_p: list[float] | None = None, skip: list[bool] | None = None) -> list[int]:
    """pg_sample_rows on float32 rows, with the uniform number of each row given."""
    lib = load_kernels()
    rows, width = logits.shape
    out = torch.full((rows,), -7, dtype=torch.int64)
    k = torch.tensor(top_k, dtype=torch.int64) if top_k is not None else None
    p = torch.tensor(top_p, dtype=torch.float32) if top_p is not None else None
    u = torch.tensor(uniform, dtype=torch.float64)
    s = torch.tensor(skip, dtype=torch.uint8) if skip is not None else None
    assert lib.pg_sample_rows(
        logits.data_ptr(), logits.stride(0), rows, width, k.data_ptr() if k is not None else None,
        p.data_ptr() if p is not None else None, u.data_ptr(),
        s.data_ptr() if s is not None else None, out.data_ptr()) == 0
    return out.tolist()


def kept_weights(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits) in float64 over the tokens the torch path keeps
    (apply_top_k_top_p), 0 elsewhere."""
    kept = apply_top_k_top_p(logits[None].clone(), torch.tensor([top_k]),
                             torch.tensor([top_p]))[0] > float("-inf")
    return torch.softmax(logits.double(), dim=-1) * kept


def inverse_draws(weights: torch.Tensor, grid: list[float]) -> list[tuple[int, float]]:
    """For each u, the first token in column order whose running sum of weights passes
    u * (their total), and how close u * total came to a running sum (a draw that close to
    a boundary may round either way)."""
    cum = weights.cumsum(0)
    targets = torch.tensor(grid, dtype=torch.float64) * cum[-1]
    chosen = torch.searchsorted(cum, targets, right=True)
    margins = (cum[None, :] - targets[:, None]).abs().amin(dim=1) / cum[-1]
    return list(zip(chosen.tolist(), margins.tolist()))


@pytest.mark.skipif(load_kernels() is None, reason="no C compiler")
@pytest.mark.parametrize("width", [5, 33, 1000, 49155])
def test_sample_kernel_draws_what_the_torch_composition_keeps(width: int) -> None:
    """For a grid of uniform numbers, pg_sample_rows draws exactly the token that inverse
    sampling over the torch path's kept set draws, for top-k, top-p, both and neither, on
    peaked and flat rows with masked tokens (draws within 1e-6 of a boundary excepted)."""
    gen = torch.Generator().manual_seed(width)
    settings = [(0, 1.0), (1, 1.0), (3, 1.0), (40, 1.0), (width - 1, 1.0), (0, 0.05),
                (0, 0.5), (0, 0.9), (0, 0.999), (40, 0.95), (3, 0.5)]
    fixed = [(i + 0.5) / 64 for i in range(64)] + [0.0, 1.0 - 2**-40]
    compared = 0
    for scale in (0.5, 3.0, 12.0):
        logits = torch.randn(width, generator=gen) * scale
        logits[torch.randperm(width, generator=gen)[: width // 5]] = float("-inf")
        for top_k, top_p in settings:
            weights = kept_weights(logits, top_k, top_p)
            # and the middle of the share of each of the 32 lightest kept tokens: the
            # ones at the edge of top-k and top-p, which a kept set one token off misses
            cum = weights.cumsum(0) / weights.sum()
            share = weights / weights.sum()
            lightest = torch.where(share > 0, share, 2.0).argsort()[:32]
            grid = fixed + [float(cum[j] - share[j] / 2) for j in lightest if share[j] > 0]
            rows = logits[None].expand(len(grid), width).contiguous()
            got = draw(rows, grid, [top_k] * len(grid), [top_p] * len(grid))
            for u, token, (expected, margin) in zip(grid, got, inverse_draws(weights, grid)):
                if margin > 1e-6:
                    assert token == expected, (scale, top_k, top_p, u)
                    compared += 1
                assert logits[token] > float("-inf")
    assert compared > 0.95 * 3 * len(settings) * len(fixed)


@pytest.mark.skipif(load_kernels() is None, reason="no C compiler")
def test_sample_kernel_edges() -> None:
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([
        [-inf, 0.0, -inf, 1.0, -inf],  # masked tokens are never drawn, even at u = 0
        [-inf, 0.0, -inf, 1.0, -inf],  # u just under 1: the last kept token in column order
        [-inf, -inf, 2.0, -inf, -inf],  # one token left
        [nan, 1.0, nan, 1.0, 0.0],  # NaN counts as masked
        [-inf] * 5,  # nothing left: torch's argmax (0)
        [0.0, inf, 1.0, inf, 2.0],  # +inf: the first of them
        [1.0, 3.0, 3.0, 3.0, 0.0],  # top-k 2 keeps all three tied at the 2nd best
        [1.0, 3.0, 3.0, 3.0, 0.0],
        [5.0, 4.0, 3.0, 2.0, 1.0],  # top-p near 0: the best token only
        [5.0, 4.0, 3.0, 2.0, 1.0],  # skipped row: left untouched
    ])
    u = [0.0, 1.0 - 2**-40, 0.7, 0.0, 0.3, 0.9, 0.0, 1.0 - 2**-40, 0.999, 0.5]
    top_k = [0, 0, 0, 0, 0, 0, 2, 2, 0, 0]
    top_p = [1.0] * 8 + [1e-6, 1.0]
    skip = [False] * 9 + [True]
    assert draw(x, u, top_k, top_p, skip) == [1, 3, 2, 1, 0, 1, 1, 3, 0, -7]


@pytest.mark.skipif(load_kernels() is None, reason="no C compiler")
def test_sample_rows_skips_greedy_rows_and_takes_seeded_numbers() -> None:
    """ops.sample_rows: a seeded row draws from its own generator's next float64 (so the
    same seed and step give the same token in any batch); skipped rows are not drawn."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3))
    gens = {1: torch.Generator().manual_seed(5)}
    out = ops.sample_rows(logits, None, None, gens, skip=torch.tensor([True, False, False]))
    u = float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(5)))
    assert out[1].item() == draw(logits[1:2].contiguous(), [u])[0]
    assert ops.sample_rows(logits.to(torch.float64), None, None, {}) is None  # not float32


@pytest.mark.parametrize("overrides", [
    {"logit_bias": {0: {3: 5.0}}},
    {"min_tokens": {0: (3, {0})}},
    {"bad_words_token_ids": {0: [[2]]}},
    {"allowed_token_ids_mask": torch.tensor([[False, True] * (V // 2)])},
    {"no_penalties": False, "presence_penalties": torch.tensor([1.0]),
     "frequency_penalties": torch.tensor([0.0]), "repetition_penalties": torch.tensor([2.0]),
     "prompt_token_ids": torch.tensor([[1, 2]]), "output_token_ids": [[3]]},
])
def test_greedy_rows_with_logit_changes_leave_the_caller_logits_untouched(
        overrides: dict[str, Any]) -> None:
    """Greedy rows read the caller's logits without a copy only when nothing writes to
    them; every in-place step takes the private copy."""
    logits = logits_for(1, seed=8)
    before = logits.clone()
    Sampler().forward(logits, make_metadata(1, **overrides))
    assert torch.equal(logits, before)


@pytest.mark.skipif(load_kernels() is None, reason="no C compiler")
def test_penalty_kernel_equals_the_torch_composition(monkeypatch: pytest.MonkeyPatch) -> None:
    """pg_apply_penalties (touching only seen tokens) gives bit for bit the logits of the
    torch composition: repeated tokens, prompt-only and output-only tokens, padding,
    rows without output, positive and negative logits."""
    gen = torch.Generator().manual_seed(9)
    rows, width = 6, 1000
    logits = torch.randn(rows, width, generator=gen) * 4
    prompt_lens = [7, 0, 300, 12, 1, 50]
    prompt = torch.full((rows, max(prompt_lens)), width, dtype=torch.int64)
    for i, n in enumerate(prompt_lens):
        prompt[i, :n] = torch.randint(0, 40, (n,), generator=gen)  # many repeats
    outputs = [torch.randint(0, 60, (n,), generator=gen).tolist() for n in (5, 0, 90, 3, 1, 400)]
    presence = torch.tensor([0.5, 0.0, -0.3, 1.0, 0.0, 2.0])
    frequency = torch.tensor([0.25, 0.1, 0.0, -0.5, 0.7, 0.05])
    repetition = torch.tensor([1.3, 1.0, 0.8, 2.0, 1.1, 1.05])
    ran_c = []

    def run(in_c: bool) -> torch.Tensor:
        if not in_c:
            monkeypatch.setattr(ops, "_row_kernels", lambda logits: None)
        out = logits.clone()
        apply_penalties(out, prompt, outputs, presence, frequency, repetition)
        ran_c.append(in_c)
        return out

    via_c = run(True)
    via_torch = run(False)
    assert ran_c == [True, False]
    assert not torch.equal(via_c, logits)
    assert torch.equal(via_c, via_torch)


@pytest.mark.skipif(load_kernels() is None, reason="no C compiler")
@pytest.mark.parametrize("width", [1, 7, 1000, 49155])
def test_logprobs_kernel_equals_log_softmax_topk_and_rank(width: int) -> None:
    """pg_logprobs_rows gives gather_logprobs(log_softmax(x)): the chosen token's logprob,
    the k best (best first) and the chosen token's rank, with masked tokens in the row."""
    from pagellm.sample.sampler import compute_logprobs

    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(5, width, generator=gen) * 3
    if width > 10:
        logits[:, torch.randperm(width, generator=gen)[: width // 10]] = float("-inf")
    chosen = torch.stack([torch.randint(0, width, (), generator=gen) for _ in range(4)]
                         + [logits[4].argmax()])
    chosen[0] = logits[0].argmax()
    for k in sorted({0, 1, min(5, width), min(20, width), min(64, width)}):
        got = ops.logprobs_rows(logits, k, chosen)
        assert got is not None
        ref = gather_logprobs(torch.log_softmax(logits, dim=-1), k, chosen)
        assert torch.equal(got[0], ref.token_ids), k
        torch.testing.assert_close(got[1], ref.logprobs, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[2], ref.ranks), k
        via_sampler = compute_logprobs(logits, k, chosen)
        assert torch.equal(via_sampler.token_ids, ref.token_ids)
    if width > 64:  # more than 64 (or all, -1) top logprobs: torch's ops
        assert ops.logprobs_rows(logits, 65, chosen) is None
        every = compute_logprobs(logits, -1, chosen)
        assert every.token_ids.shape == (5, 1 + width)
        assert torch.equal(every.ranks, gather_logprobs(torch.log_softmax(logits, dim=-1), -1, chosen).ranks)


@pytest.mark.skipif(load_kernels() is None, reason="no C compiler")
def test_logprobs_kernel_ties_take_the_lower_column_first() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0, 3.0]])
    ids, values, ranks = ops.logprobs_rows(logits, 4, torch.tensor([2]))
    assert ids.tolist() == [[2, 1, 3, 5, 2]]
    assert ranks.tolist() == [4]  # three tokens are more likely than token 2
    torch.testing.assert_close(values[0], torch.log_softmax(logits, -1)[0][[2, 1, 3, 5, 2]])
