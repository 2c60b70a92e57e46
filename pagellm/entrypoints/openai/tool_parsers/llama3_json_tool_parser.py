"""Llama 3.x JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`, or
several such objects separated by `;`, optionally after `<|python_tag|>`.

Anything else (or a sequence that does not parse to the end) is plain content.
"""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    FunctionCall,
    SteppedToolCallStreamer,
    StreamDelta,
    ToolCall,
    ToolParser,
)
from pagellm.entrypoints.openai.tool_parsers.json_calls import (
    CallSequenceStream,
    parse_call_sequence,
)
from pagellm.streaming_text import ContentStream

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonToolParser(ToolParser):
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        text = model_output.strip()
        body = text[len(PYTHON_TAG) :] if text.startswith(PYTHON_TAG) else text
        if text.startswith(PYTHON_TAG) or text.startswith("{"):
            calls = parse_call_sequence(body, SEPARATOR, None)
            if calls:
                tool_calls = [ToolCall(FunctionCall(n, a)) for n, a in calls]
                return ExtractedToolCalls(True, tool_calls, None)
        return ExtractedToolCalls(False, [], text or None)

    def streamer(self) -> Llama3JsonToolCallStreamer:
        return Llama3JsonToolCallStreamer()


class Llama3JsonToolCallStreamer(SteppedToolCallStreamer):
    """Decides the mode from the first characters: `{` or `<|python_tag|>` start a call
    sequence, anything else makes the whole output content. In call mode nothing is shown
    as content unless the sequence fails; if no call was sent by then, the whole output is
    content (as in the non-streamed result), otherwise the unparsed rest is."""

    def __init__(self) -> None:
        self._raw = ""
        self._mode: str | None = None  # None (undecided) | "content" | "calls"
        self._seq = CallSequenceStream(SEPARATOR, None)
        self._content = ContentStream()

    def _step(self, delta_text: str, final: bool) -> StreamDelta:
        if self._mode is None:
            self._raw += delta_text
            head = self._raw.lstrip()
            if not final and (not head or PYTHON_TAG.startswith(head)):
                return StreamDelta()
            if head.startswith(PYTHON_TAG):
                self._mode, delta_text = "calls", head[len(PYTHON_TAG) :]
            elif head.startswith("{"):
                self._mode, delta_text = "calls", head
            else:
                self._mode, delta_text = "content", self._raw
        else:
            self._raw += delta_text
        if self._mode == "content":
            return StreamDelta(self._content.push(delta_text) or None)
        frags = self._seq.feed(delta_text, final)
        if not final:
            return StreamDelta(None, frags)
        if not self._seq.emitted_any:
            return StreamDelta(self._content.push(self._raw) or None)
        rest = self._seq.body[self._seq.pos :] if self._seq.state == "bad" else ""
        return StreamDelta(self._content.push(rest) or None, frags)
