"""Anthropic's Messages API request body and the mapping of its parts onto chat
completions: content blocks -> chat messages (`tool_use` -> `tool_calls`, `tool_result` ->
`tool` messages), `tools` / `tool_choice` -> the chat shape. Pydantic and plain dicts
only; nothing here runs a model. A bad part raises MessagesInputError naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from pagellm.entrypoints.openai.protocol import OpenAIBaseModel


class MessagesInputError(ValueError):
    """A request part the server cannot take; `param` names it, e.g. `messages[1].content[0]`."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param


class MessagesRequest(OpenAIBaseModel):
    """POST /v1/messages (the fields pagellm serves; others are ignored)."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_tokens: int = Field(..., ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    # What the server's per-request caps and admission read from any request.
    @property
    def n(self) -> int:
        return 1

    @property
    def stop(self) -> list[str] | None:
        return self.stop_sequences


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise MessagesInputError(where, f"only text blocks are supported here, got {kind!r}")
    return str(block.get("text", ""))


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessagesInputError(where, "must be a string or a list of content blocks")
    return "".join(_block_text(b, f"{where}[{j}]") for j, b in enumerate(content))


def system_messages(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    text = _text(system, "system") if system else ""
    return [{"role": "system", "content": text}] if text else []


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with content blocks as chat messages: a user turn's `tool_result` blocks
    become `tool` messages (before the turn's text), an assistant turn's `tool_use` blocks
    its `tool_calls`; `thinking` blocks are dropped."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        where = f"messages[{i}]"
        if role not in ("user", "assistant"):
            raise MessagesInputError(f"{where}.role", f"must be user or assistant, got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise MessagesInputError(f"{where}.content", "must be a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise MessagesInputError(f"{at}.tool_use_id", "must be a string")
                result = block.get("content")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text(result, f"{at}.content") if result is not None else ""})
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise MessagesInputError(at, "a tool_use block needs a string id and name")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind not in ("thinking", "redacted_thinking"):
                raise MessagesInputError(f"{at}.type", f"{kind!r} blocks are not supported in a {role} turn")
        if texts or calls or role == "assistant":
            said: dict[str, Any] = {"role": role, "content": "".join(texts) or (None if calls else "")}
            if calls:
                said["tool_calls"] = calls
            out.append(said)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools `{"name", "description", "input_schema"}` in the chat shape."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise MessagesInputError(f"tools[{i}].type", f"only client (custom) tools are supported, got "
                                                         f"{tool.get('type')!r}")
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise MessagesInputError("tool_choice", 'must be {"type": "auto" | "any" | "none"} or '
                                            '{"type": "tool", "name": ...}')


def messages_param(param: str | None) -> str | None:
    """A chat request's field named in an error, as the Messages request calls it."""
    if param is None:
        return None
    if param.startswith("tools[") and ".function.parameters" in param:
        return param.replace(".function.parameters", ".input_schema", 1)
    head, dot, rest = param.partition(".")
    return {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}.get(head, head) + dot + rest
