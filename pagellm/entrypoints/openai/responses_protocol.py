"""The Responses API's request body and the mapping of its parts onto chat completions:
`input` items -> chat messages, function `tools` / `tool_choice` / `text.format` -> the chat
request's fields. Pydantic and plain dicts only; nothing here runs a model.

A bad part raises ResponsesInputError naming the request field (OpenAI's error `param`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pagellm.entrypoints.openai.protocol import OpenAIBaseModel


class ResponsesInputError(ValueError):
    """A request part the server cannot take; `param` names it, e.g. `input[2].type`."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param


class ResponseTextFormat(OpenAIBaseModel):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseTextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("text.format of type json_schema needs a name and a schema")
        return self


class ResponseTextConfig(OpenAIBaseModel):
    format: ResponseTextFormat | None = None


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses (OpenAI's fields that pagellm serves; others are ignored)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: ResponseTextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if not value:
            raise ValueError("input must not be empty")
        return value

    # What the server's per-request caps and admission read from any request.
    @property
    def n(self) -> int:
        return 1

    @property
    def stop(self) -> None:
        return None


# -- input items -> chat messages ----------------------------------------------------------

_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ResponsesInputError(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ResponsesInputError(f"{where}[{j}]", f"only text parts are supported, got {kind!r}")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: messages keep their role; `function_call` items join the
    assistant turn before them (or open one) as `tool_calls`; `function_call_output` items
    become `tool` messages; `reasoning` items are dropped (the model reasons afresh)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ResponsesInputError(f"{where}.role", f"must be user, system, developer or assistant, "
                                                           f"got {role!r}")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise ResponsesInputError(f"{where}.{key}", "must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ResponsesInputError(f"{where}.call_id", "must be a string")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind != "reasoning":
            raise ResponsesInputError(f"{where}.type", f"{kind!r} items are not supported; use message, "
                                                       "function_call or function_call_output")
    return messages


# -- tools, tool_choice, text.format -> chat fields ------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools `{"type": "function", "name", "parameters", ...}` in
    the chat shape `{"type": "function", "function": {...}}`."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ResponsesInputError(f"tools[{i}].type", f"only function tools are supported, got "
                                                          f"{tool.get('type')!r}")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesInputError("tool_choice", 'must be "none", "auto", "required" or '
                                             '{"type": "function", "name": ...}')


def chat_response_format(text: ResponseTextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.json_schema,
                                                   "strict": fmt.strict}}


CHAT_TO_RESPONSES_PARAM = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "prompt": "input",
}
"""A chat request's field named in an error, as the Responses request calls it."""


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    head, dot, rest = param.partition(".")
    return CHAT_TO_RESPONSES_PARAM.get(head, head) + dot + rest
