"""DeepSeek-R1: the chat template opens `<think>`, so the output starts inside reasoning
(an explicit `<think>` is accepted too); everything up to `</think>` is reasoning."""

from __future__ import annotations

from pagellm.reasoning.think_reasoning_parser import ThinkReasoningParser


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    starts_in_reasoning = True
