"""PoolingParams: how one pooling request (an embedding) is finished, vLLM's fields.

A msgspec Struct so it crosses the process boundary inside EngineCoreRequest. The engine
core only pools (the model's pooling type, engine-wide); `dimensions` and `normalize`
are applied in the frontend to the pooled vector.
"""

from __future__ import annotations

import msgspec


class PoolingParams(msgspec.Struct, omit_defaults=True):
    dimensions: int | None = None
    """Keep the first `dimensions` values (a matryoshka model's shorter embedding), then
    normalise. Only for models whose config lists matryoshka dimensions."""
    normalize: bool | None = None
    """Scale the embedding to unit length; None: the model's default (its
    sentence-transformers Normalize module, else True as in vLLM)."""
    task: str | None = None
    """'embed' (LLM.embed, /v1/embeddings) or 'encode'; informational here."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}.")

    def clone(self) -> PoolingParams:
        return msgspec.structs.replace(self)
