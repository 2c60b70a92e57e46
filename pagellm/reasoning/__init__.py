"""Reasoning parsers by vLLM's `--reasoning-parser` names: `<think>` output split into
`reasoning_content` and `content`."""

from __future__ import annotations

from pagellm.reasoning.abs_reasoning_parsers import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningStreamer,
)
from pagellm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from pagellm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser
from pagellm.utils import lookup

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    return lookup(REASONING_PARSERS, name, "reasoning parser")


__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStreamer",
    "get_reasoning_parser",
]
