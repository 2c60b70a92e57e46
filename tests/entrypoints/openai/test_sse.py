"""Server-sent events survive readers that split lines like `str.splitlines`.

JSON leaves U+0085, U+2028 and U+2029 raw inside strings, and `str.splitlines` (httpx's
`aiter_lines`) ends a line at each of them; a model that emits one would cut its event
in two for such a reader. The server writes their JSON escapes instead."""

from __future__ import annotations

import json

import httpx
from pydantic import BaseModel

from pagellm.entrypoints.openai.serving_engine import sse, sse_data

TEXT = "a\u2028b\x85c\u2029d é ✓"


class _Chunk(BaseModel):
    text: str


def test_an_sse_event_is_one_line_to_splitlines_readers() -> None:
    assert "\u2028" in _Chunk(text=TEXT).model_dump_json()   # pydantic leaves it raw
    event = sse(_Chunk(text=TEXT))
    lines = httpx._decoders.LineDecoder().decode(event)
    assert lines == [lines[0], ""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == {"text": TEXT}
    assert "\\u2028" in lines[0] and "\\u0085" in lines[0] and "\\u2029" in lines[0]


def test_sse_data_leaves_other_text_as_it_is() -> None:
    body = json.dumps({"text": "é ✓ \\n"}, ensure_ascii=False)
    assert sse_data(body) == body
    assert json.loads(sse_data(json.dumps({"t": TEXT}, ensure_ascii=False))) == {"t": TEXT}
