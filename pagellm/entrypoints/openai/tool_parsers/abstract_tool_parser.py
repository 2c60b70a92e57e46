"""The tool-parser contract: model text in, OpenAI `tool_calls` out.

A `ToolParser` turns a finished completion into `ExtractedToolCalls`; its `streamer()` is a
per-request object that turns text deltas into `StreamDelta`s in OpenAI's streamed
`delta.tool_calls` shape. Nothing here knows about HTTP, pydantic or the engine.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def make_tool_call_id() -> str:
    """A fresh tool-call id, `call_` + 24 random hex digits (vLLM's shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class FunctionCall:
    name: str
    arguments: str
    """The arguments as a JSON text (OpenAI sends a string, not an object)."""


@dataclass
class ToolCall:
    function: FunctionCall
    id: str = field(default_factory=make_tool_call_id)
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's `message.tool_calls[i]` JSON."""
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.function.name, "arguments": self.function.arguments},
        }


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None
    """The text outside the tool calls, stripped; None when nothing is left."""


@dataclass
class StreamDelta:
    """What one `feed` adds to the response: a content piece and tool-call fragments.

    Each fragment is OpenAI's `delta.tool_calls[j]` dict. A call's first fragment carries
    `index`, `id`, `type` and `function.name` (+ possibly empty `function.arguments`); later
    fragments carry `index` and a `function.arguments` piece only.
    """

    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.content and not self.tool_calls


def first_fragment(index: int, name: str, arguments: str = "") -> dict[str, Any]:
    return {
        "index": index,
        "id": make_tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def arguments_fragment(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


def coalesce_fragments(fragments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Folds each arguments-only fragment into the previous fragment of the same index, so
    a delta carries at most one fragment per call."""
    out: list[dict[str, Any]] = []
    for frag in fragments:
        if out and out[-1]["index"] == frag["index"] and "id" not in frag:
            last = out[-1]
            args = last["function"].get("arguments", "") + frag["function"]["arguments"]
            out[-1] = {**last, "function": {**last["function"], "arguments": args}}
        else:
            out.append(frag)
    return out


class ToolCallStreamer(ABC):
    """Per-request streaming state. `feed` every text delta, then `finish` once."""

    @abstractmethod
    def feed(self, delta_text: str) -> StreamDelta: ...

    @abstractmethod
    def finish(self) -> StreamDelta:
        """Flushes held-back text; the stream ends here."""


class SteppedToolCallStreamer(ToolCallStreamer):
    """A streamer written as one `_step(delta, final)`: `feed` steps with each delta,
    `finish` with none, final."""

    def feed(self, delta_text: str) -> StreamDelta:
        return self._step(delta_text, final=False)

    def finish(self) -> StreamDelta:
        return self._step("", final=True)

    @abstractmethod
    def _step(self, delta_text: str, final: bool) -> StreamDelta: ...


class ToolParser(ABC):
    """Reads one model family's tool-call syntax. Stateless; state lives in streamers."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls: ...

    @abstractmethod
    def streamer(self) -> ToolCallStreamer: ...
