"""Reasoning written as `<think> ... </think>` then the answer (DeepSeek-R1, Qwen3).

Reasoning is stripped of surrounding whitespace, the answer of leading whitespace; an
output that never enters reasoning is content, verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from pagellm.reasoning.abs_reasoning_parsers import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningStreamer,
)
from pagellm.streaming_text import ContentStream, partial_marker_suffix


class ThinkReasoningParser(ReasoningParser):
    start_token = "<think>"
    end_token = "</think>"
    starts_in_reasoning = False
    """True when the chat template already opened `<think>`, so the output may begin
    inside reasoning without it."""

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        head = text.lstrip()
        if head.startswith(self.start_token):
            body = head[len(self.start_token) :]
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text or None
        reasoning, found, content = body.partition(self.end_token)
        return reasoning.strip() or None, (content.lstrip() if found else "") or None

    def streamer(self) -> ThinkReasoningStreamer:
        return ThinkReasoningStreamer(self)

    def _token_id(self, token: str) -> int | None:
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs a tokenizer for token ids")
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if not isinstance(token_id, int) or (unk is not None and token_id == unk):
            return None
        return token_id

    @cached_property
    def reasoning_start_token_id(self) -> int | None:
        return self._token_id(self.start_token)

    @cached_property
    def reasoning_end_token_id(self) -> int:
        token_id = self._token_id(self.end_token)
        if token_id is None:
            raise ValueError(f"the tokenizer has no single token for {self.end_token!r}")
        return token_id

    def _last_end(self, token_ids: Sequence[int]) -> int | None:
        """Index of the `</think>` that closes the latest reasoning, if it is closed."""
        end_id, start_id = self.reasoning_end_token_id, self.reasoning_start_token_id
        for i in range(len(token_ids) - 1, -1, -1):
            if token_ids[i] == end_id:
                return i
            if token_ids[i] == start_id:
                return None
        return None

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        return self._last_end(token_ids) is not None

    def extract_content_ids(self, token_ids: Sequence[int]) -> list[int]:
        end = self._last_end(token_ids)
        return [] if end is None else list(token_ids[end + 1 :])


class ThinkReasoningStreamer(ReasoningStreamer):
    """Holds back text that could still be the opening `<think>` (at the start) or a
    partial `</think>` (inside reasoning), and whitespace the final split would strip."""

    def __init__(self, parser: ThinkReasoningParser) -> None:
        self._p = parser
        self._buf = ""
        self._state = "start"  # start | reasoning | answer | verbatim
        self._reasoning = ContentStream()
        self._answer_started = False

    def feed(self, delta_text: str) -> ReasoningDelta:
        self._buf += delta_text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        start, end = self._p.start_token, self._p.end_token
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(start):
                self._buf, self._state = head[len(start) :], "reasoning"
            elif not final and start.startswith(head):
                return ReasoningDelta(None, None)
            else:
                self._state = "reasoning" if self._p.starts_in_reasoning else "verbatim"
        if self._state == "reasoning":
            i = self._buf.find(end)
            if i < 0:
                keep = 0 if final else partial_marker_suffix(self._buf, end)
                reasoning = self._reasoning.push(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
            else:
                reasoning = self._reasoning.push(self._buf[:i])
                self._buf, self._state = self._buf[i + len(end) :], "answer"
        if self._state == "answer":
            if not self._answer_started:
                self._buf = self._buf.lstrip()
                self._answer_started = bool(self._buf)
            content, self._buf = self._buf, ""
        elif self._state == "verbatim":
            content, self._buf = self._buf, ""
        return ReasoningDelta(reasoning or None, content or None)
