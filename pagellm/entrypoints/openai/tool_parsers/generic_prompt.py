"""Tools for chat templates that know nothing of tools (like llama.cpp server's generic
format): a system-prompt text describing the tools, and a rewrite of the history's
assistant `tool_calls` and `role: "tool"` turns into plain user/assistant text.

The prompt asks for hermes syntax (`<tool_call>{...}</tool_call>`), so the `hermes` parser
reads the replies. Messages come in as OpenAI dicts and go out as OpenAI dicts.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagellm.entrypoints.openai.tool_parsers.hermes_tool_parser import (
    TOOL_CALL_END,
    TOOL_CALL_START,
)
from pagellm.entrypoints.openai.tool_parsers.tool_choice import validate_tools

TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

_PROMPT = """\
# Tools

You may call one or more functions to help answer the user. The functions are described
here as JSON, each with its name, description and a JSON schema of its parameters:

{tools}

To call a function, reply with one line per call, in exactly this form and with nothing
after the calls:
{start}{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}{end}
The arguments must fit the function's parameters schema. Each result will come back to
you inside {response_start}...{response_end}; then answer the user with it. If no function
is needed, answer the user directly without any {start}."""


def template_supports_tools(template_source: str) -> bool:
    """Whether a Jinja chat template reads a `tools` variable (so it renders tools itself)."""
    try:
        import jinja2
        import jinja2.meta

        ast = jinja2.Environment().parse(template_source)
        return "tools" in jinja2.meta.find_undeclared_variables(ast)
    except Exception:  # a template jinja2 cannot parse: fall back to the word
        return re.search(r"\btools\b", template_source) is not None


def render_generic_tool_prompt(tools: list[Any]) -> str:
    """The system-prompt text describing `tools` and the `<tool_call>` reply format."""
    specs = validate_tools(tools)
    listing = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in specs)
    return _PROMPT.format(
        tools=listing,
        start=TOOL_CALL_START,
        end=TOOL_CALL_END,
        response_start=TOOL_RESPONSE_START,
        response_end=TOOL_RESPONSE_END,
    )


def _text(content: Any) -> str:
    """Message content as text: a string, None, or OpenAI content parts (text parts kept)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        part.get("text", "")
        for part in content
        if isinstance(part, dict) and part.get("type") == "text"
    )


def _tool_call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    arguments: Any = fn.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: shown to the model as the string it was
    body = json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}{body}{TOOL_CALL_END}"


def flatten_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history with tool turns as plain text a tool-less template can render.

    Assistant `tool_calls` become `<tool_call>` lines after the assistant's text; each run
    of consecutive `tool` messages becomes one user turn of `<tool_response>` blocks, each
    a JSON object with `tool_call_id`, the function `name` (looked up by id when the
    message lacks it) and `content`. Other messages pass through unchanged.
    """
    names_by_id: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    tool_run: list[str] = []

    def flush_tool_run() -> None:
        if tool_run:
            out.append({"role": "user", "content": "\n".join(tool_run)})
            tool_run.clear()

    for message in messages:
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            result = {
                "tool_call_id": call_id,
                "name": message.get("name") or names_by_id.get(call_id or ""),
                "content": _text(message.get("content")),
            }
            body = json.dumps(result, ensure_ascii=False)
            tool_run.append(f"{TOOL_RESPONSE_START}\n{body}\n{TOOL_RESPONSE_END}")
            continue
        flush_tool_run()
        calls = message.get("tool_calls") or []
        if role != "assistant" or not calls:
            out.append(message)
            continue
        for call in calls:
            if call.get("id"):
                names_by_id[call["id"]] = (call.get("function") or {}).get("name")
        lines = [_text(message.get("content")).strip()] + [_tool_call_text(c) for c in calls]
        plain = {k: v for k, v in message.items() if k != "tool_calls"}
        plain["content"] = "\n".join(line for line in lines if line)
        out.append(plain)
    flush_tool_run()
    return out


def add_generic_tool_prompt(
    messages: list[dict[str, Any]], tools: list[Any]
) -> list[dict[str, Any]]:
    """`flatten_tool_messages(messages)` with the tool prompt appended to the first system
    message's text, or in a new leading system message when there is none."""
    prompt = render_generic_tool_prompt(tools)
    out = flatten_tool_messages(messages)
    if out and out[0].get("role") == "system":
        system_text = _text(out[0].get("content")).rstrip()
        joined = f"{system_text}\n\n{prompt}" if system_text else prompt
        return [{**out[0], "content": joined}, *out[1:]]
    return [{"role": "system", "content": prompt}, *out]
