"""Small arithmetic helpers shared across layers (vLLM keeps these in vllm/utils)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def cdiv(a: T, b: int) -> T:
    """Ceiling division for non-negative integers (or integer tensors): cdiv(9, 4) == 3.
    The one spelling of the rule; write this, not -(-a // b)."""
    return -(a // -b)  # type: ignore[operator]
