"""xgrammar backend (vLLM's default): grammars compiled for the model's vocabulary,
with a shared compile cache."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_types import (
    Grammar,
    StructuredOutputBackend,
    import_xgrammar,
)


def _json_schema(params: StructuredOutputsParams) -> str:
    schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
    if params.disable_additional_properties:
        schema = json.dumps(_no_additional_properties(json.loads(schema)))
    return schema


def _no_additional_properties(schema: Any) -> Any:
    """Sets additionalProperties: false on every object schema that does not say."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


MAX_WHITESPACE_RUN = 20
"""Longest whitespace run a JSON schema's grammar allows between tokens (llama.cpp's JSON
grammars allow a newline and up to 20 indentation characters). Unbounded, a small model
sampling at temperature 1 can emit newlines until max_tokens."""

# xgrammar (0.2.x) writes a string with minLength / maxLength as a repeat of this class:
# it lets raw control characters through (a tab inside a string: JSON that Python's
# json.loads and JavaScript's JSON.parse reject) and no escape at all (mlc-ai/xgrammar
# issues 286 and 800). Each repeat becomes one JSON character instead, as in its plain
# strings: an unescaped one other than a control character, or an escape.
_BOUNDED_CHARACTER = ' ::= (([^\\"\\\\\\r\\n]))'
_JSON_CHARACTER = ' ::= (([^\\0-\\x1f\\"\\\\]) | ("\\\\" basic_escape))'
_BASIC_ESCAPE = 'basic_escape ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'


def json_schema_ebnf(schema: str, any_whitespace: bool = True, max_whitespace_cnt: int | None = None) -> str:
    """xgrammar's grammar of a JSON schema as EBNF text, its length-bounded strings made
    to emit valid JSON (_BOUNDED_CHARACTER). Raises RuntimeError as xgrammar does."""
    xgr = import_xgrammar()
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace,
                                            max_whitespace_cnt=max_whitespace_cnt))
    lines = text.splitlines()
    fixed = [line[: -len(_BOUNDED_CHARACTER)] + _JSON_CHARACTER if line.endswith(_BOUNDED_CHARACTER) else line
             for line in lines]
    if fixed != lines and not any(line.startswith("basic_escape ::=") for line in lines):
        fixed.append(_BASIC_ESCAPE)
    return "\n".join(fixed)


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _message(error: RuntimeError) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:123: ")."""
    lines = str(error).strip().splitlines()
    return _LOG_PREFIX.sub("", lines[0]) if lines else repr(error)


def _choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def validate(params: StructuredOutputsParams) -> None:
    """Raises ValueError when xgrammar cannot take the constraint (no vocabulary needed)."""
    xgr = import_xgrammar()
    kind = params.kind
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(_json_schema(params), any_whitespace=not params.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_choice_grammar(params.choice or []))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
        elif kind == "structural_tag":
            raise ValueError("structural_tag is served by the guidance backend only")
        if params.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported by xgrammar")
    except RuntimeError as e:  # xgrammar reports parse errors as RuntimeError
        raise ValueError(_message(e)) from None


class XgrammarGrammar(Grammar):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for t in token_ids:
            if not self.matcher.accept_token(t):
                return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int) -> None:
        xgr = import_xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True)

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        kind = params.kind
        try:
            if kind == "json":
                compiled = self.compiler.compile_grammar(
                    json_schema_ebnf(_json_schema(params), not params.disable_any_whitespace, MAX_WHITESPACE_RUN)
                )
            elif kind == "json_object":
                compiled = self.compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = self.compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(_choice_grammar(params.choice or []))
            elif kind == "grammar":
                compiled = self.compiler.compile_grammar(params.grammar)
            else:
                raise ValueError(f"xgrammar does not serve {kind}")
        except RuntimeError as e:
            raise ValueError(_message(e)) from None
        return XgrammarGrammar(self._xgr.GrammarMatcher(compiled))
