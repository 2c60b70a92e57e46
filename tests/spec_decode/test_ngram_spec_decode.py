"""Speculative decoding with n-gram prompt lookup (speculative_config, method "ngram"):
the proposer on its own; then engines with and without speculation side by side on the
real default model (GGUF blocks with float32 activations, the exact path, and with int8
activations, each forced), on the one-region C step and the module path, and on a tiny
float32-weight model, and on a tiny Q4_K_M-mix file (the K-quants' 16-row layouts): greedy
tokens identical, logprobs equal, sampled tokens from the same
distribution, KV back to empty (the engine core runs in-process, its invariants checked
after every step)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest

from pagellm import LLM, SamplingParams
from pagellm.spec_decode import MAX_STEP_ROWS, NgramProposer

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PASSAGE = ("We hold these truths to be self-evident, that all men are created equal, that they "
           "are endowed by their Creator with certain unalienable Rights, that among these are "
           "Life, Liberty and the pursuit of Happiness.")
PROMPTS = [
    f"Repeat the text exactly.\n\nText: {PASSAGE}\n\nRepeated: {PASSAGE[:40]}",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# -- the proposer -----------------------------------------------------------------------


def test_proposer_takes_the_longest_suffix_and_its_latest_occurrence() -> None:
    p = NgramProposer(2, 4)
    # the 3-gram (2, 3, 4) occurs at 1; the 2-gram (3, 4) also at 6, later: longest wins
    assert p.propose([1, 2, 3, 4, 5, 6, 3, 4, 8, 2, 3, 4], 3) == [5, 6, 3]
    # two occurrences of the 2-gram: the latest one's continuation
    assert p.propose([5, 6, 1, 5, 6, 2, 9, 5, 6], 2) == [2, 9]
    assert p.propose([1, 2, 3, 1, 2], 10) == [3, 1, 2]  # what follows, up to the end
    assert p.propose([1, 2, 3, 4, 1], 3) == []  # a 1-gram is below prompt_lookup_min
    assert p.propose([1, 2, 1, 2], 0) == []
    assert NgramProposer(1, 1).propose([7, 8, 7], 2) == [8, 7]


def test_step_rows_match_the_int8_decode_kernels() -> None:
    from pagellm.model_executor.layers.quantization.gguf import Q8_MAX_ROWS

    assert MAX_STEP_ROWS == Q8_MAX_ROWS


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method must be one of ngram, draft_model; got 'eagle'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer, got 0"),
    ({"method": "ngram"}, "num_speculative_tokens must be a positive integer, got None"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be a positive integer, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown field(s) lookahead"),
])
def test_bad_config_is_refused_before_the_model_loads(config: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        LLM("/nonexistent/model.gguf", speculative_config=config)
    assert message in str(err.value)


# -- engines side by side -------------------------------------------------------------------


def _engine(model: str | None, spec: dict | None, **kwargs) -> LLM:
    args = {"multiprocess_mode": False, "max_num_seqs": 8, **kwargs}
    return LLM(model, speculative_config=spec, **args) if model else LLM(speculative_config=spec, **args)


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def _ids(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def _assert_empty(llm: LLM) -> None:
    sched = _core(llm).scheduler
    assert not sched.has_unfinished_requests()
    kv = sched.kv_cache_manager
    assert kv.req_to_blocks == {}
    assert kv.get_num_free_blocks() == kv.block_pool.num_usable_blocks


def _batched_equal(plain: LLM, spec: LLM, prompts: list, path: str) -> list[list[int]]:
    """Both engines on `path` ("module": the layer-by-layer path, else the C step): the
    prompts batched give the speculating engine plain decoding's greedy tokens (returned)."""
    if path == "module":
        _module_path(plain)
        _module_path(spec)
    want = _ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert _ids(spec.generate(prompts, GREEDY, use_tqdm=False)) == want
    return want


def _module_path(llm: LLM) -> None:
    """The model's layers one at a time from Python, not the one-region C step."""
    model = _core(llm).model_runner.model.model
    model.fused_decode, model._fused_checked = None, True


@pytest.fixture(autouse=True)
def _invariants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGELLM_CHECK_INVARIANTS", "1")


@pytest.mark.parametrize("activations", ["float32", "q8"])
@pytest.mark.parametrize("path", ["c_step", "module"])
def test_greedy_tokens_identical(activations: str, path: str) -> None:
    """Alone and batched, n > 1, stop strings and max_tokens inside an accepted run."""
    plain, spec = _engine(None, None, gguf_activations=activations), _engine(None, SPEC, gguf_activations=activations)
    try:
        _batched_equal(plain, spec, PROMPTS, path)
        for prompt in PROMPTS:  # alone: 4 proposals a step, not 3 (the batch's share)
            alone = _ids(plain.generate(prompt, GREEDY, use_tqdm=False))
            assert _ids(spec.generate(prompt, GREEDY, use_tqdm=False)) == alone
        totals = _core(spec).scheduler.spec_totals
        assert totals.num_drafts > 0 and 0 < totals.num_accepted_tokens < totals.num_draft_tokens

        odd = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 7, 13)]
        assert _ids(spec.generate(PROMPTS, odd, use_tqdm=False)) == _ids(plain.generate(PROMPTS, odd, use_tqdm=False))
        assert [len(t) for t in _ids(spec.generate(PROMPTS, odd, use_tqdm=False))] == [1, 2, 7, 13]

        stop = SamplingParams(temperature=0.0, max_tokens=60, stop=["Happiness", "\n\n"], n=2)
        a, b = plain.generate(PROMPTS, stop, use_tqdm=False), spec.generate(PROMPTS, stop, use_tqdm=False)
        assert [[c.text for c in o.outputs] for o in b] == [[c.text for c in o.outputs] for o in a]
        assert [[c.finish_reason for c in o.outputs] for o in b] == [[c.finish_reason for c in o.outputs] for o in a]
        assert _ids(b) == _ids(a)
        _assert_empty(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


def test_logprobs_equal_and_prefix_cache_hits() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)
    plain, spec = _engine(None, None, gguf_activations="float32"), _engine(None, SPEC, gguf_activations="float32")
    try:
        for _ in range(2):  # the second runs hit the prefix cache (the prompt's last token
            # recomputed alone: numbers of their own, so each engine's second run is compared)
            a = plain.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
            out = spec.generate(PROMPTS[0], params, use_tqdm=False)[0]
            b = out.outputs[0]
            assert b.token_ids == a.token_ids
            assert [sorted(d) for d in b.logprobs] == [sorted(d) for d in a.logprobs]
            for da, db in zip(a.logprobs, b.logprobs):
                for t in da:
                    assert (db[t].logprob, db[t].rank) == (da[t].logprob, da[t].rank)
        assert out.num_cached_tokens > 0
        assert _core(spec).scheduler.spec_totals.num_accepted_tokens > 0
        _assert_empty(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


def test_preemption_keeps_greedy_tokens() -> None:
    """A pool too small for the batch (exact path: a recomputed token gives the numbers
    it first gave, see tests/entrypoints/test_llm.py)."""
    kwargs = {"gguf_activations": "float32", "num_gpu_blocks_override": 14, "block_size": 16,
              "max_model_len": 160}
    _assert_preempted_alike(_engine(None, None, **kwargs), _engine(None, SPEC, **kwargs), PROMPTS)


def _assert_preempted_alike(plain: LLM, spec: LLM, prompts: list,
                            assert_empty: Callable[[LLM], None] | None = None) -> None:
    """`prompts` through both engines greedily (48 tokens each): the same tokens, `spec`
    preempted on the way and accepting proposals, its KV empty after (`assert_empty`,
    default _assert_empty). Shuts both engines down."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    try:
        want = _ids(plain.generate(prompts, params, use_tqdm=False))
        assert _ids(spec.generate(prompts, params, use_tqdm=False)) == want
        sched = _core(spec).scheduler
        assert sched.num_preemptions_total > 0 and sched.spec_totals.num_accepted_tokens > 0
        (assert_empty or _assert_empty)(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


def test_float32_weights_identical(tiny_model: Callable[..., str]) -> None:
    path = tiny_model("llama")
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [100, 200, 300, 100, 200], [42] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain, spec = _engine(path, None), _engine(path, SPEC)
    try:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        assert _ids(spec.generate(inputs, params, use_tqdm=False)) == _ids(plain.generate(inputs, params, use_tqdm=False))
        assert _core(spec).scheduler.spec_totals.num_drafts > 0
        _assert_empty(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


def _chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of a two-sample chi-square test that a and b count draws of one distribution."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b))
    return float(chi2_contingency([[a[k] for k in keys], [b[k] for k in keys]]).pvalue)


def test_sampled_tokens_follow_the_same_distribution() -> None:
    """Seeded samples (top-3 at temperature 1) of the 2nd and 3rd token after a prompt
    whose n-grams propose likely tokens: speculation accepts some proposals and rejects
    others, and the token counts match those without it (chi-square, fixed seeds, so the
    test draws the same samples every run)."""
    prompt = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s) for s in range(600)]
    plain, spec = _engine(None, None, max_num_seqs=4), _engine(None, {**SPEC, "prompt_lookup_min": 1}, max_num_seqs=4)
    try:
        a = _ids(plain.generate([prompt] * len(params), params, use_tqdm=False))
        b = _ids(spec.generate([prompt] * len(params), params, use_tqdm=False))
        totals = _core(spec).scheduler.spec_totals
        assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
        for pos in (1, 2):
            ca, cb = Counter(t[pos] for t in a), Counter(t[pos] for t in b)
            assert len(ca) > 1
            assert _chi_square_p(ca, cb) > 1e-3, (pos, ca, cb)
        # the seeded runs repeat exactly
        assert _ids(spec.generate([prompt] * 8, params[:8], use_tqdm=False)) == b[:8]
        _assert_empty(spec)
    finally:
        plain.shutdown()
        spec.shutdown()
    assert not math.isnan(_chi_square_p(Counter([1, 2]), Counter([1, 2])))


def test_a_prompt_finishing_beside_verify_runs_keeps_its_tokens() -> None:
    """Two requests verifying 7 proposals each (16 decode rows) while a third one's prompt
    finishes in the same step: 17 logits rows, taken in calls of 16 so that every row gets
    the logits it gets without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    outputs = []
    for config in (None, spec):
        llm = _engine(None, config)
        engine = llm.llm_engine
        try:
            engine.add_request("a", PROMPTS[1], params)
            engine.add_request("b", PROMPTS[1].replace("1, 2", "6, 7"), params)
            done: dict[str, list[int]] = {}
            for step in range(200):
                if step == 3:
                    engine.add_request("c", PROMPTS[2], params)
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = list(out.outputs[0].token_ids)
                if not engine.has_unfinished_requests():
                    break
            outputs.append(done)
            if config is not None:
                assert _core(llm).scheduler.spec_totals.num_draft_tokens >= 14
        finally:
            llm.shutdown()
    assert outputs[1] == outputs[0] and len(outputs[0]) == 3


@pytest.mark.parametrize("path", ["c_step", "module"])
def test_greedy_tokens_identical_on_k_quants(q4_k_m_file: str, path: str) -> None:
    """A tiny Llama in Q4_K_M's mix on the int8 path (its Q4_K and Q6_K linears repacked
    sixteen rows at a time where that path runs on AVX-512 VNNI, the file's layouts
    elsewhere): verify runs of up to 5 rows give the tokens plain decoding gives, alone and
    batched, and the KV cache empties."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, {"prompt_token_ids": [40, 41, 42, 40, 41, 42, 40, 41]},
               {"prompt_token_ids": list(range(100, 130))}]
    plain = _engine(q4_k_m_file, None, gguf_activations="q8")
    spec = _engine(q4_k_m_file, SPEC, gguf_activations="q8")
    try:
        want = _batched_equal(plain, spec, prompts, path)
        for prompt, alone in zip(prompts, want):
            assert _ids(spec.generate(prompt, GREEDY, use_tqdm=False)) == [alone]
        totals = _core(spec).scheduler.spec_totals
        assert totals.num_drafts > 0 and totals.num_accepted_tokens > 0
        _assert_empty(spec)
    finally:
        plain.shutdown()
        spec.shutdown()
