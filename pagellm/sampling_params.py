"""SamplingParams: how one request is decoded, with vLLM's fields and defaults.

A msgspec Struct so it crosses the process boundary inside EngineCoreRequest without
pickle. Validation runs in __post_init__ and names the offending field and its range.
"""

from __future__ import annotations

import copy
import json
import math
from enum import IntEnum
from typing import Any

import msgspec

SAMPLING_EPS = 1e-5
"""A temperature below this is greedy (the sampler takes the argmax)."""
# logprobs / prompt_logprobs = ALL_LOGPROBS: every token of the vocabulary (vLLM's -1).
ALL_LOGPROBS = -1
_MAX_TEMP = 1e-2


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # everything so far, on every step
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# msgspec does not check types on construction; the engine core's decoder does, and a
# request it cannot decode must be refused here, in the caller, not there.
_STRUCTURED_TYPES: dict[str, tuple[type, ...]] = {
    "json": (str, dict), "regex": (str,), "choice": (list,), "grammar": (str,),
    "json_object": (bool,), "structural_tag": (str,), "disable_fallback": (bool,),
    "disable_any_whitespace": (bool,), "disable_additional_properties": (bool,),
    "whitespace_pattern": (str,), "backend": (str,),
}


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """Constrains a request's output to a JSON schema, a regex, one of several strings, a
    grammar (EBNF/GBNF or Lark), any JSON object, or a structural tag; exactly one kind.

    vLLM's fields. `backend` is filled by the frontend once it has validated the
    constraint (the backend that accepted it), so the engine core compiles with the same.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        for name, types in _STRUCTURED_TYPES.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, types):
                expected = " or ".join(t.__name__ for t in types)
                raise ValueError(f"structured_outputs.{name} must be a {expected}, got {value!r}.")
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {', '.join(kinds) if kinds else 'none'}."
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string (a JSON schema serialized), for keys and backends."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            return json.dumps(value, sort_keys=True)
        if self.kind == "choice":
            return json.dumps(value)
        return "" if value is True else value


class SamplingParams(msgspec.Struct, omit_defaults=True, dict=True):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Derived (set by the input processor, carried to the engine core).
    eos_token_id: int | None = None
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify_args()
        if 0 < self.temperature < _MAX_TEMP:
            self.temperature = _MAX_TEMP
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs mean nothing.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        if not self.all_stop_token_ids:
            self.all_stop_token_ids = list(self.stop_token_ids)

    def _verify_args(self) -> None:
        def bad(name: str, rule: str, value: Any) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise bad(name, "in [-2, 2]", v)
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", "a finite number > 0", self.repetition_penalty)
        if self.temperature < 0.0:
            raise bad("temperature", "non-negative", self.temperature)
        if not math.isfinite(self.temperature):  # NaN passes the comparison above
            raise bad("temperature", "a finite number", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "-1 or 0 (disable) or at least 1", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "at least 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "non-negative", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < ALL_LOGPROBS):
                raise bad(name, f"an integer, {ALL_LOGPROBS} (full vocabulary) or non-negative", value)
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words entries must contain text (got an empty or blank one).")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text).")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise ValueError("allowed_token_ids must not be empty.")
        for token, bias in (self.logit_bias or {}).items():
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} for token {token}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer", self.seed)
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad("seed", "a signed 64-bit integer", self.seed)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def verify_token_ids(self, vocab_size: int) -> None:
        """Checks that token ids the user gave exist in the vocabulary."""
        def check(name: str, ids: Any) -> None:
            for t in ids:
                if not isinstance(t, int) or not 0 <= t < vocab_size:
                    raise ValueError(
                        f"{name} contains token id {t!r}, out of vocabulary range [0, {vocab_size})."
                    )

        check("stop_token_ids", self.stop_token_ids or [])
        check("allowed_token_ids", self.allowed_token_ids or [])
        check("logit_bias", list((self.logit_bias or {}).keys()))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__struct_fields__)
        return f"SamplingParams({fields})"
