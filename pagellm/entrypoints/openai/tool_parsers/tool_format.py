"""The tool-call format a chat template teaches its model, read from the template's text
(as llama.cpp's server does with `--jinja`): a template string in, a `--tool-call-parser`
name out, or None when pagellm reads no format of that template (or it renders no tools).

With None the server falls back to the generic tool prompt (generic_prompt.py), whose
replies the hermes parser reads under a "text or tool calls" grammar.
"""

from __future__ import annotations

import functools
import re

from pagellm.entrypoints.openai.tool_parsers.generic_prompt import template_supports_tools

# (parser, what in a template's text shows that format), tried in order: a Llama 3.2/4
# template that teaches pythonic calls may mention <|python_tag|> too.
_FORMATS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("hermes", re.compile(re.escape("<tool_call>"))),  # Hermes 2/3, Qwen 2/2.5/3, SmolLM3
    ("pythonic", re.compile(r"\[func_name1\(")),  # Llama 3.2 / 4 pythonic, ToolACE
    ("llama3_json", re.compile(re.escape("<|python_tag|>") + "|respond with a JSON for a function call")),
    ("mistral", re.compile(re.escape("[TOOL_CALLS]"))),  # Mistral 7B v0.3, Nemo, Small 3.x, Devstral
)


@functools.lru_cache(maxsize=16)
def template_tool_parser(template: str) -> str | None:
    """The parser name for the tool calls `template`'s model writes, or None: the template
    renders no tools, or writes them in a format without a parser here."""
    if not template_supports_tools(template):
        return None
    return next((name for name, pattern in _FORMATS if pattern.search(template)), None)
