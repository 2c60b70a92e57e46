"""Pooler: a pooling request's prompt hidden states -> one vector (vLLM's Pooler).

In: each step's final-norm hidden rows of a request's prompt chunk (a long prompt runs in
chunks over several steps). Out: the pooled vector, float32, once its last chunk ran.
Normalisation and dimensions are the frontend's (PoolingParams); this knows no requests
beyond their ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Partial:
    total: torch.Tensor | None = None  # MEAN: float32 sum of the rows seen so far
    count: int = 0
    first: torch.Tensor | None = None  # CLS: the row at position 0


class Pooler:
    def __init__(self, pooling_type: str) -> None:
        self.pooling_type = pooling_type
        self._partial: dict[str, _Partial] = {}

    def begin(self, req_id: str) -> None:
        """A request (re)starts from its first prompt token: after a preemption it is
        recomputed, so what it had summed is dropped."""
        self._partial[req_id] = _Partial()

    def drop(self, req_id: str) -> None:
        self._partial.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._partial

    def add_chunk(self, req_id: str, rows: torch.Tensor, start_position: int, last: bool) -> torch.Tensor | None:
        """rows: [q, hidden], the hidden states of positions start_position ..
        start_position + q - 1. Returns the pooled vector [hidden] float32 when `last`
        (the chunk ends the prompt), else None."""
        part = self._partial[req_id]
        if self.pooling_type == "MEAN":
            s = rows.float().sum(dim=0)
            part.total = s if part.total is None else part.total + s
            part.count += rows.shape[0]
        elif self.pooling_type == "CLS" and start_position == 0:
            part.first = rows[0].float()
        if not last:
            return None
        del self._partial[req_id]
        if self.pooling_type == "MEAN":
            assert part.total is not None
            return part.total / part.count
        if self.pooling_type == "CLS":
            assert part.first is not None, "CLS pooling needs the first token computed (no prefix cache)"
            return part.first
        return rows[-1].float()
