"""One list of chat roles: the server's request schema and validate_messages (used by
LLM.chat and the chat endpoint) accept and refuse the same roles."""

from __future__ import annotations

import re

import pydantic
import pytest

from pagellm.entrypoints.chat_utils import CHAT_ROLES, validate_messages
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest


@pytest.mark.parametrize("role", [*CHAT_ROLES, "robot", None])
def test_schema_and_validate_messages_agree_on_roles(role: str | None) -> None:
    messages = [{"role": role, "content": "hi"}]
    if role in CHAT_ROLES:
        assert validate_messages(messages) == messages
        assert ChatCompletionRequest(model="m", messages=messages).messages == messages
        return
    expected = f"messages[0].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        validate_messages(messages)
    with pytest.raises(pydantic.ValidationError, match=re.escape(expected)):
        ChatCompletionRequest(model="m", messages=messages)
