"""The contract between the structured output manager and a grammar library.

A backend compiles a request's constraint (StructuredOutputsParams) into a Grammar: a
matcher that accepts sampled tokens and fills its row of a token bitmask. The bitmask is
int32 [rows, ceil(vocab / 32)], bit t of a row set where token t is allowed (the layout
xgrammar and llguidance share), applied to logits by `apply_token_bitmask`.
"""

from __future__ import annotations

import importlib
import warnings
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from pagellm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # the frontend validates constraints without importing torch
    import torch


class Grammar(ABC):
    """One request's matcher state."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advances over sampled tokens; False if one of them is not allowed (the state
        is then left before that token)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into `bitmask[row]`."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the constraint is complete and the stop token was accepted."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start (nothing accepted)."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer vocabulary. Thread-safe `compile`."""

    name: str

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """Compiles `params` into a fresh matcher (ValueError when it cannot)."""


def quiet_import(module: str) -> Any:
    """Imports a grammar library (xgrammar, llguidance.torch) without the
    DeprecationWarning that importing it draws from torch (torch.jit.script_method),
    which would otherwise reach every user at their first constraint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.script_method", category=DeprecationWarning)
        return importlib.import_module(module)


def import_xgrammar() -> Any:
    return quiet_import("xgrammar")


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets the logits of disallowed tokens to -inf in `rows` (bitmask row j applies to
    logits row rows[j]); other rows are not touched. xgrammar's kernel (vectorised on
    CPU) does the masking; its row indices address logits and bitmask alike, so the
    bitmask rows are first laid out at their logits rows."""
    if not rows:
        return
    xgr = import_xgrammar()
    full = bitmask
    if rows != list(range(logits.shape[0])):
        full = allocate_token_bitmask(logits.shape[0], logits.shape[1])
        full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), indices=rows)
