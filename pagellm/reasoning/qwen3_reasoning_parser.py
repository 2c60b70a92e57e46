"""Qwen3: the model writes `<think>` itself; only an output that opens with it (after
whitespace) has reasoning, up to `</think>`. Any other output is all content."""

from __future__ import annotations

from pagellm.reasoning.think_reasoning_parser import ThinkReasoningParser


class Qwen3ReasoningParser(ThinkReasoningParser):
    starts_in_reasoning = False
