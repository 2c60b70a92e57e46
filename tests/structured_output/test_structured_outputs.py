"""Structured outputs in the engine, on the real default model: JSON schemas, regexes and
choices hold for sampled outputs; the bitmask touches only constrained rows; grammars
compile off the busy loop; preemption, n > 1, aborts and bad constraints."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.core.request import RequestStatus
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import Sampler
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_types import allocate_token_bitmask
from tests.structured_output.schemas import make_schemas


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM(multiprocess_mode=False, max_num_seqs=64, max_model_len=1024, disable_log_stats=True)
    yield llm
    llm.shutdown()


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def _chat_prompt(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def _assert_engine_empty(llm: LLM) -> None:
    sched = _core(llm).scheduler
    assert not sched.requests and not sched.waiting_for_grammar
    assert sched.kv_cache_manager.usage == 0.0


def test_sampled_json_fits_its_schema(llm: LLM) -> None:
    """32 generated schemas x 2 seeds at temperature 1: every output that stops parses
    and validates; at most 1 in 10 is cut by max_tokens."""
    schemas = make_schemas(32, seed=0)
    prompts, params = [], []
    for schema in schemas:
        for seed in (0, 1):
            prompts.append(_chat_prompt(llm, "Reply with a JSON object that fits this schema: " + json.dumps(schema)))
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    cut = 0
    for out, p in zip(outs, params):
        c = out.outputs[0]
        if c.finish_reason == "length":
            cut += 1
            continue
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), p.structured_outputs.json)
    assert cut <= len(outs) // 10, f"{cut} of {len(outs)} outputs were cut by max_tokens"
    _assert_engine_empty(llm)


def test_length_bounded_strings_emit_valid_json() -> None:
    """xgrammar writes a string with minLength / maxLength as a repeat of a class that lets
    a raw tab through and no escape (the sampled-JSON test above once drew
    {"ok": "down<TAB>4."}, which json.loads rejects); pagellm's grammar takes an escape or
    any character but a control character for each repeat: valid JSON, the bounds
    counted in decoded characters."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    from pagellm.structured_output.backend_xgrammar import json_schema_ebnf

    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 1, "maxLength": 7}},
              "required": ["a"], "additionalProperties": False}
    grammar = Grammar.from_ebnf(json_schema_ebnf(json.dumps(schema)))
    cases = {
        '{"a": "ab\tc"}': False,  # a raw tab
        '{"a": "ab\\tc"}': True,  # the escape \t: one character
        '{"a": "a\\"b"}': True,
        '{"a": "\\u0041bcdefg"}': True,  # 7 characters, the first one an escape
        '{"a": "\\u0041bcdefgh"}': False,  # 8
        '{"a": "1234567"}': True,
        '{"a": "12345678"}': False,
        '{"a": ""}': False,
    }
    for text, valid in cases.items():
        assert _is_grammar_accept_string(grammar, text) is valid, text
        if valid:
            json.loads(text)
    # the raw class stays where xgrammar's own plain strings already exclude control characters
    plain = Grammar.from_ebnf(json_schema_ebnf(json.dumps({"type": "string"})))
    assert not _is_grammar_accept_string(plain, '"a\tb"')


def test_sampled_regex_and_choice_match(llm: LLM) -> None:
    regexes = [r"[A-Z]{3}-[0-9]{2,4}", r"(cat|dog)s? (are|is) (great|fine)\.", r"[a-z]{2,8}@[a-z]{3,6}\.(com|org)",
               r"-?[1-9][0-9]{0,3}(\.[0-9]{1,2})?"]
    choices = ["Paris", "London", "Berlin", "Rome"]
    prompts, params = [], []
    for seed in range(3):
        for rx in regexes:
            prompts.append("Answer:")
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                                         structured_outputs=StructuredOutputsParams(regex=rx)))
        prompts.append(_chat_prompt(llm, "Which is the capital of France?"))
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=10,
                                     structured_outputs=StructuredOutputsParams(choice=choices)))
    for out, p in zip(llm.generate(prompts, params, use_tqdm=False), params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        so = p.structured_outputs
        if so.regex is not None:
            assert re.fullmatch(so.regex, c.text), (so.regex, c.text)
        else:
            assert c.text in choices


def test_bitmask_leaves_unconstrained_rows_bit_for_bit() -> None:
    vocab = 1000
    logits = torch.randn(4, vocab)
    before = logits.clone()
    bitmask = torch.zeros(2, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2 allowed
    bitmask[1, 3] = 1 << 7  # token 3 * 32 + 7 = 103 allowed
    metadata = SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, min_p=None,
        generators={}, max_num_logprobs=None, no_penalties=True, presence_penalties=None,
        frequency_penalties=None, repetition_penalties=None, prompt_token_ids=None,
        output_token_ids=[[] for _ in range(4)], token_bitmask=bitmask, token_bitmask_rows=[1, 3],
    )
    Sampler.apply_constraints(logits, metadata)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [103]
    assert torch.equal(logits[1, [0, 2]], before[1, [0, 2]])
    sampled = Sampler().forward(before.clone(), metadata).sampled_token_ids.tolist()
    assert sampled[0] == int(before[0].argmax()) and sampled[2] == int(before[2].argmax())
    assert sampled[1] in (0, 2) and sampled[3] == 103


def test_unconstrained_requests_unchanged_beside_constrained_ones(llm: LLM) -> None:
    """The same prompts twice, the last two rows unconstrained then constrained: the
    first two rows keep their tokens. (Their logprobs agree to float rounding only: the
    constrained rows wait for their grammar, so the first steps batch differently. The
    bitmask itself leaves other rows bit for bit: the test above.)"""
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    prompts = ["The capital of France is", "Once upon a time", "JSON:", "Data:"]
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z ]{16,40}"))
    before = llm.generate(prompts, [plain, plain, free, free], use_tqdm=False)
    after = llm.generate(prompts, [plain, plain, constrained, constrained], use_tqdm=False)
    for b, a in zip(before[:2], after[:2]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for lb, la in zip(b.outputs[0].logprobs, a.outputs[0].logprobs):
            assert lb.keys() == la.keys()
            assert all(abs(lb[t].logprob - la[t].logprob) < 1e-4 for t in lb)
    assert all(re.fullmatch("[a-z ]+", a.outputs[0].text) for a in after[2:])
    assert before[2].outputs[0].text != after[2].outputs[0].text


def test_n_samples_each_follow_the_schema(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["color", "count"], "additionalProperties": False}
    # At temperature 1 the grammar's optional whitespace comes in runs (20-30 newlines at
    # times): room for that, so every sample reaches its closing brace.
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=100,
                            structured_outputs=StructuredOutputsParams(json=schema))
    (out,) = llm.generate([_chat_prompt(llm, "Pick a color and a count.")], params, use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)


def test_preempted_requests_keep_their_grammar_state() -> None:
    """A pool too small for every request preempts (and recomputes) some; each output is
    still exactly what the grammar allows."""
    small = LLM(multiprocess_mode=False, num_gpu_blocks_override=14, block_size=8, max_num_seqs=8,
                max_model_len=96, disable_log_stats=True)
    try:
        rx = r"[a-z]{8}( [a-z]{8}){5}"
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(regex=rx)) for i in range(8)]
        outs = small.generate([f"Words {i}:" for i in range(8)], params, use_tqdm=False)
        assert _core(small).scheduler.num_preemptions_total > 0
        for out in outs:
            assert out.outputs[0].finish_reason == "stop"
            assert re.fullmatch(rx, out.outputs[0].text), out.outputs[0].text
        _assert_engine_empty(small)
    finally:
        small.shutdown()


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutputsParams(json={"type": "objectz"}), "Invalid structured_outputs.json: invalid JSON schema['type']: 'objectz' is not valid"),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
         "Invalid structured_outputs.json: Cannot find field '$defs' in #/$defs/missing"),
        (StructuredOutputsParams(regex="a(b"), "Invalid structured_outputs.regex: Regex parsing error"),
        (StructuredOutputsParams(grammar="root ::= missing"), 'Invalid structured_outputs.grammar: EBNF parser error at line 1, column 10: Rule "missing" is not defined'),
    ],
)
def test_bad_constraint_is_refused_before_the_engine(llm: LLM, constraint, message) -> None:
    with pytest.raises(ValueError) as err:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)
    assert str(err.value).startswith(message)
    _assert_engine_empty(llm)


def test_constraint_needs_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object, structural_tag; got json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()


def _big_schema(n: int) -> dict:
    """A schema whose grammar takes seconds to compile for this vocabulary."""
    props = {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1}}}-[0-9]{{{i % 5 + 1}}}"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_slow_grammar_compiles_while_others_decode(llm: LLM) -> None:
    """A request whose grammar takes long to compile waits (WAITING_FOR_FSM) while the
    running requests keep getting tokens every step, then runs under its grammar."""
    engine = llm.llm_engine
    core = _core(llm)
    for i in range(2):
        engine.add_request(f"plain-{i}", "Tell me a long story.", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        engine.step()
    big = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=_big_schema(1500)))
    engine.add_request("big", "Fill the form:", big)
    assert core.scheduler.requests["big"].status == RequestStatus.WAITING_FOR_FSM
    steps_while_compiling = 0
    start = time.monotonic()
    while True:
        ids = {o.request_id for o in engine.step()}
        assert {"plain-0", "plain-1"} <= ids  # both got a token this step
        if core.scheduler.requests["big"].status != RequestStatus.WAITING_FOR_FSM:
            break
        assert "big" not in ids
        steps_while_compiling += 1
        assert time.monotonic() - start < 120
    assert steps_while_compiling >= 3
    texts: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            texts[o.request_id] = o.outputs[0].text
            if o.request_id.startswith("plain"):
                engine.abort_request([o.request_id])
        if "big" in texts and len(texts["big"]) >= 1:
            engine.abort_request(["plain-0", "plain-1"])
    assert texts["big"].startswith('{"field_0"') or texts["big"].startswith("{")
    _assert_engine_empty(llm)


def test_abort_while_the_grammar_compiles(llm: LLM) -> None:
    engine = llm.llm_engine
    core = _core(llm)
    engine.add_request("slow", "Fill the form:", SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(json=_big_schema(1200))))
    assert core.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_FSM
    engine.abort_request(["slow"])
    assert "slow" not in core.scheduler.requests and not core.scheduler.waiting_for_grammar
    while engine.has_unfinished_requests():
        engine.step()
    core.scheduler.check_invariants()
    _assert_engine_empty(llm)


def test_constraint_crosses_the_process_boundary() -> None:
    """The multiprocess client sends the constraint to an engine-core process."""
    mp = LLM(max_model_len=256, disable_log_stats=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        (out,) = mp.generate([_chat_prompt(mp, "Is the sky blue?")], params, use_tqdm=False)
        assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
    finally:
        mp.shutdown()


def test_guidance_backend_serves_what_it_is_asked_for() -> None:
    """structured_outputs_config={"backend": "guidance"} compiles with llguidance."""
    g = LLM(multiprocess_mode=False, max_model_len=256, disable_log_stats=True,
            structured_outputs_config={"backend": "guidance"})
    try:
        rx = r"[0-9]{3}-[a-z]{3}"
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=rx))
        (out,) = g.generate(["Code:"], params, use_tqdm=False)
        assert re.fullmatch(rx, out.outputs[0].text)
        assert params.structured_outputs.backend is None  # the caller's params are not changed
        assert list(_core(g).structured_output_manager._backends) == ["guidance"]
    finally:
        g.shutdown()


def test_allocate_token_bitmask_allows_everything() -> None:
    mask = allocate_token_bitmask(2, 70)
    assert mask.shape == (2, 3) and mask.dtype == torch.int32 and bool((mask == -1).all())
