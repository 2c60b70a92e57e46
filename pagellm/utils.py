"""Small helpers shared across layers (vLLM keeps these in vllm/utils)."""

from __future__ import annotations

import ctypes
import functools
import signal
import sys
from collections.abc import Callable, Mapping
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


@functools.cache
def libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise(address, length, advice) -> 0 or -1 (errno set), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class Progress:
    """Work this process has done: engine steps and model layers run. An engine core's
    heartbeat reads the count, so its frontend can tell a long step (the count moves, a
    layer at a time) from a hung one (it stands still). `paused` is above 0 while work
    that cannot count runs (torch.compile building the model's code)."""

    __slots__ = ("count", "paused")

    def __init__(self) -> None:
        self.count = 0
        self.paused = 0

    def tick(self) -> None:
        self.count += 1


PROGRESS = Progress()
"""This process's one Progress."""


def describe_exit(returncode: int | None) -> str:
    """A process's end in words (an engine core's, a tensor-parallel rank's): 'killed by
    SIGKILL', 'exited with code 1'."""
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"
