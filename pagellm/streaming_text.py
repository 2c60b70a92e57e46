"""Holding back streamed text that a parser cannot place yet.

Used by the tool-call and reasoning streamers: partial markers at a delta's end, and
whitespace that the non-streamed result would strip. Knows nothing of any markup.
"""

from __future__ import annotations


class ContentStream:
    """Streams text so that the pieces concatenate to `text.strip()` of the whole.

    Leading whitespace is dropped until the first other character; trailing whitespace is
    held back until more non-whitespace text follows, and dropped at the end.
    """

    def __init__(self) -> None:
        self._started = False
        self._held_ws = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._held_ws += text
            return ""
        out = self._held_ws + body
        self._held_ws = text[len(body) :]
        return out


def partial_marker_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
