"""Chat messages -> prompt text through the model's chat template (frontend only)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

# The message roles a request may use (the server's schema checks against this list too).
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks OpenAI-style messages and flattens text content parts to a string."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts.")
    result = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'.")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}.")
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError(f"messages[{i}].content: only text parts are supported.")
                parts.append(str(part.get("text", "")))
            content = "\n".join(parts)  # as vLLM joins text parts
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts.")
        result.append({**msg, "content": content})
    return result


class ChatTemplateError(ValueError):
    """The chat template failed to render (a syntax error, its raise_exception(), or a
    request's template refused by the bounded sandbox)."""


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    bounded: bool = False,
    generic_tools: bool = False,
    **kwargs: Any,
) -> str:
    """Renders a conversation. Tools (and a history's tool calls and results) go to a
    template that renders them itself; a template that knows no tools gets them as a
    generic tool prompt, and the history's tool turns as plain text. generic_tools: the
    generic prompt even for a template that renders tools (one whose call format the
    server cannot read).

    bounded: `chat_template` came in a request: it renders in pagellm's bounded sandbox
    (template_sandbox.py: internals refused, output size and render time capped) instead
    of transformers' environment."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "The model's tokenizer has no chat template; pass chat_template= (or --chat-template)."
        )
    from pagellm.entrypoints.openai.tool_parsers.generic_prompt import (
        add_generic_tool_prompt,
        ends_in_tool_results,
        flatten_tool_messages,
    )

    messages = validate_messages(messages)
    if _supports_tools(template) and not generic_tools:
        messages = [_arguments_as_objects(m) for m in messages]
        if tools:
            kwargs["tools"] = tools
    else:
        continues = ends_in_tool_results(messages)
        messages = add_generic_tool_prompt(messages, tools) if tools else flatten_tool_messages(messages)
        continue_final_message = continue_final_message or continues  # the turn with the results
    import jinja2

    if bounded:
        from pagellm.entrypoints.template_sandbox import render_request_template

        try:
            return render_request_template(template, tokenizer, messages, kwargs.pop("tools", None),
                                           add_generation_prompt and not continue_final_message,
                                           continue_final_message, kwargs)
        except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError,
                MemoryError) as e:  # anything a template can raise is the request's fault
            raise ChatTemplateError(f"The chat template failed: {type(e).__name__}: {e}") from e
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except jinja2.TemplateError as e:  # a syntax error, or the template's raise_exception()
        raise ChatTemplateError(f"The chat template failed: {type(e).__name__}: {e}") from e


@functools.lru_cache(maxsize=16)
def _supports_tools(template: str) -> bool:
    from pagellm.entrypoints.openai.tool_parsers.generic_prompt import template_supports_tools

    return template_supports_tools(template)


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Templates that render tool calls expect `arguments` as an object; OpenAI's
    messages carry it as a JSON string."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass  # left as text; the template shows it as it came
        fixed.append({**call, "function": fn})
    return {**message, "tool_calls": fixed}


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's path or the Jinja text itself. A value with no Jinja
    markup that names no file is a mistyped path, refused rather than used as the
    template (which would replace every conversation with the path's text)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            text = f.read()
        if text.lstrip().startswith('"'):  # a JSON-quoted template string
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                pass
        return text
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"chat template {value!r} looks like a file path, but no such file exists")
    return value
