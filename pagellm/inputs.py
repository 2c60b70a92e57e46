"""Prompt shapes accepted by `LLM.generate` and `AsyncLLM.generate`, under vLLM's names
(`from pagellm import TokensPrompt` / `from pagellm.inputs import TextPrompt`)."""

from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    """The text, tokenized by the model's tokenizer."""


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    """Token ids, used as they are."""
    prompt: NotRequired[str]
    """The text the ids came from, if known (returned in RequestOutput.prompt)."""


PromptType = str | list[int] | TextPrompt | TokensPrompt
"""A prompt: text, token ids, or one of the dicts above."""
