"""guidance backend (llguidance): the fallback for schemas and grammars xgrammar
refuses, and the one that serves Lark grammars, whitespace patterns and structural tags."""

from __future__ import annotations

import json
from typing import Any

import torch

from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_types import Grammar, StructuredOutputBackend, quiet_import


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar definition."""
    import llguidance

    kind = params.kind
    if kind == "json":
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        options: dict[str, Any] = {}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        elif params.disable_any_whitespace:
            options["whitespace_flexible"] = False
        else:
            options["whitespace_flexible"] = True
        if not params.disable_additional_properties:
            options["additionalProperties"] = True  # JSON Schema's own default
        loaded = json.loads(schema)
        if isinstance(loaded, dict):
            loaded = {**loaded, "x-guidance": {**options, **loaded.get("x-guidance", {})}}
        return llguidance.grammar_from("json_schema", json.dumps(loaded))
    if kind == "json_object":
        return llguidance.grammar_from("json_schema", json.dumps({"type": "object"}))
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", params.grammar)
    raise ValueError(f"guidance does not serve {kind}")


def validate(params: StructuredOutputsParams) -> None:
    import llguidance

    try:
        spec = grammar_spec(params)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(str(e)) from None
    ok, errors = _check(llguidance.LLMatcher.validate_grammar_with_warnings(spec))
    if not ok:
        raise ValueError(errors)


def _check(result: Any) -> tuple[bool, str]:
    """validate_grammar_with_warnings returns (is_error, messages)."""
    is_error, messages = result
    return not is_error, "; ".join(messages) if messages else "invalid grammar"


class GuidanceGrammar(Grammar):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self._fill = quiet_import("llguidance.torch").fill_next_token_bitmask

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for t in token_ids:
            if not self.matcher.consume_token(t):
                return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._fill(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def reset(self) -> None:
        self.matcher.reset()


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size, eos_token=stop_token_ids or None)

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        matcher = self._llg.LLMatcher(self.ll_tokenizer, grammar_spec(params))
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GuidanceGrammar(matcher)
