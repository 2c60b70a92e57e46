"""Reading `{"name": ..., "arguments": {...}}` call objects, whole or as they stream in.

Shared by the hermes and llama3_json parsers and by the constrained `required` tool choice.
A call's `arguments` string is the raw text of the arguments object as the model wrote it
(not re-serialized), so the streamed fragments can concatenate to exactly that string.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    arguments_fragment,
    coalesce_fragments,
    first_fragment,
)

# `{"name": "<n>", "arguments": ` up to the `{` that opens the arguments object. Once this
# prefix is in, a streamer commits to the call and streams the arguments as they come.
CALL_HEADER_RE = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*(?=\{)'
)
ARGUMENT_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder()


class JsonValueScanner:
    """Finds where one JSON object or array ends, fed its text piece by piece.

    Tracks only strings (with escapes) and bracket depth; it does not validate the rest.
    The first non-blank character must be `{` or `[` (callers check). `quotes` may add
    `'` for Python literals.
    """

    def __init__(self, quotes: str = '"') -> None:
        self._quotes = quotes
        self._depth = 0  # open brackets; 0 before the value starts
        self._quote: str | None = None  # the open string's quote character
        self._escape = False

    def feed(self, chunk: str) -> int | None:
        """Returns the offset in `chunk` just past the value's end, or None if not ended."""
        for i, ch in enumerate(chunk):
            if self._quote is not None:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == self._quote:
                    self._quote = None
            elif ch in self._quotes:
                self._quote = ch
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


def parse_call_object(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one call object, or None if it is not one.

    The arguments text is the raw slice when the object opens with the call header;
    otherwise (other key order, arguments given as a string) it is rebuilt from the value.
    """
    s = text.strip()
    try:
        obj = json.loads(s)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    m = CALL_HEADER_RE.match(s)
    if m is not None and json.loads(f'"{m.group(1)}"') == obj["name"]:
        _, end = _DECODER.raw_decode(s, m.end())
        return obj["name"], s[m.end() : end]
    key = next((k for k in ARGUMENT_KEYS if k in obj), None)
    value: Any = obj.get(key) if key else None
    if value is None:
        return obj["name"], "{}"
    if isinstance(value, str):  # arguments written as a JSON string: unwrap it
        return obj["name"], value
    return obj["name"], json.dumps(value, ensure_ascii=False)


class JsonCallStream:
    """Streams one call object whose text grows between `update` calls.

    Before the call header is complete nothing is emitted. Once it is, the first fragment
    (id, name, empty arguments) goes out and the arguments object streams as written, with
    trailing whitespace held back so that every emitted piece is part of the final slice.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.committed = False
        self._args_start = 0  # offset of the arguments' `{` in the region
        self._args_end: int | None = None
        self._scanner = JsonValueScanner()
        self._scanned = 0  # region chars (from _args_start) already fed to the scanner
        self._emitted = 0  # arguments chars already sent

    def update(self, region: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.committed:
            m = CALL_HEADER_RE.match(region)
            if m is None:
                return out
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return out
            self.committed, self._args_start = True, m.end()
            out.append(first_fragment(self.index, name))
        if self._args_end is None:
            base = self._args_start + self._scanned
            end = self._scanner.feed(region[base:])
            self._scanned = len(region) - self._args_start
            if end is not None:
                self._args_end = base + end
        limit = self._args_end if self._args_end is not None else len(region.rstrip())
        piece = region[self._args_start + self._emitted : limit]
        if piece:
            out.append(arguments_fragment(self.index, piece))
            self._emitted += len(piece)
        return out

    def close(self, region: str) -> list[dict[str, Any]] | None:
        """The region is final. Returns the last fragments, or None when the call never
        committed and is not a call (the caller then treats its text as content)."""
        parsed = parse_call_object(region)
        if not self.committed:
            if parsed is None:
                return None
            self.committed = True
            return [first_fragment(self.index, parsed[0], parsed[1])]
        out = self.update(region)
        sent = self._emitted
        if parsed is not None and len(parsed[1]) > sent:
            out.append(arguments_fragment(self.index, parsed[1][sent:]))
        return out


def parse_call_sequence(body: str, sep: str, closer: str | None) -> list[tuple[str, str]] | None:
    """Calls in `obj sep obj sep ...` (then `closer`, if given, and nothing else).

    A trailing separator is allowed when there is no closer. None if anything does not fit.
    """
    calls: list[tuple[str, str]] = []
    pos, n = 0, len(body)

    def skip_ws(p: int) -> int:
        while p < n and body[p].isspace():
            p += 1
        return p

    while True:
        pos = skip_ws(pos)
        if pos == n:
            return calls if (closer is None and calls) else None
        if closer is not None and body[pos] == closer and not calls:
            return None
        try:
            _, end = _DECODER.raw_decode(body, pos)
        except ValueError:
            return None
        parsed = parse_call_object(body[pos:end])
        if parsed is None:
            return None
        calls.append(parsed)
        pos = skip_ws(end)
        if pos == n:
            return calls if closer is None else None
        if closer is not None and body[pos] == closer:
            return calls if skip_ws(pos + 1) == n else None
        if body[pos] != sep:
            return None
        pos += 1


class CallSequenceStream:
    """Streams the calls of `obj sep obj ...` (then `closer`, if given) as text arrives.

    `state` ends as "done" (closer seen), "bad" (text that does not fit, from `pos` on)
    or stays mid-sequence. A call is never retracted: once its fragments are out, a later
    misfit only stops the sequence.
    """

    def __init__(self, sep: str, closer: str | None) -> None:
        self.sep, self.closer = sep, closer
        self.body = ""
        self.pos = 0  # first char not yet consumed by the sequence
        self.state = "object"  # object | in_object | separator | done | bad
        self.n_calls = 0
        self.emitted_any = False
        self._call = JsonCallStream(0)
        self._obj_start = 0
        self._scanner = JsonValueScanner()
        self._scanned = 0

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        self.body += text
        out = coalesce_fragments(self._drain(final))
        self.emitted_any = self.emitted_any or bool(out)
        return out

    def _skip_ws(self) -> None:
        while self.pos < len(self.body) and self.body[self.pos].isspace():
            self.pos += 1

    def _drain(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while self.state not in ("done", "bad"):
            if self.state == "object":
                self._skip_ws()
                if self.pos == len(self.body):
                    break
                if self.body[self.pos] != "{":
                    self.state = "bad"
                    break
                self._obj_start = self._scanned = self.pos
                self._scanner = JsonValueScanner()
                self._call = JsonCallStream(self.n_calls)
                self.state = "in_object"
            if self.state == "in_object":
                end = self._scanner.feed(self.body[self._scanned :])
                if end is None and not final:
                    self._scanned = len(self.body)
                    out += self._call.update(self.body[self._obj_start :])
                    break
                obj_end = len(self.body) if end is None else self._scanned + end
                frags = self._call.close(self.body[self._obj_start : obj_end])
                if frags is None:
                    self.pos, self.state = self._obj_start, "bad"
                    break
                out += frags
                self.n_calls += 1
                self.pos, self.state = obj_end, "separator"
            if self.state == "separator":
                self._skip_ws()
                if self.pos == len(self.body):
                    break
                c = self.body[self.pos]
                self.pos += 1
                if c == self.sep:
                    self.state = "object"
                elif self.closer is not None and c == self.closer:
                    self.state = "done"
                else:
                    self.pos -= 1
                    self.state = "bad"
        return out
