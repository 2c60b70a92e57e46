"""Tool-call parsers by vLLM's `--tool-call-parser` names, and helpers for tool requests.

`get_tool_parser(name)` returns the parser class; `tool_choice` holds the constrained
(`required` / named) schemas; `generic_prompt` serves templates without tools support.
"""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    FunctionCall,
    StreamDelta,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    make_tool_call_id,
)
from pagellm.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from pagellm.entrypoints.openai.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser
from pagellm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from pagellm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser
from pagellm.utils import lookup

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    return lookup(TOOL_PARSERS, name, "tool call parser")


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "FunctionCall",
    "StreamDelta",
    "ToolCall",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
    "make_tool_call_id",
]
