"""Mistral tool calls after the `[TOOL_CALLS]` marker, in either of Mistral's formats:

* a JSON list of call objects, `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`
  (Mistral 7B v0.3, Mixtral 8x22B, Nemo: tokenizers before v11);
* `[TOOL_CALLS]name[ARGS]{...}`, once per call (Mistral Small 3.1+, Devstral: v11+).

Text before the marker (and after a closed list) is content; a marker whose calls do not
parse stays content.
"""

from __future__ import annotations

import json

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    FunctionCall,
    SteppedToolCallStreamer,
    StreamDelta,
    ToolCall,
    ToolParser,
    first_fragment,
)
from pagellm.entrypoints.openai.tool_parsers.json_calls import (
    CallSequenceStream,
    parse_call_sequence,
)
from pagellm.streaming_text import ContentStream, partial_marker_suffix

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_DECODER = json.JSONDecoder()


def parse_named_calls(body: str) -> list[tuple[str, str]] | None:
    """(name, arguments) of `name[ARGS]{...}` calls separated by `[TOOL_CALLS]`, or None."""
    calls = []
    for chunk in body.split(TOOL_CALLS):
        name, sep, rest = chunk.partition(ARGS)
        name, rest = name.strip(), rest.strip()
        if not sep or not name or not rest.startswith("{"):
            return None
        try:
            value, end = _DECODER.raw_decode(rest)
        except ValueError:
            return None
        if not isinstance(value, dict) or rest[end:].strip():
            return None
        calls.append((name, rest[:end]))
    return calls


def parse_calls(body: str) -> tuple[list[tuple[str, str]], str] | None:
    """The calls after the marker, in whichever format they are written, and the text
    after them (after a JSON list's `]`; none after named calls), or None."""
    head = body.lstrip()
    if head.startswith("["):
        try:
            value, end = _DECODER.raw_decode(head)
        except ValueError:
            return None
        calls = parse_call_sequence(head[1:end], ",", "]") if isinstance(value, list) else None
        return (calls, head[end:]) if calls else None
    named = parse_named_calls(body)
    return (named, "") if named else None


class MistralToolParser(ToolParser):
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        at = model_output.find(TOOL_CALLS)
        parsed = parse_calls(model_output[at + len(TOOL_CALLS) :]) if at >= 0 else None
        if parsed is None:
            return ExtractedToolCalls(False, [], model_output.strip() or None)
        calls, rest = parsed
        tool_calls = [ToolCall(FunctionCall(n, a)) for n, a in calls]
        return ExtractedToolCalls(True, tool_calls, (model_output[:at] + rest).strip() or None)

    def streamer(self) -> MistralToolCallStreamer:
        return MistralToolCallStreamer()


class MistralToolCallStreamer(SteppedToolCallStreamer):
    """Content streams until `[TOOL_CALLS]` (a tail that could begin it is held back).
    After it, a JSON list streams call by call as its objects do; the `name[ARGS]{...}`
    format is read once the output ends and its calls go out whole. Calls that do not
    parse go out as content, marker included."""

    def __init__(self) -> None:
        self._mode = "content"  # content | undecided (after the marker) | list | named
        self._buf = ""  # content: the held-back tail; after the marker: all that came since
        self._seq = CallSequenceStream(",", "]")
        self._rest = 0  # where the list's unsent trailing text starts in self._seq.body
        self._content = ContentStream()

    def _step(self, delta_text: str, final: bool) -> StreamDelta:
        text = ""
        if self._mode == "content":
            self._buf += delta_text
            at = self._buf.find(TOOL_CALLS)
            if at < 0:
                keep = 0 if final else partial_marker_suffix(self._buf, TOOL_CALLS)
                text = self._content.push(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return StreamDelta(text or None)
            text = self._content.push(self._buf[:at])
            self._buf, delta_text, self._mode = "", self._buf[at + len(TOOL_CALLS) :], "undecided"
        self._buf += delta_text
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if not head and not final:
                return StreamDelta(text or None)
            self._mode = "list" if head.startswith("[") else "named"
            if self._mode == "list":
                delta_text = head[1:]
        if self._mode == "named":
            return self._named(text, final)
        frags = self._seq.feed(delta_text, final)
        if final and not self._seq.emitted_any:
            return StreamDelta(text + self._content.push(TOOL_CALLS + self._buf) or None)
        # after the closing `]` the text is content as it comes; after a misfit, at the end
        if self._seq.state == "done" or (final and self._seq.state == "bad"):
            start = max(self._rest, self._seq.pos)
            text += self._content.push(self._seq.body[start:])
            self._rest = len(self._seq.body)
        return StreamDelta(text or None, frags)

    def _named(self, text: str, final: bool) -> StreamDelta:
        if not final:
            return StreamDelta(text or None)
        calls = parse_named_calls(self._buf)
        if calls is None:
            return StreamDelta(text + self._content.push(TOOL_CALLS + self._buf) or None)
        return StreamDelta(text or None, [first_fragment(i, n, a) for i, (n, a) in enumerate(calls)])
