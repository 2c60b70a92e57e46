"""Speculative decoding with a draft model (speculative_config {"model": PATH}, method
"draft_model"): a bad config refused before any weights load; engines with and without
speculation side by side on tiny random-weight models of the default model's vocabulary
(a draft that mostly agrees with the target and one that never does) and on the real
default model drafting for itself: greedy tokens identical, every self-drafted proposal
accepted (counted exactly), sampled tokens from the same distribution, the target's and
the draft's KV back to empty (the engine core runs in-process, its invariants checked
after every step)."""

from __future__ import annotations

import ctypes
import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.spec_decode.draft_model import _common_prefix
from tests.spec_decode.test_ngram_spec_decode import _assert_empty as _assert_target_empty
from tests.spec_decode.test_ngram_spec_decode import _assert_preempted_alike, _core, _engine, _ids

PROMPTS = [
    "Repeat the text exactly.\n\nText: We hold these truths to be self-evident, that all men are "
    "created equal.\n\nRepeated: We hold these",
    "1, 2, 3, 4, 5, 1, 2, 3,",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _spec(draft: str, k: int = 3) -> dict:
    return {"model": draft, "num_speculative_tokens": k}  # method inferred: draft_model


def _assert_empty(llm: LLM) -> None:
    _assert_target_empty(llm)
    drafter = _core(llm).drafter
    if drafter is not None:
        assert drafter.num_used_blocks == 0
        assert len(drafter._free_blocks) == drafter.num_blocks - 1


@pytest.fixture(autouse=True)
def _invariants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGELLM_CHECK_INVARIANTS", "1")


@pytest.fixture(scope="module")
def tiny_pair(tiny_model: Callable[..., str]) -> dict[str, str]:
    """A tiny llama target and two drafts of its vocabulary: 'near' (the same weights, a
    different norm epsilon: agrees but for a few near-ties) and 'far' (other weights, one
    layer: agrees where both repeat a token)."""
    return {"target": tiny_model("llama"), "near": tiny_model("llama", rms_norm_eps=1.0),
            "far": tiny_model("llama", seed=1, num_hidden_layers=1)}


# -- config ------------------------------------------------------------------------------


def test_common_prefix() -> None:
    assert _common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    assert _common_prefix([1, 2], [1, 2, 3]) == 2
    assert _common_prefix([], [1]) == 0
    assert _common_prefix([7], [8]) == 0


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model must name the draft model"),
    ({"model": "/nonexistent/draft.gguf", "num_speculative_tokens": 0},
     "num_speculative_tokens must be a positive integer, got 0"),
    ({"model": "/nonexistent/draft.gguf"}, "num_speculative_tokens must be a positive integer, got None"),
    ({"method": "ngram", "model": "/nonexistent/draft.gguf", "num_speculative_tokens": 2},
     "applies to method 'draft_model'"),
    ({"method": "medusa", "model": "/nonexistent/draft", "num_speculative_tokens": 2},
     "speculative_config.method must be one of ngram, draft_model; got 'medusa'"),
])
def test_bad_config_is_refused_before_the_model_loads(config: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        LLM("/nonexistent/model.gguf", speculative_config=config)
    assert message in str(err.value)


def _no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading any weights fails the test: the errors below must come first."""
    from pagellm.model_executor import loader

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights loaded before the draft model was checked")

    monkeypatch.setattr(loader, "get_model", refuse)


def test_method_inferred_from_model_and_the_draft_config(tiny_pair: dict[str, str]) -> None:
    config = EngineArgs(model=tiny_pair["target"], speculative_config=_spec(tiny_pair["near"], 2),
                        max_model_len=256).create_engine_config()
    spec = config.speculative_config
    assert spec is not None and spec.method == "draft_model" and spec.num_speculative_tokens == 2
    draft = spec.draft_model_config
    assert draft is not None and draft.model_path == tiny_pair["near"]
    assert draft.hf_config.rms_norm_eps == 1.0 and draft.max_model_len == 256
    assert config.model_config.hf_config.rms_norm_eps != 1.0


def test_missing_draft_is_refused(monkeypatch: pytest.MonkeyPatch, tiny_pair: dict[str, str]) -> None:
    _no_weights(monkeypatch)
    with pytest.raises(ValueError, match=r"speculative_config.model: /nonexistent/draft.gguf: no such model"):
        LLM(tiny_pair["target"], speculative_config=_spec("/nonexistent/draft.gguf"), multiprocess_mode=False)


def test_vocabulary_size_mismatch_is_refused(monkeypatch: pytest.MonkeyPatch, tiny_model: Callable[..., str],
                                             tiny_pair: dict[str, str]) -> None:
    wider = tiny_model("llama", vocab_size=49152 + 64)
    _no_weights(monkeypatch)
    with pytest.raises(ValueError, match=r"has a vocabulary of 49216 tokens, the target .* one of 49152"):
        LLM(tiny_pair["target"], speculative_config=_spec(wider), multiprocess_mode=False)


def test_token_id_mismatch_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      tiny_pair: dict[str, str]) -> None:
    """Same vocabulary size, two tokens' ids swapped in the draft's tokenizer."""
    draft = tmp_path / "swapped"
    shutil.copytree(tiny_pair["near"], draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    _no_weights(monkeypatch)
    with pytest.raises(ValueError, match=r"its tokenizer maps tokens to other ids than the target's \(4 \(token, id\)"):
        LLM(tiny_pair["target"], speculative_config=_spec(str(draft)), multiprocess_mode=False)


def test_a_draft_of_a_shorter_context_drafts_within_it(tiny_model: Callable[..., str],
                                                      tiny_pair: dict[str, str]) -> None:
    """vLLM's rule: the draft's max_model_len is the shorter context, and a sequence past
    it is verified without proposals (positions 0 .. 63 here)."""
    short = tiny_model("llama", rms_norm_eps=1.0, max_position_embeddings=64)
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 140))}
    plain = _engine(tiny_pair["target"], None, max_model_len=128)
    spec = _engine(tiny_pair["target"], _spec(short), max_model_len=128)
    try:
        assert _core(spec).drafter.model_config.max_model_len == 64
        assert _ids(spec.generate(prompt, params, use_tqdm=False)) == _ids(plain.generate(prompt, params, use_tqdm=False))
        totals = _core(spec).scheduler.spec_totals
        # 40 prompt tokens: proposals for tokens 41 .. 64 only (the last at position 63)
        assert 0 < totals.num_draft_tokens <= 64 - 41
        _assert_empty(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


def test_draft_kv_is_counted_in_the_budget(tiny_pair: dict[str, str]) -> None:
    """One budget holds both caches: blocks = budget // (target's block + draft's block)."""
    budget = 256 << 10
    plain = _engine(tiny_pair["target"], None, kv_cache_memory_bytes=budget, max_model_len=128)
    spec = _engine(tiny_pair["target"], _spec(tiny_pair["far"]), kv_cache_memory_bytes=budget, max_model_len=128)
    try:
        target_bytes = _core(plain).model_runner.kv_bytes_per_block()
        draft_bytes = _core(spec).drafter.kv_bytes_per_block()
        assert draft_bytes == target_bytes // 2  # the far draft has 1 layer of the target's 2
        assert _core(plain).config.cache_config.num_gpu_blocks == budget // target_bytes
        blocks = budget // (target_bytes + draft_bytes)
        assert _core(spec).config.cache_config.num_gpu_blocks == blocks
        assert _core(spec).drafter.num_blocks == blocks
    finally:
        plain.shutdown()
        spec.shutdown()


# -- engines side by side: tiny models -----------------------------------------------------


def test_greedy_tokens_identical_tiny(tiny_pair: dict[str, str]) -> None:
    """Batched and alone, max_tokens inside an accepted run, n > 1 with stop strings, and
    a prefix-cache hit; a draft that mostly agrees and one that never does."""
    target = tiny_pair["target"]
    plain = _engine(target, None)
    near, far = _engine(target, _spec(tiny_pair["near"])), _engine(target, _spec(tiny_pair["far"]))
    try:
        want = _ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
        for spec in (near, far):
            assert _ids(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
            for prompt, alone in zip(PROMPTS, want):
                assert _ids(spec.generate(prompt, GREEDY, use_tqdm=False)) == [alone]
        near_totals, far_totals = _core(near).scheduler.spec_totals, _core(far).scheduler.spec_totals
        assert 0 < near_totals.num_accepted_tokens < near_totals.num_draft_tokens
        assert near_totals.num_accepted_tokens > near_totals.num_draft_tokens * 0.8
        assert far_totals.num_draft_tokens > 0 and far_totals.num_accepted_tokens < far_totals.num_draft_tokens * 0.5

        odd = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 7, 13)]
        got = _ids(near.generate(PROMPTS, odd, use_tqdm=False))
        assert got == _ids(plain.generate(PROMPTS, odd, use_tqdm=False))
        assert [len(t) for t in got] == [1, 2, 7, 13]

        # a stop string from inside the plain engine's own output
        text = plain.generate(PROMPTS[3], GREEDY, use_tqdm=False)[0].outputs[0].text
        stop = SamplingParams(temperature=0.0, max_tokens=30, stop=[text[len(text) // 2:][:3]], n=2)
        a, b = plain.generate(PROMPTS, stop, use_tqdm=False), near.generate(PROMPTS, stop, use_tqdm=False)
        assert [[c.text for c in o.outputs] for o in b] == [[c.text for c in o.outputs] for o in a]
        assert [[c.finish_reason for c in o.outputs] for o in b] == [[c.finish_reason for c in o.outputs] for o in a]
        assert "stop" in [c.finish_reason for c in b[3].outputs]
        assert _ids(b) == _ids(a)

        lp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
        a, b = plain.generate(PROMPTS[1], lp, use_tqdm=False), near.generate(PROMPTS[1], lp, use_tqdm=False)
        assert [{t: (x.logprob, x.rank) for t, x in d.items()} for d in b[0].outputs[0].logprobs] == [
            {t: (x.logprob, x.rank) for t, x in d.items()} for d in a[0].outputs[0].logprobs]

        cached = near.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]  # its prompt ran above
        assert cached.num_cached_tokens > 0 and list(cached.outputs[0].token_ids) == want[0]
        for spec in (near, far):
            _assert_empty(spec)
    finally:
        for llm in (plain, near, far):
            llm.shutdown()


def test_preemption_keeps_greedy_tokens_tiny(tiny_pair: dict[str, str]) -> None:
    """A pool too small for the batch: requests are preempted (their draft KV freed and
    drafted again when they resume) and the tokens stay the same."""
    kwargs = {"num_gpu_blocks_override": 12, "block_size": 16, "max_model_len": 160}
    _assert_preempted_alike(_engine(tiny_pair["target"], None, **kwargs),
                            _engine(tiny_pair["target"], _spec(tiny_pair["near"]), **kwargs),
                            PROMPTS, _assert_empty)


def test_a_request_short_of_draft_blocks_proposes_nothing(tiny_pair: dict[str, str]) -> None:
    """The draft's pool is as large as the target's, but shares no prefix blocks: a
    request it cannot hold proposes nothing (proposals are optional), and one it can
    still does; rejected proposals roll its cache back."""
    from pagellm.spec_decode.draft_model import DraftRequest

    llm = _engine(tiny_pair["target"], _spec(tiny_pair["near"]), num_gpu_blocks_override=6,
                  block_size=16, max_model_len=64)
    drafter = _core(llm).drafter
    try:
        assert len(drafter._free_blocks) == 5
        small = DraftRequest("small", list(range(100, 120)), 19, 3)  # 20 + 3 - 1 positions: 2 blocks
        big = DraftRequest("big", list(range(200, 250)), 49, 3)  # 52 positions: 4 blocks, 3 left
        out = drafter.propose([small, big])
        assert "big" in drafter._states and drafter._states["big"].blocks == []
        assert list(out) == ["small"] and len(out["small"]) == 3
        assert drafter.num_used_blocks == 2 and drafter._states["small"].fed == small.token_ids + out["small"][:2]
        # the target kept the first proposal and sampled another token after it
        other = (out["small"][1] + 1) % 1000
        again = drafter.propose([DraftRequest("small", small.token_ids + [out["small"][0], other], 19, 2)])
        assert drafter._states["small"].fed[:22] == small.token_ids + [out["small"][0], other]
        assert len(again["small"]) == 2
        drafter.keep_only(set())
        assert drafter.num_used_blocks == 0 and len(drafter._free_blocks) == 5
    finally:
        llm.shutdown()


def test_abort_frees_the_draft_kv(tiny_pair: dict[str, str]) -> None:
    llm = _engine(tiny_pair["target"], _spec(tiny_pair["near"]))
    engine = llm.llm_engine
    try:
        engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        for _ in range(4):
            engine.step()
        assert _core(llm).drafter.num_used_blocks > 0
        engine.abort_request(["a"])
        assert _core(llm).drafter.num_used_blocks == 0
        while engine.has_unfinished_requests():
            engine.step()
        _assert_empty(llm)
    finally:
        llm.shutdown()


# -- the real default model drafting for itself ------------------------------------------------


def _self_drafted_counts(max_tokens: int, k: int) -> tuple[int, int]:
    """(verify runs, proposals) of one request whose every proposal is accepted: the
    prompt's step samples one token, then each step k proposals and one token after them,
    the last step's proposals cut to what max_tokens leaves."""
    runs = proposals = 0
    left = max_tokens - 1
    while left > 1:
        n = min(k, left - 1)
        runs, proposals, left = runs + 1, proposals + n, left - n - 1
    return runs, proposals


def _module_path(llm: LLM) -> None:
    """The target's and the draft's layers one at a time from Python, not the one-region C step."""
    core = _core(llm)
    for model in (core.model_runner.model.model, *([core.drafter.model.model] if core.drafter else [])):
        model.fused_decode, model._fused_checked = None, True


@pytest.mark.parametrize(("activations", "path"), [("float32", "c_step"), ("q8", "c_step"), ("q8", "module")])
def test_default_model_drafting_for_itself_accepts_every_proposal(default_model_path: str, activations: str,
                                                                  path: str) -> None:
    """The same model (same file) as target and draft: each proposal is the target's own
    greedy token, so all are accepted: counted exactly, alone and in a batch."""
    k, max_tokens = 4, 40
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = _engine(None, None, gguf_activations=activations)
    spec = _engine(None, _spec(default_model_path, k), gguf_activations=activations)
    try:
        if path == "module":
            _module_path(plain)
            _module_path(spec)
        want = _ids(plain.generate(PROMPTS, params, use_tqdm=False))
        sched = _core(spec).scheduler
        for i, prompt in enumerate(PROMPTS):
            assert _ids(spec.generate(prompt, params, use_tqdm=False)) == [want[i]]
        runs, proposals = _self_drafted_counts(max_tokens, k)
        assert (runs, proposals) == (8, 31)
        totals = sched.spec_totals
        assert (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens) == (
            4 * runs, 4 * proposals, 4 * proposals)
        assert totals.accepted_per_pos == [4 * runs] * 3 + [4 * (runs - 1)]

        # the batch: 4 requests share the step's 16 rows, 3 proposals each (without the
        # prefix cache's hits on the prompts above: a hit's last prompt token, recomputed
        # alone, has numbers of its own on the q8 module path, as without speculation)
        assert _core(spec).reset_prefix_cache()
        assert _ids(spec.generate(PROMPTS, params, use_tqdm=False)) == want
        batch_runs, batch_proposals = _self_drafted_counts(max_tokens, 3)
        assert totals.num_draft_tokens - 4 * proposals == 4 * batch_proposals
        assert totals.num_accepted_tokens == totals.num_draft_tokens
        assert totals.num_drafts == 4 * runs + 4 * batch_runs
        _assert_empty(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


@pytest.fixture
def int8_products_only():
    """The AMX kernels off (pg_amx_on = 0) for an in-process engine: a draft's catch-up run
    (prompt rows) takes the bfloat16 AMX products where the CPU has them, while the
    target decoded those tokens in steps of int8 rows, so a self-draft's proposal can differ
    from the target's token at a near-tie (greedy output stays identical; acceptance is
    then short of 100%, seen 81 of 83 on an AMX Xeon)."""
    from pagellm import kernels

    lib = kernels.load_kernels()
    flag = ctypes.c_int.in_dll(lib, "pg_amx_on") if lib is not None else None
    if flag is not None:
        flag.value = 0
    yield
    if flag is not None:
        flag.value = 1


def test_drafting_resumes_after_a_batch_too_large_to_propose(default_model_path: str, int8_products_only) -> None:
    """18 requests decode without proposals (16 rows a step hold no more) until enough
    finish; then the draft catches up on each survivor's prompt and every token it has
    decoded since, in one run of decode-like rows, and its proposals are all accepted
    (with the int8 products the target's decodes took: int8_products_only)."""
    prompts = [f"{p} {i}" for i in range(5) for p in PROMPTS][:18]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(18)]
    plain = _engine(None, None, max_num_seqs=32)
    spec = _engine(None, _spec(default_model_path, 4), max_num_seqs=32)
    try:
        assert _ids(spec.generate(prompts, params, use_tqdm=False)) == _ids(plain.generate(prompts, params, use_tqdm=False))
        totals = _core(spec).get_spec_decode_totals()
        assert totals["num_drafts"] > 0 and totals["num_accepted_tokens"] == totals["num_draft_tokens"]
        _assert_empty(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


def test_default_model_drafting_in_an_engine_process(default_model_path: str) -> None:
    """The draft config crosses to the engine-core process (LLM's default) and runs there."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = _engine(None, None)
    spec = LLM(speculative_config=_spec(default_model_path, 4))
    try:
        assert _ids(spec.generate(PROMPTS[:2], params, use_tqdm=False)) == _ids(
            plain.generate(PROMPTS[:2], params, use_tqdm=False))
    finally:
        plain.shutdown()
        spec.shutdown()


def _chi_square_p(a: Counter, b: Counter) -> float:
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b))
    return float(chi2_contingency([[a[k] for k in keys], [b[k] for k in keys]]).pvalue)


def test_sampled_tokens_follow_the_same_distribution(tiny_pair: dict[str, str]) -> None:
    """Seeded samples (top-3 at temperature 1) of the 2nd to 4th tokens on the tiny target:
    the near draft proposes its argmax, which the target's sample keeps with about that
    token's probability: some proposals are accepted, others rejected, and the counts match
    those without speculation (chi-square, fixed seeds: the same samples every run)."""
    prompt = "The three primary colors are"
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=s) for s in range(800)]
    plain = _engine(tiny_pair["target"], None, max_num_seqs=4)
    spec = _engine(tiny_pair["target"], _spec(tiny_pair["near"], 3), max_num_seqs=4)
    try:
        a = _ids(plain.generate([prompt] * len(params), params, use_tqdm=False))
        b = _ids(spec.generate([prompt] * len(params), params, use_tqdm=False))
        totals = _core(spec).scheduler.spec_totals
        assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
        for pos in (1, 2, 3):
            ca, cb = Counter(t[pos] for t in a), Counter(t[pos] for t in b)
            assert len(ca) > 1
            assert _chi_square_p(ca, cb) > 1e-3, (pos, ca, cb)
        assert _ids(spec.generate([prompt] * 8, params[:8], use_tqdm=False)) == b[:8]
        _assert_empty(spec)
    finally:
        plain.shutdown()
        spec.shutdown()
