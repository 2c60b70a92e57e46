"""Verification of speculative proposals: which of a verify run's proposed tokens the
target model keeps (DESIGN.md's rejection sampler). In: the run's proposals and the token
the sampler picked at each of its rows. Out: the kept tokens. Knows no tensors.
"""

from __future__ import annotations


def accepted_tokens(proposed: list[int] | tuple, picked: list[int]) -> list[int]:
    """The tokens a verify run keeps: row j's pick follows the first j proposals, so the
    picks hold while each equals the proposal it was run on; the first that differs (or
    the pick after the last proposal) ends the run. For a proposal that is one token
    (n-gram lookup), keeping the sampled token where it equals the proposal and taking the
    sampled one where it does not is rejection sampling: the kept tokens follow the
    model's distribution exactly (greedy: its argmax)."""
    n = 0
    while n < len(proposed) and picked[n] == proposed[n]:
        n += 1
    return picked[: n + 1]
