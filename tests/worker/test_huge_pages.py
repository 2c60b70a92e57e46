"""KV cache huge pages: a 2 MB region is collapsed exactly when every block it overlaps
is in use, at most MAX_COLLAPSES_PER_STEP per update, each once; and on this kernel the
collapse really maps the region with a huge page."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.worker import huge_pages
from pagellm.worker.huge_pages import HUGE_PAGE, MAX_COLLAPSES_PER_STEP, KVHugePages

KVH, NB, UNIT = 3, 1000, 4096  # a [KV heads, blocks, 16 x 64 floats] cache tensor


def _expected(base: int, nbytes: int, in_use: np.ndarray) -> set[int]:
    """Brute force: every aligned 2 MB region inside the tensor whose bytes all belong to
    blocks in use."""
    out = set()
    a = -(-base // HUGE_PAGE) * HUGE_PAGE
    while a + HUGE_PAGE <= base + nbytes:
        units = range((a - base) // UNIT, (a + HUGE_PAGE - 1 - base) // UNIT + 1)
        if all(in_use[u % NB] for u in units):
            out.add(a)
        a += HUGE_PAGE
    return out


def test_regions_collapse_once_all_their_blocks_are_in_use() -> None:
    tensors = [torch.empty(KVH, NB, UNIT // 4) for _ in range(2)]
    hp = KVHugePages([(t.data_ptr(), t.untyped_storage().nbytes()) for t in tensors], UNIT, NB)
    calls: list[int] = []
    hp.madvise = lambda addr, length, advice: calls.append(addr) or 0
    in_use = np.zeros(NB, dtype=bool)
    seen: set[int] = set()
    for upto in (1, 300, 512, 513, 999, NB):
        in_use[:upto] = True
        before = len(calls)
        hp.update(in_use)
        assert len(calls) - before <= MAX_COLLAPSES_PER_STEP
        while hp.backlog:
            hp.update(in_use)
        want = set().union(*(_expected(t.data_ptr(), t.untyped_storage().nbytes(), in_use) for t in tensors))
        assert set(calls) == want, upto
        assert len(calls) == len(set(calls))  # each region once
        seen = want
    # all blocks in use: every aligned region of both tensors, nothing left pending
    assert len(seen) == hp.collapsed and hp.pending == 0
    assert len(seen) >= 2 * (KVH * NB * UNIT // HUGE_PAGE - 1)


def test_collapse_maps_the_region_with_a_huge_page() -> None:
    if huge_pages._madvise() is None:
        pytest.skip("no transparent huge pages on this system")
    t = torch.empty(KVH, NB, UNIT // 4)
    t.fill_(1.0)  # every page resident, as after the blocks were handed out and zeroed
    hp = KVHugePages([(t.data_ptr(), t.untyped_storage().nbytes())], UNIT, NB)
    regions = hp.pending
    while True:
        hp.update(np.ones(NB, dtype=bool))
        if not hp.backlog:
            break
    if hp.collapsed == 0:
        pytest.skip("this kernel has no MADV_COLLAPSE or no free huge page")
    assert hp.pending == 0 and hp.collapsed <= regions
    start, end = t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()
    huge_kb = 0
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and line.startswith("AnonHugePages:"):
                huge_kb += int(line.split()[1])
    # the collapsed regions are mapped by huge pages; not necessarily all of them by the
    # time smaps is read: the kernel splits huge pages back under memory pressure (seen
    # once in CI: 5 collapsed, 4 still huge), which says nothing about the collapse
    assert 2048 <= huge_kb
    assert torch.all(t == 1.0)  # the same memory, contents kept
