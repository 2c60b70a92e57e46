"""Tensor-parallel groups: the ranks that hold one model's shards and how they talk.

A `TensorParallelGroup` is a rank, a size and, above one rank, a gloo process group of its
own (`torch.distributed.ProcessGroupGloo` over a store), never torch.distributed's
default group: an engine core running inside a user's process must not claim the one a
user's own script may init. The layers built while a group is current
(`building_with(group)`) take their shard of the weights and keep the group for their
collectives; with no group current they get `SINGLE` (one rank: nothing to talk about).
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
from collections.abc import Iterator
from typing import Any

import torch


class TensorParallelGroup:
    def __init__(self, rank: int = 0, size: int = 1, process_group: Any = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tensor parallel rank {rank} is outside 0..{size - 1}")
        self.rank, self.size = rank, size
        self._pg = process_group

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
        self._pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [..., n] side by side along the last dim, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's obj on every rank (pickled: the ranks are processes one engine core
        started on its own machine, never a network peer)."""
        if self.size == 1:
            return obj
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


def init_tensor_parallel_group(rank: int, size: int, store_path: str,
                               timeout_s: float = 600.0) -> TensorParallelGroup:
    """Joins the group of `size` ranks that meet at the file store `store_path` (one
    machine): returns once every rank has joined."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, size)
    pg = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))
    return TensorParallelGroup(rank, size, pg)


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
