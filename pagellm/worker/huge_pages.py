"""2 MB pages under the CPU KV cache, once its blocks are in use.

Decode attention reads every block of every running request, each a few KB, scattered
over a pool of gigabytes: on 4 KB pages nearly every block read costs a TLB miss and a
page walk. Asking for huge pages when the pool is allocated (MADV_HUGEPAGE) would undo
its lazy paging (see ModelRunner.initialize_kv_cache): the first block touched in each
2 MB region would make the whole region resident, up to 2 MB x layers x 2 x KV heads
before the cache holds anything. Instead, once every block overlapping a 2 MB-aligned
region has been handed out (so all its pages are resident anyway), the region is
collapsed in place with MADV_COLLAPSE (Linux 6.1+): the same memory, one TLB entry.
Nothing changes where the kernel cannot do it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import numpy as np

from pagellm.logger import init_logger
from pagellm.utils import libc_madvise

logger = init_logger(__name__)

HUGE_PAGE = 1 << 21
MADV_COLLAPSE = 25
MAX_COLLAPSES_PER_STEP = 8
"""Regions folded per call: each copies 2 MB, and all of a layer stack's regions fill in
the same step, so they are spread over steps instead of stalling one."""


def _madvise() -> Callable[[int, int, int], int] | None:
    """madvise where huge pages can be asked for (not where THP is "never")."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
    except OSError:
        return None
    return libc_madvise()


class KVHugePages:
    """Tracks the 2 MB-aligned regions of the cache tensors and collapses each one once
    all the blocks it overlaps are in use.

    `storages`: (address, bytes) of each tensor, laid out as units of `unit_bytes`, unit
    u holding part of block u % num_blocks (a [KV heads, blocks, ...] tensor: one unit
    per head and block)."""

    def __init__(self, storages: list[tuple[int, int]], unit_bytes: int, num_blocks: int):
        self.num_blocks = num_blocks
        self.madvise = _madvise()
        first, last, addr = [], [], []
        units = 0
        for base, nbytes in storages:
            units = max(units, nbytes // unit_bytes)
            start = -(-base // HUGE_PAGE) * HUGE_PAGE
            for a in range(start, base + nbytes - HUGE_PAGE + 1, HUGE_PAGE):
                first.append((a - base) // unit_bytes)
                last.append(-(-(a + HUGE_PAGE - base) // unit_bytes))  # exclusive
                addr.append(a)
        self.reps = -(-units // num_blocks)
        self.first = np.array(first, dtype=np.int64)
        self.last = np.array(last, dtype=np.int64)
        self.addr = np.array(addr, dtype=np.int64)
        self.collapsed = 0
        self.backlog = False
        """Regions left full but not yet collapsed by the last update (see the cap)."""
        if self.madvise is None:
            self.addr = self.addr[:0]

    @property
    def pending(self) -> int:
        return len(self.addr)

    def update(self, in_use: np.ndarray) -> None:
        """`in_use[b]`: block b has been handed out (its pages are resident)."""
        if not len(self.addr):
            return
        counts = np.zeros(self.reps * self.num_blocks + 1, dtype=np.int64)
        np.cumsum(np.tile(in_use, self.reps), out=counts[1:])
        full = np.flatnonzero(counts[self.last] - counts[self.first] == self.last - self.first)
        done = full[:MAX_COLLAPSES_PER_STEP]
        self.backlog = len(full) > len(done)
        for a in self.addr[done].tolist():
            if self.madvise(a, HUGE_PAGE, MADV_COLLAPSE) != 0:
                err = ctypes.get_errno()
                if err in (22, 38):  # EINVAL / ENOSYS: this kernel has no MADV_COLLAPSE
                    logger.debug("KV cache huge pages: madvise(MADV_COLLAPSE) %s", os.strerror(err))
                    self.addr = self.addr[:0]
                    self.backlog = False
                    return
                continue  # EAGAIN / ENOMEM: no huge page free now; this region stays as it is
            self.collapsed += 1
        keep = np.ones(len(self.addr), dtype=bool)
        keep[done] = False
        self.first, self.last, self.addr = self.first[keep], self.last[keep], self.addr[keep]
