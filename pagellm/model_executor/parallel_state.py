"""Tensor-parallel groups: the ranks that hold one model's shards and how they talk.

A `TensorParallelGroup` is a rank, a size and, above one rank, a gloo process group of its
own (`torch.distributed.ProcessGroupGloo` over a store), never torch.distributed's
default group: an engine core running inside a user's process must not claim the one a
user's own script may init. The ranks of one machine also share a memory segment
(`ShmChannel`, kernels/shm_collectives.c) that carries the float32 sums and gathers and
the broadcasts: gloo's loopback TCP took ~1 ms an all-reduce here (2-core AMD EPYC, any
size up to 4096 floats), the segment microseconds, and a decode step makes two sums a
layer. Without the C kernels gloo carries everything. The layers built while a group is
current (`building_with(group)`) take their shard of the weights and keep the group for
their collectives; with no group current they get `SINGLE` (one rank: nothing to talk
about).
"""

from __future__ import annotations

import contextlib
import datetime
import mmap
import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

SHM_SLOT_BYTES = 4 << 20
"""Bytes of one rank's slot in a shared-memory buffer: a larger tensor goes in chunks."""
SHM_WAIT_US = 200_000
"""A wait on the other ranks checks that they are alive this often (microseconds)."""


class ShmChannel:
    """The ranks' shared segment: a flag per rank (a 64-byte line each), then two buffers
    of a slot per rank (kernels/shm_collectives.c says how they alternate). Rank 0 creates
    the file (`create`) before it starts the others, every rank maps it, and it can be
    unlinked once all have."""

    @staticmethod
    def segment_bytes(size: int) -> int:
        """The segment's bytes for `size` ranks."""
        return 64 * size + 2 * size * SHM_SLOT_BYTES

    @staticmethod
    def create(path: str, size: int) -> None:
        """Makes the segment's file for `size` ranks (zeros: no flag raised yet)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, ShmChannel.segment_bytes(size))
        finally:
            os.close(fd)

    def __init__(self, path: str, rank: int, size: int,
                 check_peers: Callable[[], None] = lambda: None) -> None:
        from pagellm.kernels import load_kernels

        self.lib = load_kernels()
        if self.lib is None:
            raise RuntimeError("the shared-memory collectives need pagellm's C kernels")
        self.rank, self.size = rank, size
        self.check_peers = check_peers
        """Raises if a peer died (called while a wait goes on)."""
        self.header = 64 * size
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, self.segment_bytes(size))
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self._bytes.ctypes.data
        self.seq = 0

    def _exchange(self, src: int, nbytes: int) -> int:
        """Posts nbytes at address src as this rank's part of the next operation and waits
        for every rank's; returns the address of that operation's buffer (slot r at r *
        SHM_SLOT_BYTES)."""
        self.seq += 1
        buf = self.base + self.header + (self.seq & 1) * self.size * SHM_SLOT_BYTES
        self.lib.pg_shm_post(self.base, self.rank, self.seq, buf + self.rank * SHM_SLOT_BYTES, src, nbytes)
        while self.lib.pg_shm_wait(self.base, self.size, self.seq, SHM_WAIT_US):
            self.check_peers()
        return buf

    def _slot(self, buf: int, rank: int, count: int, dtype: np.dtype) -> np.ndarray:
        offset = buf - self.base + rank * SHM_SLOT_BYTES
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset)

    def all_reduce(self, x: torch.Tensor) -> None:
        """x (float32, contiguous) becomes the ranks' sum, added in rank order."""
        n, step = x.numel(), SHM_SLOT_BYTES // 4
        for start in range(0, n, step):
            count = min(step, n - start)
            ptr = x.data_ptr() + 4 * start
            buf = self._exchange(ptr, 4 * count)
            self.lib.pg_shm_sum_f32(buf, step, self.size, count, ptr)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [rows, n] (float32, contiguous, a row no larger than a slot)
        side by side: [rows, size * n]."""
        rows, n = x.shape
        out = torch.empty(rows, self.size * n, dtype=torch.float32)
        view = out.numpy()
        step = SHM_SLOT_BYTES // (4 * n)
        for start in range(0, rows, step):
            count = min(step, rows - start)
            buf = self._exchange(x.data_ptr() + 4 * start * n, 4 * count * n)
            for r in range(self.size):
                view[start : start + count, r * n : (r + 1) * n] = \
                    self._slot(buf, r, count * n, np.dtype(np.float32)).reshape(count, n)
        return out

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's payload on every rank (the others pass None): its length and bytes in
        slot-sized chunks."""
        src = np.frombuffer(len(payload).to_bytes(8, "little") + payload, dtype=np.uint8) \
            if self.rank == 0 else None
        offset, total, parts = 0, None, []
        while total is None or offset < total:
            chunk = src[offset : offset + SHM_SLOT_BYTES] if src is not None else None
            buf = self._exchange(chunk.ctypes.data if chunk is not None else 0,
                                 len(chunk) if chunk is not None else 0)
            if total is None:
                total = 8 + int.from_bytes(self._slot(buf, 0, 8, np.dtype(np.uint8)).tobytes(), "little")
            count = min(SHM_SLOT_BYTES, total - offset)
            if src is None:
                parts.append(self._slot(buf, 0, count, np.dtype(np.uint8)).tobytes())
            offset += count
        return payload if src is not None else b"".join(parts)[8:]


class TensorParallelGroup:
    def __init__(self, rank: int = 0, size: int = 1, process_group: Any = None,
                 shm: ShmChannel | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tensor parallel rank {rank} is outside 0..{size - 1}")
        self.rank, self.size = rank, size
        self._pg = process_group
        self.shm = shm
        """The ranks' shared segment (None: gloo carries everything)."""

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, size={self.size})"

    def shard(self, n: int, what: str = "size") -> tuple[int, int]:
        """(start, length) of this rank's even share of n (n divisible by the size)."""
        if n % self.size:
            raise ValueError(f"tensor parallel: {what} {n} does not split into {self.size} equal parts")
        part = n // self.size
        return self.rank * part, part

    def uneven_shard(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's share of n in parts of ceil(n / size): the last
        ranks' shorter or empty (a vocabulary the size does not divide)."""
        part = -(-n // self.size)
        start = min(n, self.rank * part)
        return start, min(n, start + part) - start

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (same shape), in x's memory; x itself on one rank."""
        if self.size == 1:
            return x
        if not x.is_contiguous():
            x = x.contiguous()
        if self.shm is not None and x.dtype == torch.float32:
            self.shm.all_reduce(x)
        else:
            self._pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [..., n] side by side along the last dim, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if (self.shm is not None and x.dtype == torch.float32 and x.dim() == 2
                and 4 * x.shape[1] <= SHM_SLOT_BYTES):  # the segment takes whole rows
            return self.shm.all_gather(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's obj on every rank (pickled: the ranks are processes one engine core
        started on its own machine, never a network peer)."""
        if self.size == 1:
            return obj
        if self.shm is not None:
            data = self.shm.broadcast_bytes(
                pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else None)
            return obj if self.rank == 0 else pickle.loads(data)
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self._pg.broadcast(length, 0).wait()
        if self.rank != 0:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._pg.broadcast(payload, 0).wait()
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())


SINGLE = TensorParallelGroup()
"""The group of a model that is not split."""

_building: TensorParallelGroup = SINGLE


def init_tensor_parallel_group(rank: int, size: int, store_path: str, timeout_s: float = 600.0,
                               shm_path: str | None = None,
                               check_peers: Callable[[], None] = lambda: None) -> TensorParallelGroup:
    """Joins the group of `size` ranks that meet at the file store `store_path` (one
    machine): returns once every rank has joined. With `shm_path` the ranks also share
    that segment (rank 0 has created it; each maps it before it joins, so once the group
    stands rank 0 may unlink it). `check_peers` raises when a peer has died."""
    import torch.distributed as dist

    shm = ShmChannel(shm_path, rank, size, check_peers) if shm_path else None
    store = dist.FileStore(store_path, size)
    pg = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))
    return TensorParallelGroup(rank, size, pg, shm)


def current_group() -> TensorParallelGroup:
    """The group whose shard the layers being built take (SINGLE outside building_with)."""
    return _building


@contextlib.contextmanager
def building_with(group: TensorParallelGroup) -> Iterator[None]:
    """Layers built inside take `group`'s shard of the model."""
    global _building
    previous, _building = _building, group
    try:
        yield
    finally:
        _building = previous
