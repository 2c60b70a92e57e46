"""The reasoning-parser contract: model text in, (reasoning_content, content) out.

A `ReasoningParser` splits a finished output; its `streamer()` splits text deltas for one
request; the token-id methods tell the structured-output manager where reasoning ends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple


class ReasoningDelta(NamedTuple):
    reasoning_content: str | None
    content: str | None


class ReasoningStreamer(ABC):
    """Per-request streaming state. `feed` every text delta, then `finish` once."""

    @abstractmethod
    def feed(self, delta_text: str) -> ReasoningDelta: ...

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """Flushes held-back text; the stream ends here."""


class ReasoningParser(ABC):
    """Reads one model family's reasoning markup. `tokenizer` (a Hugging Face tokenizer)
    is needed only by the token-id methods."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content), each None when empty."""

    @abstractmethod
    def streamer(self) -> ReasoningStreamer: ...

    @property
    @abstractmethod
    def reasoning_end_token_id(self) -> int: ...

    @abstractmethod
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether reasoning is over by the end of `token_ids` (prompt + output so far)."""

    @abstractmethod
    def extract_content_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The ids after the end of reasoning; [] while reasoning goes on."""
