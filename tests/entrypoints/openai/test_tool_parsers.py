"""Tool-call parsers and the constrained tool choices (`required`, named), without a model.

Streaming is checked against the non-streamed result: the text is fed one character at a
time, split in two at every boundary, and in seeded random chunkings.
"""

from __future__ import annotations

import copy
import json
import random
import re
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from pagellm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ToolCallStreamer,
    get_tool_parser,
)
from pagellm.entrypoints.openai.tool_parsers.tool_choice import (
    InvalidToolRequest,
    constrained_tool_call_streamer,
    tool_calls_from_constrained_output,
    tool_choice_json_schema,
)

# --------------------------------------------------------------------------- helpers


def chunkings(text: str, n_random: int = 20, seed: int = 0) -> list[list[str]]:
    """Char by char, every two-way split, and seeded random chunkings of `text`."""
    out = [list(text), [text]]
    out += [[text[:k], text[k:]] for k in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def run_stream(streamer: ToolCallStreamer, chunks: list[str]) -> tuple[str | None, list[dict]]:
    """Feeds `chunks`, checks OpenAI's fragment shape, returns (content, calls)."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    deltas = [streamer.feed(c) for c in chunks] + [streamer.finish()]
    for delta in deltas:
        if delta.content:
            content.append(delta.content)
        seen_in_delta = set()
        for frag in delta.tool_calls:
            index = frag["index"]
            assert index not in seen_in_delta, "one fragment per call per delta"
            seen_in_delta.add(index)
            if index == len(calls):  # a new call: the first fragment carries everything
                assert set(frag) == {"index", "id", "type", "function"}
                assert frag["type"] == "function"
                assert re.fullmatch(r"call_[0-9a-f]{24}", frag["id"])
                assert set(frag["function"]) == {"name", "arguments"}
                calls.append(dict(frag["function"]))
            else:
                assert index == len(calls) - 1, "fragments continue the latest call"
                assert frag == {
                    "index": index,
                    "function": {"arguments": frag["function"]["arguments"]},
                }
                calls[index]["arguments"] += frag["function"]["arguments"]
    return "".join(content) or None, calls


def extracted(parser_name: str, text: str) -> tuple[str | None, list[dict], bool]:
    result = get_tool_parser(parser_name)().extract_tool_calls(text)
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in result.tool_calls
    ]
    for c in result.tool_calls:
        assert c.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c.id)
    return result.content, calls, result.tools_called


def check_parser(parser_name: str, text: str, content: str | None, calls: list[tuple[str, Any]]):
    """The non-streamed result is exactly (content, calls); every chunking streams it."""
    got_content, got_calls, called = extracted(parser_name, text)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls
    assert called == bool(calls)
    for chunks in chunkings(text):
        streamed = run_stream(get_tool_parser(parser_name)().streamer(), chunks)
        assert streamed == (got_content, got_calls), chunks
    return got_calls


# --------------------------------------------------------------------------- registry


def test_registry_has_vllm_names_and_refuses_others():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("granite")


# --------------------------------------------------------------------------- hermes

WEATHER = '{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "c"}}'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just an answer, no tools.", "Just an answer, no tools.", []),
        (
            f"<tool_call>\n{WEATHER}\n</tool_call>",
            None,
            [("get_weather", {"city": "San Francisco", "unit": "c"})],
        ),
        (
            f"Let me check.\n<tool_call>{WEATHER}</tool_call>\n"
            '<tool_call>{"name": "get_time", "arguments": {"tz": "PST"}}</tool_call>',
            "Let me check.",
            [("get_weather", {"city": "San Francisco", "unit": "c"}), ("get_time", {"tz": "PST"})],
        ),
        (  # strings holding braces, quotes, escapes and non-ASCII
            '<tool_call>{"name": "echo", "arguments": {"s": "a}{\\"b\\" \\\\ ]", '
            '"t": "héllo ✓", "n": [1, {"x": null}]}}</tool_call>',
            None,
            [("echo", {"s": 'a}{"b" \\ ]', "t": "héllo ✓", "n": [1, {"x": None}]})],
        ),
        (  # a `<` that is not a marker, and a partial one that turns out not to be
            "a < b and <tool> and <tool_cal",
            "a < b and <tool> and <tool_cal",
            [],
        ),
        (  # unclosed last block whose inside is a whole call (output cut after it)
            f"<tool_call>{WEATHER}",
            None,
            [("get_weather", {"city": "San Francisco", "unit": "c"})],
        ),
        (  # output cut inside the closing marker
            f"<tool_call>{WEATHER}</tool_",
            None,
            [("get_weather", {"city": "San Francisco", "unit": "c"})],
        ),
        (  # arguments before name: not streamable early, sent whole at the block's end
            '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
            None,
            [("f", {"a": 1})],
        ),
        (  # arguments written as a JSON string, and a call without arguments
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
            '<tool_call>{"name": "g"}</tool_call>',
            None,
            [("f", {"a": 1}), ("g", {})],
        ),
        (  # text after the calls is content too
            f"Checking.\n<tool_call>{WEATHER}</tool_call>\nDone.",
            "Checking.\n\nDone.",
            [("get_weather", {"city": "San Francisco", "unit": "c"})],
        ),
    ],
)
def test_hermes(text, content, calls):
    check_parser("hermes", text, content, calls)


def test_hermes_raw_arguments_text_is_kept():
    text = '<tool_call>{"name": "f", "arguments": {"b":2,   "a" : [1,2]}}</tool_call>'
    calls = check_parser("hermes", text, None, [("f", {"b": 2, "a": [1, 2]})])
    assert calls[0]["arguments"] == '{"b":2,   "a" : [1,2]}'


@pytest.mark.parametrize(
    "text, content, n_calls",
    [
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", 0),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', 0),
        ('<tool_call>["f", 1]</tool_call>', '<tool_call>["f", 1]</tool_call>', 0),
        (
            f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{{oops</tool_call>",
            "<tool_call>{oops</tool_call>",
            1,
        ),
        ("Hi <tool_call>{bad", "Hi <tool_call>{bad", 0),
        ("<tool_call>{bad</tool_c", "<tool_call>{bad</tool_c", 0),
    ],
)
def test_hermes_malformed_blocks_are_content(text, content, n_calls):
    got_content, got_calls, called = extracted("hermes", text)
    assert (got_content, len(got_calls), called) == (content, n_calls, n_calls > 0)
    for chunks in chunkings(text):
        assert run_stream(get_tool_parser("hermes")().streamer(), chunks) == (
            got_content,
            got_calls,
        )


def test_hermes_stream_holds_back_partial_marker_only():
    s = get_tool_parser("hermes")().streamer()
    assert s.feed("Hello <tool").content == "Hello"
    assert s.feed("box> ok").content == " <toolbox> ok"
    d = s.feed(" <tool_call>")
    assert d.content is None and d.tool_calls == []
    d = s.feed('{"name": "f", "arguments": {"a"')
    assert d.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert s.feed(": 1}}</tool_").tool_calls == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert s.feed("call>").is_empty()
    assert s.finish().is_empty()


def test_hermes_call_ids_differ():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"
    calls = get_tool_parser("hermes")().extract_tool_calls(text).tool_calls
    assert len({c.id for c in calls}) == 2
    assert calls[0].to_dict() == {
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "San Francisco", "unit": "c"}'},
    }


# --------------------------------------------------------------------------- llama3_json


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            '{"name": "get_weather", "parameters": {"city": "SF"}}',
            None,
            [("get_weather", {"city": "SF"})],
        ),
        (
            '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
            None,
            [("a", {"x": 1}), ("b", {})],
        ),
        ('  {"name": "a", "parameters": {"x": "}"}};\n', None, [("a", {"x": "}"})]),
        ('{"type": "function", "name": "a", "parameters": {"k": [1]}}', None, [("a", {"k": [1]})]),
        ("The weather is sunny.", "The weather is sunny.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
        ("<|python_tag|>", "<|python_tag|>", []),
        ("{not json at all}", "{not json at all}", []),
        ("<|python_ta", "<|python_ta", []),
    ],
)
def test_llama3_json(text, content, calls):
    check_parser("llama3_json", text, content, calls)


def test_llama3_json_malformed_after_the_call_is_content_when_not_streamed():
    text = '{"name": "a", "parameters": {"x": 1}} and then some words'
    assert extracted("llama3_json", text) == (text, [], False)
    truncated = '{"name": "a", "parameters": {"x":'
    assert extracted("llama3_json", truncated) == (truncated, [], False)


# --------------------------------------------------------------------------- pythonic


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            "[get_weather(city='SF', unit=\"c\"), other(x=1)]",
            None,
            [("get_weather", {"city": "SF", "unit": "c"}), ("other", {"x": 1})],
        ),
        (
            "[f(a=[1, 2.5], b={'k': None}, c=True, d=(1, 2), e=-3)]",
            None,
            [("f", {"a": [1, 2.5], "b": {"k": None}, "c": True, "d": [1, 2], "e": -3})],
        ),
        ("[f(s='a]b)', t=\"it's [x]\")]", None, [("f", {"s": "a]b)", "t": "it's [x]"})]),
        ("[noargs()]\nDone.", "Done.", [("noargs", {})]),
        ("Hello there", "Hello there", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("[]", "[]", []),
        ("[f(1)]", "[f(1)]", []),
        ("[f(x=y)]", "[f(x=y)]", []),
        ("[f(**kw)]", "[f(**kw)]", []),
        ("[f(x={1, 2})]", "[f(x={1, 2})]", []),
        ("[obj.method(x=1)]", "[obj.method(x=1)]", []),
        ("[f(x=1)", "[f(x=1)", []),
        ("[f(x=1)] [", "[", [("f", {"x": 1})]),
    ],
)
def test_pythonic(text, content, calls):
    check_parser("pythonic", text, content, calls)


# --------------------------------------------------------------------------- mistral


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "SF"}}]', None,
         [("get_weather", {"city": "SF"})]),
        ('Checking.[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, "]"]}}]',
         "Checking.", [("a", {}), ("b", {"x": [1, "]"]})]),
        ('[TOOL_CALLS][{"name": "a", "arguments": {}}] Done.', "Done.", [("a", {})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "SF"}', None, [("get_weather", {"city": "SF"})]),
        ('[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x": "[ARGS]"}', None, [("a", {}), ("b", {"x": "[ARGS]"})]),
        ("Hello there", "Hello there", []),
        ("Use [TOOL", "Use [TOOL", []),
        ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
        ('[TOOL_CALLS]get_weather{"city": "SF"}', '[TOOL_CALLS]get_weather{"city": "SF"}', []),
        ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ],
)  # fmt: skip
def test_mistral(text, content, calls):
    check_parser("mistral", text, content, calls)


# --------------------------------------------------------------------------- tool_choice

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
ORDER_TOOL = {
    "type": "function",
    "function": {
        "name": "place_order",
        "parameters": {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {"$ref": "#/$defs/item"},
                },
                "express": {"type": "boolean"},
                "note": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
                "price": {"type": "number", "minimum": 0, "maximum": 100},
            },
            "required": ["items", "express"],
            "$defs": {
                "item": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "enum": ["A1", "B2", 'C"3']},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                }
            },
        },
    },
}
NOARGS_TOOL = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER_TOOL, ORDER_TOOL, NOARGS_TOOL]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_named_choice_schema_is_the_parameters_schema():
    schema = tool_choice_json_schema(TOOLS, named("place_order"), True)
    assert schema == ORDER_TOOL["function"]["parameters"]
    assert schema is not ORDER_TOOL["function"]["parameters"]
    assert tool_choice_json_schema(TOOLS, named("now"), True) == {
        "type": "object",
        "properties": {},
    }


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_unconstrained_choices_have_no_schema(choice):
    assert tool_choice_json_schema(TOOLS, choice, True) is None


def test_required_schema_shape():
    tools = [WEATHER_TOOL, NOARGS_TOOL]
    assert tool_choice_json_schema(tools, "required", True) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER_TOOL["function"]["parameters"],
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": ["now"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                },
            ]
        },
    }
    assert tool_choice_json_schema(tools, "required", False)["maxItems"] == 1


def test_required_schema_hoists_defs_without_touching_the_request():
    before = copy.deepcopy(ORDER_TOOL)
    schema = tool_choice_json_schema(TOOLS, "required", True)
    assert ORDER_TOOL == before
    assert schema["$defs"] == {"item": ORDER_TOOL["function"]["parameters"]["$defs"]["item"]}
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    Draft202012Validator.check_schema(schema)
    other = copy.deepcopy(ORDER_TOOL)
    other["function"]["name"] = "other"
    other["function"]["parameters"]["$defs"]["item"] = {"type": "string"}
    with pytest.raises(InvalidToolRequest, match=r"^tools\[1\]\.function\.parameters: ") as e:
        tool_choice_json_schema([ORDER_TOOL, other], "required", True)
    assert e.value.param == "tools[1].function.parameters"


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([WEATHER_TOOL, {"type": "function", "function": {"name": "x", "parameters": "{}"}}],
         "auto", "tools[1].function.parameters"),
        ([WEATHER_TOOL, {"type": "function", "function": {"name": "x", "parameters": {"type": "objekt"}}}],
         "auto", "tools[1].function.parameters"),
        ([{"type": "function", "function": {"name": "x", "parameters": {"properties": {"a": {"minimum": "0"}}}}}],
         "auto", "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "x", "parameters": {"required": "a"}}}],
         "auto", "tools[0].function.parameters"),
        ([{"type": "retrieval"}], "auto", "tools[0].type"),
        ([{"type": "function"}], "auto", "tools[0].function"),
        ([{"type": "function", "function": {"name": ""}}], "auto", "tools[0].function.name"),
        ([NOARGS_TOOL, NOARGS_TOOL], "auto", "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "x", "description": 3}}], "auto",
         "tools[0].function.description"),
        (TOOLS, named("delete_everything"), "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function"}, "tool_choice"),
        ([], "required", "tool_choice"),
        (None, named("get_weather"), "tool_choice"),
        ({"type": "function"}, "auto", "tools"),
    ],
)  # fmt: skip
def test_bad_tools_and_choices_name_the_field(tools, choice, param):
    with pytest.raises(InvalidToolRequest) as e:
        tool_choice_json_schema(tools, choice, True)
    assert e.value.param == param
    assert str(e.value).startswith(f"{param}: ")
    assert isinstance(e.value, ValueError)


def test_tools_given_as_pydantic_models():
    pydantic = pytest.importorskip("pydantic")

    class Function(pydantic.BaseModel):
        name: str
        description: str | None = None
        parameters: dict[str, Any] | None = None

    class Tool(pydantic.BaseModel):
        type: str = "function"
        function: Function

    tools = [Tool(function=Function(name="now")), Tool(**WEATHER_TOOL)]
    assert (
        tool_choice_json_schema(tools, named("get_weather"), True)
        == WEATHER_TOOL["function"]["parameters"]
    )


# An instance generator for the schemas above: every instance must validate.


def instance(schema: dict, rng: random.Random, root: dict) -> Any:
    if "$ref" in schema:
        return instance(root["$defs"][schema["$ref"].split("/")[-1]], rng, root)
    if "anyOf" in schema:
        return instance(rng.choice(schema["anyOf"]), rng, root)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type", "object")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return {
            k: instance(v, rng, root)
            for k, v in props.items()
            if k in required or rng.random() < 0.5
        }
    if kind == "array":
        n = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 4))
        return [instance(schema["items"], rng, root) for _ in range(n)]
    if kind == "string":
        n = rng.randint(schema.get("minLength", 0), schema.get("maxLength", 12))
        return "".join(rng.choice('ab"\\}]{ é✓\n') for _ in range(n))
    if kind == "integer":
        return rng.randint(schema.get("minimum", -50), schema.get("maximum", 50))
    if kind == "number":
        return rng.uniform(schema.get("minimum", -1e3), schema.get("maximum", 1e3))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    raise AssertionError(schema)


def dumps(value: Any, rng: random.Random) -> str:
    """JSON with the formatting a grammar allows: compact, spaced or indented."""
    return json.dumps(value, **rng.choice([{}, {"separators": (",", ":")}, {"indent": 2}]),
                      ensure_ascii=rng.random() < 0.5)  # fmt: skip


def stream_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("seed", range(40))
def test_required_output_round_trips_to_tool_calls(seed):
    rng = random.Random(seed)
    parallel = seed % 2 == 0
    schema = tool_choice_json_schema(TOOLS, "required", parallel)
    picked = [rng.choice(TOOLS)["function"] for _ in range(rng.randint(1, 3) if parallel else 1)]
    root = ORDER_TOOL["function"]["parameters"]
    wanted = [(f["name"], instance(f.get("parameters", {}), rng, root)) for f in picked]
    body = ", ".join(
        f'{{"name": {json.dumps(n)}, "parameters": {dumps(args, rng)}}}' for n, args in wanted
    )
    text = rng.choice(["", " ", "\n"]) + f"[{body}]" + rng.choice(["", "\n"])
    Draft202012Validator(schema).validate(json.loads(text))

    calls = tool_calls_from_constrained_output(text, TOOLS, "required")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == wanted
    for chunks in [list(text), stream_chunks(text, rng), stream_chunks(text, rng)]:
        streamed = run_stream(constrained_tool_call_streamer(TOOLS, "required"), chunks)
        assert streamed == (
            None,
            [{"name": c.function.name, "arguments": c.function.arguments} for c in calls],
        )


def test_required_schema_rejects_what_it_must():
    schema = tool_choice_json_schema(TOOLS, "required", False)
    validator = Draft202012Validator(schema)
    ok = {"name": "get_weather", "parameters": {"city": "Paris"}}
    assert validator.is_valid([ok])
    assert not validator.is_valid([])
    assert not validator.is_valid([ok, ok])  # parallel_tool_calls=False
    assert not validator.is_valid([{"name": "rm", "parameters": {}}])
    assert not validator.is_valid([{"name": "get_weather", "parameters": {"city": ""}}])
    assert not validator.is_valid(
        [{"name": "get_weather", "parameters": {"city": "x"}, "extra": 1}]
    )
    assert not validator.is_valid(
        [{"name": "place_order", "parameters": {"items": [{"sku": "Z"}]}}]
    )


@pytest.mark.parametrize("seed", range(20))
def test_named_output_round_trips_to_one_tool_call(seed):
    rng = random.Random(seed)
    fn = rng.choice([WEATHER_TOOL, ORDER_TOOL])["function"]
    schema = tool_choice_json_schema(TOOLS, named(fn["name"]), True)
    args = instance(schema, rng, schema)
    text = rng.choice(["", "\n "]) + dumps(args, rng) + rng.choice(["", " \n"])
    Draft202012Validator(schema).validate(json.loads(text))

    (call,) = tool_calls_from_constrained_output(text, TOOLS, named(fn["name"]))
    assert (call.function.name, call.function.arguments) == (fn["name"], text.strip())
    for chunks in [list(text), stream_chunks(text, rng)]:
        streamed = run_stream(constrained_tool_call_streamer(TOOLS, named(fn["name"])), chunks)
        assert streamed == (None, [{"name": fn["name"], "arguments": text.strip()}])


@pytest.mark.parametrize(
    "text, choice",
    [
        ('{"city": "Par', named("get_weather")),  # cut by max_tokens
        ('[{"name": "get_weather", "parameters": {"city": "x"}}', "required"),
        ('[{"name": "nope", "parameters": {}}]', "required"),
        ('{"name": "now", "parameters": {}}', "required"),
    ],
)
def test_incomplete_constrained_output_raises(text, choice):
    with pytest.raises(ValueError, match="constrained tool call output"):
        tool_calls_from_constrained_output(text, TOOLS, choice)


def test_unconstrained_choice_has_no_streamer():
    with pytest.raises(ValueError, match="does not constrain"):
        constrained_tool_call_streamer(TOOLS, "auto")
