"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Several calls may follow each other; text outside them is content. A block whose inside is
not a call object (bad JSON, no name) stays in the content verbatim.
"""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    FunctionCall,
    StreamDelta,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    coalesce_fragments,
)
from pagellm.entrypoints.openai.tool_parsers.json_calls import JsonCallStream, parse_call_object
from pagellm.streaming_text import ContentStream, partial_marker_suffix

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while True:
            start = model_output.find(TOOL_CALL_START, pos)
            if start < 0:
                content.append(model_output[pos:])
                break
            content.append(model_output[pos:start])
            body_start = start + len(TOOL_CALL_START)
            end = model_output.find(TOOL_CALL_END, body_start)
            # An unclosed last block still counts if its inside is a whole call (a cut-off
            # `</tool_` at the very end is not part of the inside).
            cut = partial_marker_suffix(model_output, TOOL_CALL_END)
            body_end = len(model_output) - cut if end < 0 else end
            after = len(model_output) if end < 0 else end + len(TOOL_CALL_END)
            parsed = parse_call_object(model_output[body_start:body_end])
            if parsed is None:
                content.append(model_output[start:after])
            else:
                calls.append(ToolCall(FunctionCall(*parsed)))
            pos = after
        text = "".join(content).strip()
        return ExtractedToolCalls(bool(calls), calls, text or None)

    def streamer(self) -> HermesToolCallStreamer:
        return HermesToolCallStreamer()


class HermesToolCallStreamer(ToolCallStreamer):
    """Outside a block, holds back a tail that could begin `<tool_call>`; inside one, keeps
    the block's text from its start in `_buf` until `</tool_call>` (or the end) closes it."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._call = JsonCallStream(0)
        self._n_calls = 0
        self._content = ContentStream()

    def feed(self, delta_text: str) -> StreamDelta:
        self._buf += delta_text
        return self._drain(final=False)

    def finish(self) -> StreamDelta:
        return self._drain(final=True)

    def _drain(self, final: bool) -> StreamDelta:
        out = StreamDelta()
        text: list[str] = []
        while True:
            if not self._in_call:
                start = self._buf.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if final else partial_marker_suffix(self._buf, TOOL_CALL_START)
                    text.append(self._content.push(self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                text.append(self._content.push(self._buf[:start]))
                self._buf = self._buf[start + len(TOOL_CALL_START) :]
                self._in_call, self._call = True, JsonCallStream(self._n_calls)
                continue
            end = self._buf.find(TOOL_CALL_END)
            if end < 0 and not final:
                keep = partial_marker_suffix(self._buf, TOOL_CALL_END)
                out.tool_calls += self._call.update(self._buf[: len(self._buf) - keep])
                break
            cut = partial_marker_suffix(self._buf, TOOL_CALL_END) if end < 0 else 0
            region = self._buf[: len(self._buf) - cut] if end < 0 else self._buf[:end]
            frags = self._call.close(region)
            if frags is None:
                closing = self._buf[len(region) :] if end < 0 else TOOL_CALL_END
                text.append(self._content.push(TOOL_CALL_START + region + closing))
            else:
                out.tool_calls += frags
                self._n_calls += 1
            self._buf = "" if end < 0 else self._buf[end + len(TOOL_CALL_END) :]
            self._in_call = False
        out.content = "".join(text) or None
        out.tool_calls = coalesce_fragments(out.tool_calls)
        return out
