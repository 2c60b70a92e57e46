"""Chat messages -> prompt text through the model's chat template (frontend only)."""

from __future__ import annotations

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


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    messages = validate_messages(messages)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "The model's tokenizer has no chat template; pass chat_template= (or --chat-template)."
        )
    import jinja2

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
        raise ValueError(f"The chat template failed: {type(e).__name__}: {e}") from e


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
