"""What a bad or unlucky request leaves behind: nothing. Wrongly typed fields are refused
in the caller; a request whose add fails midway leaves no state (the next call works,
the id can be used again); a message the engine core cannot read ends in
EngineDeadError, not a hang; a preempted request resumes exactly where it was (seeded
sampling, prompt logprobs); a late copy of an abort does not hit a new request that
reuses the id; an interrupted generate() (Ctrl-C) ends its own requests."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.engine_core import EngineCore
from pagellm.core.protocol import EngineCoreRequest
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.exceptions import EngineDeadError, EngineGenerateError, EngineRestartingError
from pagellm.sampling_params import RequestOutputKind

PROMPTS = [{"prompt_token_ids": [100 + 37 * i + j for j in range(6)]} for i in range(8)]


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("llama")


def test_wrongly_typed_fields_are_refused_in_the_caller(model) -> None:
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{field} must be an integer, -1 .* got 1.0"):
            SamplingParams(**{field: 1.0})
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    llm = LLM(model, multiprocess_mode=False)
    try:
        with pytest.raises(ValueError, match=r"priority must be an integer, got 0.5"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), priority=[0.5], use_tqdm=False)
        with pytest.raises(ValueError, match=r"data_parallel_rank 3 is out of range \[0, 1\)"):
            llm.llm_engine.input_processor.process_inputs("r", PROMPTS[0], SamplingParams(), data_parallel_rank=3)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def _corrupt_next_request(monkeypatch, processor, field: str, value) -> None:
    """Fault injection: the next processed request gets `field` = `value` after
    validation, as a bug between the checks and the wire would leave it."""
    original = processor.process_inputs

    def process_inputs(*args, **kwargs):
        monkeypatch.setattr(processor, "process_inputs", original)
        request, text = original(*args, **kwargs)
        setattr(request.sampling_params, field, value)
        return request, text

    monkeypatch.setattr(processor, "process_inputs", process_inputs)


def test_a_failed_add_leaves_nothing_behind(model, monkeypatch) -> None:
    llm = LLM(model)  # engine core in its own process: the request must cross the wire
    try:
        _corrupt_next_request(monkeypatch, llm.llm_engine.input_processor, "seed", 2**64)  # cannot be encoded
        with pytest.raises(OverflowError):
            llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=4), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
        out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    finally:
        llm.shutdown()


def test_async_failed_add_frees_the_id_and_unreadable_message_kills_the_core(model, monkeypatch) -> None:
    async def main() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=model))
        try:
            _corrupt_next_request(monkeypatch, engine.input_processor, "seed", 2**64)
            with pytest.raises(EngineGenerateError, match="can't serialize"):
                async for _ in engine.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=4), "r1"):
                    pass
            outs = [o async for o in engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True), "r1")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3

            # encodes, but the core's typed decoder refuses it
            _corrupt_next_request(monkeypatch, engine.input_processor, "logprobs", 1.0)
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate(PROMPTS[1], SamplingParams(max_tokens=4), "r2"):
                    pass
            assert time.monotonic() - start < 30 and engine.errored
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_an_engine_core_that_fails_is_restarted_when_asked(model, monkeypatch) -> None:
    """restart_engine_on_failure: the core that could not read a message reports why and
    exits; the request fails with EngineRestartingError naming the cause, a new core
    takes the rank over, and the next request runs on it."""

    async def main() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=model, restart_engine_on_failure=True))
        try:
            old_pid = engine.engine_core.engine_pids[0]
            _corrupt_next_request(monkeypatch, engine.input_processor, "logprobs", 1.0)
            with pytest.raises(EngineRestartingError, match=r"^The engine core serving this request died "
                               r"\(RuntimeError: the engine core's input thread failed\) and is restarting"):
                async for _ in engine.generate(PROMPTS[1], SamplingParams(max_tokens=4), "r2"):
                    pass
            assert not engine.errored and engine.restarting_engines == [0]
            deadline = time.monotonic() + 60
            while engine.restarting_engines:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            assert engine.engine_core.engine_pids[0] != old_pid
            outs = [o async for o in engine.generate(PROMPTS[2], SamplingParams(max_tokens=3, ignore_eos=True), "r3")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
            assert not engine.output_processor.has_unfinished_requests()
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_preempted_requests_resume_exactly(model) -> None:
    """A small pool preempts (and recomputes) requests; their seeded samples and their
    prompt logprobs must be those of a run without preemption."""
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    roomy = LLM(model, multiprocess_mode=False)
    try:
        expected = roomy.generate(PROMPTS, seeded, use_tqdm=False)
    finally:
        roomy.shutdown()
    small = LLM(model, multiprocess_mode=False, num_gpu_blocks_override=12, block_size=8, max_num_seqs=8,
                max_model_len=88)
    try:
        got = small.generate(PROMPTS, seeded, use_tqdm=False)
        core = small.llm_engine.engine_core.engine_core
        assert core.scheduler.num_preemptions_total > 0
    finally:
        small.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for g, e in zip(got, expected):
        assert len(g.prompt_logprobs) == 6 and g.prompt_logprobs[0] is None
        for a, b in zip(g.prompt_logprobs[1:], e.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)


def test_each_abort_copy_does_its_part(model) -> None:
    """The core gets each abort twice: early (between a forward and its update) and in
    order with the adds. A late copy must not hit a new request that reuses the id; an
    early copy that comes before its request's ADD must not lose the abort. EngineCore
    keeps this bookkeeping; the process shell only passes the copies on."""
    config = EngineArgs(model=model).create_engine_config()
    core = EngineCore(config)

    def request(rid: str) -> EngineCoreRequest:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        params.all_stop_token_ids = []
        return EngineCoreRequest(rid, PROMPTS[0]["prompt_token_ids"], params, time.time())

    try:
        # 1. in-order copy first (aborts the old A), a new A, then the early copy: A lives
        core.add_request(request("A"))
        core.step()
        seq = core.receive_abort(["A"])
        core.abort_in_order(seq, ["A"])
        assert "A" not in core.scheduler.requests
        core.add_request(request("A"))
        core._apply_early_aborts()
        assert "A" in core.scheduler.requests and not core.scheduler.requests["A"].is_finished()
        tokens = []
        while core.scheduler.has_requests():
            outputs, _ = core.step()
            tokens += [t for outs in outputs.values() for o in outs.outputs for t in o.new_token_ids]
        assert len(tokens) == 4
        # 2. ADD then ABORT arrive during a forward: the early copy finds nothing yet, the
        # in-order copy (after the ADD) must still abort it
        seq = core.receive_abort(["B"])
        core._apply_early_aborts()
        core.add_request(request("B"))
        core.abort_in_order(seq, ["B"])
        assert core.scheduler.requests == {}
        pool = core.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
        assert not core._aborts_left and not core._aborts_done  # nothing kept past its use
    finally:
        core.shutdown()


def test_async_duplicate_id_shutdown_and_dp_utilities(model) -> None:
    """A duplicate id (n>1) is refused without touching the running request; shutdown()
    ends streams still waiting; reset_prefix_cache reaches every data-parallel engine."""
    long = SamplingParams(max_tokens=400, ignore_eos=True, n=2, temperature=1.0, seed=3,
                          output_kind=RequestOutputKind.FINAL_ONLY)  # one output with both completions

    async def main() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=model))
        try:
            first = asyncio.ensure_future(_final(engine.generate(PROMPTS[0], long, "X")))
            while "X" not in engine.output_processor.parent_requests:  # added, far from done
                await asyncio.sleep(0)
            with pytest.raises(ValueError, match="Request id 'X' is already in use"):
                await _final(engine.generate(PROMPTS[1], long, "X"))
            out = await first
            assert [c.finish_reason for c in out.outputs] == ["length", "length"]

            streams = [asyncio.ensure_future(_final(engine.generate(PROMPTS[i], long, f"s{i}"))) for i in range(3)]
            while len(engine.output_processor.parent_requests) < 3:
                await asyncio.sleep(0)
            engine.shutdown()
            done = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), timeout=10)
            assert all(isinstance(d, EngineDeadError) for d in done), done
        finally:
            engine.shutdown()

        engine = AsyncLLM.from_engine_args(EngineArgs(model=model, data_parallel_size=2))
        try:
            prompt = {"prompt_token_ids": [100 + j for j in range(40)]}
            one = SamplingParams(max_tokens=1)
            for rank in (0, 1):  # cache the prompt on both engines
                await _final(engine.generate(prompt, one, f"w{rank}", data_parallel_rank=rank))
                hit = await _final(engine.generate(prompt, one, f"h{rank}", data_parallel_rank=rank))
                assert hit.num_cached_tokens == 32
            assert await engine.reset_prefix_cache()
            for rank in (0, 1):
                again = await _final(engine.generate(prompt, one, f"a{rank}", data_parallel_rank=rank))
                assert again.num_cached_tokens == 0, rank
        finally:
            engine.shutdown()

    asyncio.run(main())


async def _final(gen):
    out = None
    async for out in gen:  # noqa: B007 - the last one is the answer
        pass
    return out


@pytest.mark.parametrize("multiprocess", [False, True])
def test_an_interrupted_generate_leaves_the_engine_clean(model, monkeypatch, multiprocess) -> None:
    """Ctrl-C in the middle of LLM.generate (raised here at the third engine step, inside
    the model in-process, in the frontend otherwise): the next call returns its own
    outputs only, the same as an untouched engine, and no KV block stays taken."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(model, multiprocess_mode=multiprocess)
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        calls = 0
        if multiprocess:
            target, name = llm.llm_engine, "step"
        else:
            target, name = llm.llm_engine.engine_core.engine_core.model_runner, "execute_model"
        original = getattr(target, name)

        def interrupted(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 3:
                raise KeyboardInterrupt
            return original(*args, **kwargs)

        monkeypatch.setattr(target, name, interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, params, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
        again = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected[:3]
        if not multiprocess:
            pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
            assert pool.get_num_free_blocks() == pool.num_usable_blocks
    finally:
        llm.shutdown()
