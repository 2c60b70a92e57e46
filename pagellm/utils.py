"""Small helpers shared across layers (vLLM keeps these in vllm/utils)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")
V = TypeVar("V")


def lookup(registry: Mapping[str, V], name: str, what: str) -> V:
    """registry[name], or a ValueError naming the accepted names ("unknown <what> ...")."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; accepted: {', '.join(sorted(registry))}") from None


def cdiv(a: T, b: int) -> T:
    """Ceiling division for non-negative integers (or integer tensors): cdiv(9, 4) == 3.
    The one spelling of the rule; write this, not -(-a // b)."""
    return -(a // -b)  # type: ignore[operator]
