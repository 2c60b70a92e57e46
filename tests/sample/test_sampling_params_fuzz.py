"""Property-based fuzzing of SamplingParams (issue #16): hypothesis draws keyword
combinations across valid and invalid ranges. A combination the documented ranges allow
generates on a tiny model; one they forbid raises a ValueError naming a field at fault;
nothing raises anything else, and the engine is left with no request and no KV block."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import StructuredOutputsParams

VOCAB = 49152  # the tiny model shares the default model's tokenizer
PROMPT = "The quick brown fox"
MAX_MODEL_LEN = 64
MAX_LOGPROBS = 20
"""The engine's default max_logprobs (vLLM's): the most logprobs a request may ask for."""

NAN, INF = float("nan"), float("inf")


def _mostly(valid: st.SearchStrategy[Any], invalid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Valid values 7 times in 8, so that about half the combinations are accepted."""
    return st.one_of(*[valid] * 7, invalid)


def _floats(lo: float, hi: float, below: float, above: float) -> st.SearchStrategy[float]:
    """Floats in [lo, hi] (the valid range), or NaN, +-inf, or a value out of range."""
    return _mostly(st.floats(lo, hi), st.sampled_from([NAN, INF, -INF, below, above]))


def _token_ids() -> st.SearchStrategy[int]:
    return _mostly(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB, 2**70]))


_TEXT = st.text(alphabet="ab .\n", min_size=1, max_size=4).filter(str.strip)
_BAD_TEXT = st.sampled_from(["", " ", "\n"])
# (kwargs, valid): one constraint of each kind, and ones the constructor or a backend refuses
_STRUCTURED = _mostly(
    st.sampled_from([({"choice": ["yes", "no"]}, True), ({"regex": "[ab]{1,3}"}, True),
                     ({"json": {"type": "object"}}, True), ({"json_object": True}, True)]),
    st.sampled_from([({"choice": []}, False), ({"choice": "yes"}, False), ({"regex": "("}, False),
                     ({"regex": 5}, False), ({"json": "not json"}, False),
                     ({"regex": "a", "choice": ["a"]}, False), ({}, False)]),
)

KWARGS = st.fixed_dictionaries({}, optional={
    "n": _mostly(st.integers(1, 3), st.integers(-1, 0)),
    "temperature": st.one_of(_floats(0.0, 2.0, -0.5, 3.0), st.sampled_from([0.0, 1e-6])),
    "top_p": _floats(0.01, 1.0, 0.0, 1.5),
    "top_k": _mostly(st.integers(-1, VOCAB + 5), st.sampled_from([-3, -2, 2**70])),
    "min_p": _floats(0.0, 1.0, -0.1, 1.5),
    "presence_penalty": _floats(-2.0, 2.0, -2.5, 3.0),
    "frequency_penalty": _floats(-2.0, 2.0, -2.5, 3.0),
    "repetition_penalty": _floats(0.01, 3.0, 0.0, -1.0),
    "max_tokens": _mostly(st.one_of(st.none(), st.integers(1, 6)), st.integers(-2, 0)),
    "min_tokens": _mostly(st.integers(0, 8), st.integers(-2, -1)),
    "logprobs": _mostly(st.one_of(st.none(), st.integers(-1, 5)), st.sampled_from([-2, MAX_LOGPROBS + 1])),
    "prompt_logprobs": _mostly(st.one_of(st.none(), st.integers(-1, 3)), st.just(-2)),
    "stop": st.one_of(st.none(), _TEXT, st.lists(_mostly(_TEXT, _BAD_TEXT), max_size=3)),
    "stop_token_ids": st.lists(_token_ids(), max_size=3),
    "seed": _mostly(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
                    st.sampled_from([-(2**63) - 1, 2**63, 2**70])),
    "ignore_eos": st.booleans(),
    "detokenize": _mostly(st.just(True), st.just(False)),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.dictionaries(_token_ids(), _floats(-100.0, 100.0, -200.0, 200.0), max_size=3),
    "allowed_token_ids": _mostly(st.one_of(st.none(), st.lists(_token_ids(), min_size=1, max_size=4)),
                                 st.just([])),
    "bad_words": st.lists(_mostly(_TEXT, _BAD_TEXT), max_size=2),
    "structured_outputs": _STRUCTURED,
})


def _at_fault(kw: dict[str, Any]) -> set[str]:
    """The fields the documented ranges forbid (several may be at fault at once)."""
    get = kw.get
    bad: set[str] = set()

    def out(name: str, ok: bool) -> None:
        if name in kw and not ok:
            bad.add(name)

    out("n", get("n", 1) >= 1)
    out("temperature", math.isfinite(get("temperature", 1.0)) and get("temperature", 1.0) >= 0)
    out("top_p", 0 < get("top_p", 1.0) <= 1)
    out("top_k", get("top_k", 0) >= -1)
    out("min_p", 0 <= get("min_p", 0.0) <= 1)
    out("presence_penalty", -2 <= get("presence_penalty", 0.0) <= 2)
    out("frequency_penalty", -2 <= get("frequency_penalty", 0.0) <= 2)
    out("repetition_penalty", 0 < get("repetition_penalty", 1.0) < INF)
    max_tokens = get("max_tokens", 16)
    out("max_tokens", max_tokens is None or max_tokens >= 1)
    out("min_tokens", get("min_tokens", 0) >= 0)
    if max_tokens is not None and get("min_tokens", 0) > max_tokens:
        bad.update({"min_tokens"} & kw.keys())
    for name in ("logprobs", "prompt_logprobs"):
        # -1 asks for the whole vocabulary, which the engine's max_logprobs (20) refuses
        out(name, get(name) is None or 0 <= get(name) <= MAX_LOGPROBS)
    stop = get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    out("stop", all(stops))
    if stops and not get("detokenize", True):
        bad.update({"stop", "detokenize"})
    out("bad_words", all(w.strip() for w in get("bad_words", [])))
    allowed = get("allowed_token_ids")
    out("allowed_token_ids", allowed is None or (allowed and all(0 <= t < VOCAB for t in allowed)))
    out("stop_token_ids", all(0 <= t < VOCAB for t in get("stop_token_ids", [])))
    bias = get("logit_bias", {})
    out("logit_bias", all(0 <= t < VOCAB and math.isfinite(v) for t, v in bias.items()))
    seed = get("seed")
    out("seed", seed is None or seed == -1 or -(2**63) <= seed < 2**63)
    if "structured_outputs" in kw and not kw["structured_outputs"][1]:
        bad.add("structured_outputs")
    return bad


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    llm = LLM(tiny_model("llama"), multiprocess_mode=False, max_model_len=MAX_MODEL_LEN,
              dtype=torch.float32)
    yield llm
    llm.shutdown()


def _assert_engine_empty(llm: LLM) -> None:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.requests == {}
    assert not scheduler.running and len(scheduler.waiting) == 0
    assert scheduler.kv_cache_manager.usage == 0.0
    scheduler.check_invariants()


def _check_output(kw: dict[str, Any], outputs: list) -> None:
    (out,) = outputs
    assert len(out.outputs) == kw.get("n", 1), kw
    max_tokens = kw.get("max_tokens", 16)
    for completion in out.outputs:
        if max_tokens is not None:
            assert len(completion.token_ids) <= max_tokens
        if kw.get("allowed_token_ids"):
            assert set(completion.token_ids) <= set(kw["allowed_token_ids"])
        if kw.get("logprobs") is not None:
            assert len(completion.logprobs) == len(completion.token_ids)
        choice = kw.get("structured_outputs", ({}, False))[0].get("choice")
        # the whole text, unless a stop string cut it or it was never detokenized
        if choice and completion.finish_reason == "stop" and kw.get("detokenize", True) and not kw.get("stop"):
            assert completion.text in choice, kw


@settings(max_examples=150, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kw=KWARGS)
def test_sampling_params_accept_or_name_the_field(llm: LLM, kw: dict[str, Any]) -> None:
    at_fault = _at_fault(kw)
    args = dict(kw)
    try:
        if "structured_outputs" in args:
            args["structured_outputs"] = StructuredOutputsParams(**args["structured_outputs"][0])
        params = SamplingParams(**args)
        outputs = llm.generate(PROMPT, params, use_tqdm=False)
    except ValueError as e:
        assert at_fault, f"{kw!r} was refused: {e}"
        named = {name for name in at_fault if re.search(rf"\b{name}\b", str(e))}
        assert named, f"{e} names none of {at_fault}"
    else:
        assert not at_fault, f"{kw!r} was accepted, though {at_fault} are out of range"
        _check_output(kw, outputs)
    _assert_engine_empty(llm)


def test_found_by_fuzzing(llm: LLM) -> None:
    """Each of these once crashed or was accepted against its documented range."""
    with pytest.raises(ValueError, match=r"^temperature must be a finite number, got nan\.$"):
        SamplingParams(temperature=NAN)
    with pytest.raises(ValueError, match=r"^temperature must be a finite number, got inf\.$"):
        SamplingParams(temperature=INF)
    with pytest.raises(ValueError, match=r"^logit_bias values must be finite numbers, got nan for token 7\.$"):
        SamplingParams(logit_bias={7: NAN})
    with pytest.raises(ValueError, match=r"^structured_outputs\.choice must be a list, got 'yes'\.$"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex must be a str, got 5\.$"):
        StructuredOutputsParams(regex=5)
    # a top_k past the vocabulary keeps every token (and no longer overflows the wire)
    top_k = llm.generate(PROMPT, SamplingParams(top_k=2**70, temperature=0, max_tokens=3), use_tqdm=False)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert top_k[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=rf"^priority must be a signed 64-bit integer, got {2**70}\.$"):
        llm.generate(PROMPT, SamplingParams(max_tokens=1), priority=[2**70], use_tqdm=False)
    _assert_engine_empty(llm)


def test_constraints_that_leave_no_token_finish_the_request(llm: LLM) -> None:
    """Found by fuzzing: constraints that exclude each other once let the sampler pick a
    token none allowed (token 0, outside allowed_token_ids). Now the request ends there
    with finish_reason 'error' and the tokens it had before, and frees its blocks."""
    eos = llm.get_tokenizer().eos_token_id
    cases = [
        SamplingParams(allowed_token_ids=[1], structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(allowed_token_ids=[eos], min_tokens=2, max_tokens=4),
        SamplingParams(allowed_token_ids=[eos, 100], min_tokens=2, bad_words=[llm.get_tokenizer().decode([100])],
                       temperature=1.0, seed=3),
    ]
    for params in cases:
        (out,) = llm.generate(PROMPT, params, use_tqdm=False)
        (completion,) = out.outputs
        assert (completion.token_ids, completion.finish_reason) == ([], "error"), params
        _assert_engine_empty(llm)
    # one token in: every two-token sequence of " a" and " b" is a bad word, so after
    # the first token neither is left
    tok = llm.get_tokenizer()
    a, b = (tok.encode(w, add_special_tokens=False)[0] for w in (" a", " b"))
    params = SamplingParams(allowed_token_ids=[a, b], bad_words=["a a", "a b", "b a", "b b"], max_tokens=4)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    (completion,) = out.outputs
    assert len(completion.token_ids) == 1 and completion.token_ids[0] in (a, b)
    assert completion.finish_reason == "error"
    _assert_engine_empty(llm)
