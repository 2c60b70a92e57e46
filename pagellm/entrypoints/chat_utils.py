"""Chat messages -> prompt text through the model's chat template (frontend only)."""

from __future__ import annotations

from typing import Any

_ROLES = ("system", "user", "assistant", "tool", "developer")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks OpenAI-style messages and flattens text content parts to a string."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts.")
    result = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'.")
        role = msg.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(_ROLES)}; got {role!r}.")
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError(f"messages[{i}].content: only text parts are supported.")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
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
    return tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        **kwargs,
    )
