"""Pythonic tool calls (Llama 3.2/4 style): `[get_weather(city='SF'), other(x=1)]`.

The list is read with Python's `ast`; only keyword arguments with literal values count.
Output that does not start with such a list is content; text after the list is content.
"""

from __future__ import annotations

import ast
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
from pagellm.entrypoints.openai.tool_parsers.json_calls import JsonValueScanner
from pagellm.streaming_text import ContentStream


def parse_call_list(source: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) per call of a Python list of calls, or None if not one."""
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for elt in tree.body.elts:
        if not isinstance(elt, ast.Call) or not isinstance(elt.func, ast.Name) or elt.args:
            return None
        kwargs = {}
        for kw in elt.keywords:
            if kw.arg is None:  # **spread
                return None
            try:
                kwargs[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
        try:
            arguments = json.dumps(kwargs, ensure_ascii=False)
        except (TypeError, ValueError):  # sets, bytes, complex: not JSON
            return None
        calls.append((elt.func.id, arguments))
    return calls


class PythonicToolParser(ToolParser):
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        text = model_output.strip()
        if text.startswith("["):
            end = JsonValueScanner(quotes="\"'").feed(text)
            calls = parse_call_list(text[:end]) if end is not None else None
            if calls is not None:
                tool_calls = [ToolCall(FunctionCall(n, a)) for n, a in calls]
                return ExtractedToolCalls(True, tool_calls, text[end:].strip() or None)
        return ExtractedToolCalls(False, [], text or None)

    def streamer(self) -> PythonicToolCallStreamer:
        return PythonicToolCallStreamer()


class PythonicToolCallStreamer(SteppedToolCallStreamer):
    """A leading `[` holds everything back until the list closes; the calls then go out
    whole, one fragment each (a list is only known to be calls once it parses), and the
    rest streams as content. Any other start streams as content from the first character."""

    def __init__(self) -> None:
        self._buf = ""
        self._mode: str | None = None  # None (undecided) | "list" | "content"
        self._scanner = JsonValueScanner(quotes="\"'")
        self._content = ContentStream()

    def _step(self, delta_text: str, final: bool) -> StreamDelta:
        if self._mode == "content":
            return StreamDelta(self._content.push(delta_text) or None)
        scanned = len(self._buf)
        self._buf += delta_text
        if self._mode is None:
            head = self._buf.lstrip()
            if not head:
                return StreamDelta()
            self._mode = "list" if head.startswith("[") else "content"
            if self._mode == "content":
                return StreamDelta(self._content.push(self._buf) or None)
            scanned = len(self._buf) - len(head)
        end = self._scanner.feed(self._buf[scanned:])
        if end is None and not final:
            return StreamDelta()
        self._mode = "content"
        list_end = len(self._buf) if end is None else scanned + end
        calls = parse_call_list(self._buf[:list_end].strip())
        if calls is None:
            return StreamDelta(self._content.push(self._buf) or None)
        frags = [first_fragment(i, name, args) for i, (name, args) in enumerate(calls)]
        return StreamDelta(self._content.push(self._buf[list_end:]) or None, frags)
