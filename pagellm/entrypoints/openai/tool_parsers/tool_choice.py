"""Request-side tool handling: validating `tools`/`tool_choice` and the constrained modes.

For `tool_choice` = a named function or `required`, the output is constrained by a JSON
schema (as vLLM builds it) and read back into tool calls here, whole or streamed:

* named function: the schema is the function's `parameters` schema itself; the output is
  the arguments object, wrapped by the server into one call.
* `required`: a JSON array (minItems 1; maxItems 1 without parallel tool calls) whose items
  are `{"name": <one tool's name>, "parameters": <that tool's parameters>}`, an `anyOf`
  over the tools. Each tool's `$defs` move to the array schema's root, where `#/$defs/...`
  references resolve.

The returned `arguments` is the raw text the model wrote for the arguments object (valid by
the grammar), so streamed fragments concatenate to exactly the non-streamed string.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from pagellm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    FunctionCall,
    StreamDelta,
    ToolCall,
    ToolCallStreamer,
    arguments_fragment,
    first_fragment,
)
from pagellm.entrypoints.openai.tool_parsers.json_calls import (
    CallSequenceStream,
    parse_call_sequence,
)
from pagellm.streaming_text import ContentStream
from pagellm.structured_output import check_json_schema

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class InvalidToolRequest(ValueError):
    """A bad `tools` / `tool_choice`; `param` is the field's path (OpenAI's error `param`)."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param


def _plain(value: Any) -> Any:
    """A pydantic model (the server's protocol types) as a plain dict; others unchanged."""
    return value.model_dump(by_alias=True) if hasattr(value, "model_dump") else value


def validate_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The tools' function specs `{"name", "description"?, "parameters"?}`, checked.

    Raises InvalidToolRequest naming the field, e.g. `tools[1].function.parameters`.
    """
    specs: list[dict[str, Any]] = []
    seen: set[str] = set()
    tools = _plain(tools) or []
    if not isinstance(tools, list):
        raise InvalidToolRequest("tools", "must be a list")
    for i, tool in enumerate(tools):
        tool = _plain(tool)
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidToolRequest(where, "must be an object")
        if tool.get("type", "function") != "function":
            raise InvalidToolRequest(f"{where}.type", "only 'function' tools are supported")
        fn = _plain(tool.get("function"))
        if not isinstance(fn, dict):
            raise InvalidToolRequest(f"{where}.function", "must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidToolRequest(f"{where}.function.name", "must be a non-empty string")
        if name in seen:
            raise InvalidToolRequest(f"{where}.function.name", f"duplicate tool name {name!r}")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidToolRequest(f"{where}.function.description", "must be a string")
        spec: dict[str, Any] = {"name": name}
        if description is not None:
            spec["description"] = description
        if fn.get("parameters") is not None:
            spec["parameters"] = _checked_schema(fn["parameters"], f"{where}.function.parameters")
        specs.append(spec)
    return specs


def _checked_schema(schema: Any, where: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise InvalidToolRequest(where, "must be a JSON schema object")
    try:
        check_json_schema(schema)
    except ValueError as e:
        raise InvalidToolRequest(where, str(e)) from None
    return schema


def validate_tool_choice(tool_choice: Any, specs: list[dict[str, Any]]) -> str | dict[str, Any]:
    """The choice in one of its canonical forms: "none", "auto", "required" or
    `{"type": "function", "function": {"name": ...}}` naming one of the tools.

    None means OpenAI's default: "auto" with tools, "none" without.
    """
    choice = _plain(tool_choice)
    if choice is None:
        return "auto" if specs else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidToolRequest(
                "tool_choice", f"{choice!r} is not one of 'none', 'auto', 'required'"
            )
        if choice == "required" and not specs:
            raise InvalidToolRequest("tool_choice", "'required' needs `tools`")
        return choice
    fn = _plain(choice.get("function")) if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type", "function") != "function"
        or not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
    ):
        raise InvalidToolRequest(
            "tool_choice", 'must be a string or {"type": "function", "function": {"name": ...}}'
        )
    if fn["name"] not in {s["name"] for s in specs}:
        raise InvalidToolRequest("tool_choice", f"names tool {fn['name']!r}, not in `tools`")
    return {"type": "function", "function": {"name": fn["name"]}}


def _named(choice: str | dict[str, Any]) -> str | None:
    return choice["function"]["name"] if isinstance(choice, dict) else None


def tool_choice_json_schema(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None = True
) -> dict[str, Any] | None:
    """The JSON schema constraining the output, or None when the choice is not constrained
    ("none", "auto"). Validates tools and tool_choice first (InvalidToolRequest)."""
    specs = validate_tools(tools)
    choice = validate_tool_choice(tool_choice, specs)
    name = _named(choice)
    if name is not None:
        spec = next(s for s in specs if s["name"] == name)
        return copy.deepcopy(spec.get("parameters") or EMPTY_PARAMETERS)
    if choice != "required":
        return None
    items, defs = call_object_schemas(specs, "parameters")
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def call_object_schemas(
    specs: list[dict[str, Any]], arguments_key: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One schema per tool of a call object `{"name": <the tool's name>, <arguments_key>:
    <its parameters>}`, and the tools' `$defs` / `definitions`, merged, for the root of the
    schema that holds the call objects (where `#/$defs/...` references resolve)."""
    items: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for i, spec in enumerate(specs):
        params = copy.deepcopy(spec.get("parameters") or EMPTY_PARAMETERS)
        for key in ("$defs", "definitions"):
            for def_name, def_schema in params.pop(key, {}).items():
                if defs.setdefault(key, {}).setdefault(def_name, def_schema) != def_schema:
                    raise InvalidToolRequest(
                        f"tools[{i}].function.parameters",
                        f"{key}/{def_name} differs from another tool's; not supported",
                    )
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [spec["name"]]},
                    arguments_key: params,
                },
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    return items, defs


def tool_calls_from_constrained_output(
    text: str, tools: list[Any] | None, tool_choice: Any
) -> list[ToolCall]:
    """The tool calls in an output generated under `tool_choice_json_schema`.

    Raises ValueError when the text is not a complete instance (e.g. cut by max_tokens).
    """
    specs = validate_tools(tools)
    choice = validate_tool_choice(tool_choice, specs)
    s = text.strip()
    try:
        value = json.loads(s)
    except ValueError as e:
        raise ValueError(f"constrained tool call output is not complete JSON: {e}") from None
    name = _named(choice)
    if name is not None:
        return [ToolCall(FunctionCall(name, s))]
    if choice != "required":
        raise ValueError(f"tool_choice {choice!r} does not constrain the output")
    names = {spec["name"] for spec in specs}
    calls = parse_call_sequence(s[1:], ",", "]") if isinstance(value, list) else None
    if not calls or any(n not in names for n, _ in calls):
        raise ValueError("constrained tool call output is not a list of calls to the tools")
    return [ToolCall(FunctionCall(n, a)) for n, a in calls]


def constrained_tool_call_streamer(tools: list[Any] | None, tool_choice: Any) -> ToolCallStreamer:
    """A streamer for an output generated under `tool_choice_json_schema` (no content)."""
    specs = validate_tools(tools)
    choice = validate_tool_choice(tool_choice, specs)
    name = _named(choice)
    if name is not None:
        return NamedToolCallStreamer(name)
    if choice == "required":
        return RequiredToolCallStreamer()
    raise ValueError(f"tool_choice {choice!r} does not constrain the output")


class NamedToolCallStreamer(ToolCallStreamer):
    """The whole output is the arguments: surrounding whitespace dropped, the first
    non-blank text opens call 0."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._args = ContentStream()
        self._opened = False

    def feed(self, delta_text: str) -> StreamDelta:
        piece = self._args.push(delta_text)
        if not piece:
            return StreamDelta()
        if not self._opened:
            self._opened = True
            return StreamDelta(None, [first_fragment(0, self._name, piece)])
        return StreamDelta(None, [arguments_fragment(0, piece)])

    def finish(self) -> StreamDelta:
        return StreamDelta()


class RequiredToolCallStreamer(ToolCallStreamer):
    """`[ {"name": ..., "parameters": {...}}, ... ]`: calls stream as their objects do."""

    def __init__(self) -> None:
        self._opened = False
        self._seq = CallSequenceStream(",", "]")

    def feed(self, delta_text: str) -> StreamDelta:
        if not self._opened:
            head = delta_text.lstrip()
            if not head:
                return StreamDelta()
            self._opened, delta_text = True, head[1:] if head.startswith("[") else head
        return StreamDelta(None, self._seq.feed(delta_text))

    def finish(self) -> StreamDelta:
        return StreamDelta(None, self._seq.feed("", final=True))
