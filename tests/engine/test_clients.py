"""The process split: Inproc / SyncMP / AsyncMP / DPLB clients give the same results;
AsyncLLM streams, aborts and engine death; processes never outlive their owner."""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import pytest_asyncio

from pagellm import LLM, SamplingParams
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.exceptions import EngineDeadError
from pagellm.metrics.loggers import LoggingStatLogger
from pagellm.sampling_params import RequestOutputKind, StructuredOutputsParams

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "The sky is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _engine_children() -> list[psutil.Process]:
    me = psutil.Process()
    return [p for p in me.children(recursive=True) if "engine_core_proc" in " ".join(p.cmdline())]


async def _collect(engine: AsyncLLM, prompt: str, params: SamplingParams, request_id: str):
    final = None
    async for out in engine.generate(prompt, params, request_id):
        final = out
    return final


@pytest.fixture(scope="module")
def reference_tokens() -> list[list[int]]:
    llm = LLM(multiprocess_mode=False)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_sync_mp_client_matches_inproc(reference_tokens) -> None:
    llm = LLM()  # SyncMPClient by default
    try:
        assert type(llm.llm_engine.engine_core).__name__ == "SyncMPClient"
        pids = llm.llm_engine.engine_core.engine_pids
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == reference_tokens
    finally:
        llm.shutdown()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.asyncio
async def test_async_and_dplb_match_inproc(reference_tokens) -> None:
    before = {p.pid for p in _engine_children()}
    for dp in (1, 2):
        stats = LoggingStatLogger(dp)
        engine = AsyncLLM.from_engine_args(EngineArgs(data_parallel_size=dp), stat_loggers=[stats])
        try:
            expected = "AsyncMPClient" if dp == 1 else "DPLBAsyncMPClient"
            assert type(engine.engine_core).__name__ == expected
            results = await asyncio.gather(
                *[_collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)]
            )
            assert [r.outputs[0].token_ids for r in results] == reference_tokens
            if dp == 2:
                outs = await asyncio.gather(*[_collect(engine, PROMPTS[i % 4], GREEDY, f"dp{i}") for i in range(32)])
                assert all(o.finished for o in outs)
                sent = engine.engine_core.requests_sent
                assert sent[0] > 0 and sent[1] > 0 and sent[0] + sent[1] == 36
                # a structured-output constraint crosses the wire to each rank
                choice = SamplingParams(temperature=0, max_tokens=8,
                                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
                for rank in (0, 1):
                    final = None
                    async for out in engine.generate("Is water wet? Answer:", choice, f"so{rank}", data_parallel_rank=rank):
                        final = out
                    assert final.outputs[0].text in ("yes", "no") and final.outputs[0].finish_reason == "stop"
            # each engine's outputs carry its own index (the balancer reads its load by it)
            assert sorted(stats.sched) == list(range(dp))
        finally:
            engine.shutdown()
    assert [p for p in _engine_children() if p.pid not in before] == []


@pytest.mark.asyncio
async def test_external_lb_client_drives_its_one_rank(reference_tokens) -> None:
    engine = AsyncLLM.from_engine_args(
        EngineArgs(data_parallel_size=2, data_parallel_external_lb=True, data_parallel_rank=1)
    )
    try:
        assert type(engine.engine_core).__name__ == "DPAsyncMPClient"
        assert engine.engine_core.ranks == [1] and len(engine.engine_core.engine_pids) == 1
        out = await _collect(engine, PROMPTS[0], GREEDY, "ext0")
        assert out.outputs[0].token_ids == reference_tokens[0]
    finally:
        engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    engine = AsyncLLM.from_engine_args(EngineArgs())
    yield engine
    engine.shutdown()


@pytest.mark.asyncio(loop_scope="module")
async def test_64_streams_delta_equals_final(engine: AsyncLLM) -> None:
    """A DELTA stream's pieces add up to the FINAL_ONLY text of the same request, for 64
    streams at once. The two copies run at different times, so in steps of different
    sizes: on the q8 path a prompt row's numbers depend on its step's size (int8 over 256
    rows, else float32: quantization.gguf.int8_gemm_rows), and at temperature 0.9 a token
    on every logit, so a copy may sample other tokens (seen once in 64). The texts are
    compared where the tokens agree, which must be nearly everywhere."""

    async def one(i: int) -> tuple[str, list[int], str, list[int]]:
        params = dict(temperature=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
        delta, ids = "", []
        async for out in engine.generate(PROMPTS[i % 4], SamplingParams(output_kind=RequestOutputKind.DELTA, **params), f"d{i}"):
            delta += out.outputs[0].text
            ids += out.outputs[0].token_ids
        final = await _collect(engine, PROMPTS[i % 4], SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params), f"f{i}")
        return delta, ids, final.outputs[0].text, list(final.outputs[0].token_ids)

    pairs = await asyncio.gather(*[one(i) for i in range(64)])
    assert len(pairs) == 64
    same = [(delta, final) for delta, ids, final, final_ids in pairs if ids == final_ids]
    assert all(len(ids) == 24 and len(final_ids) == 24 for _, ids, _, final_ids in pairs)
    assert len(same) >= 56, f"only {len(same)} of 64 copies sampled the same tokens"
    for delta, final in same:
        assert delta == final and final


@pytest.mark.asyncio(loop_scope="module")
async def test_abort_frees_blocks_and_spares_others(engine: AsyncLLM) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    short = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    victims = [asyncio.ensure_future(_collect(engine, PROMPTS[i % 4], long, f"victim{i}")) for i in range(10)]
    survivors = [asyncio.ensure_future(_collect(engine, p, short, f"keep{i}")) for i, p in enumerate(PROMPTS)]
    await asyncio.sleep(1.0)
    for i in range(10):
        await engine.abort(f"victim{i}")
    await engine.abort("no-such-request")
    done = await asyncio.gather(*victims)
    assert all(o is None or o.outputs[0].finish_reason in ("abort", None) for o in done)
    kept = await asyncio.gather(*survivors)
    assert all(len(o.outputs[0].token_ids) == 16 for o in kept)
    for _ in range(50):
        stats = await engine.call_utility("get_scheduler_stats")
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
            break
        await asyncio.sleep(0.1)
    assert stats["kv_cache_usage"] == 0.0
    assert await engine.call_utility("run_check_invariants")


@pytest.mark.asyncio
async def test_kill_engine_raises_engine_dead_fast() -> None:
    engine = AsyncLLM.from_engine_args(EngineArgs())
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
        tasks = [asyncio.ensure_future(_collect(engine, PROMPTS[i % 4], params, f"k{i}")) for i in range(4)]
        await asyncio.sleep(0.5)
        os.kill(engine.engine_core.engine_pids[0], signal.SIGKILL)
        start = time.monotonic()
        for t in tasks:
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(t, timeout=5)
        assert time.monotonic() - start < 2.0
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            await _collect(engine, "hi", params, "after")
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        assert engine.errored
    finally:
        engine.shutdown()


def test_startup_failure_raises_with_cause_and_leaves_nothing() -> None:
    before = {p.pid for p in _engine_children()}  # e.g. the module's shared engine
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM("/tmp/does-not-exist/model.gguf")
    with pytest.raises(RuntimeError, match="Engine core initialization failed.*kv_cache_memory_bytes"):
        LLM(kv_cache_memory_bytes=1000)
    assert time.monotonic() - start < 60
    time.sleep(0.2)
    assert [p for p in _engine_children() if p.pid not in before] == []


def test_llm_data_parallel_is_refused_with_advice() -> None:
    with pytest.raises(ValueError, match="one process per rank"):
        LLM(data_parallel_size=2)


def test_compilation_config_normalisation() -> None:
    assert EngineArgs(compilation_config=0).compilation_config.mode == 0
    assert EngineArgs(compilation_config={"mode": 1}).compilation_config.mode == 1
    with pytest.raises(ValueError, match="Invalid 'compilation_config' provided: unknown field"):
        EngineArgs(compilation_config={"level_of_magic": 3})
    with pytest.raises(ValueError, match="Invalid 'compilation_config' provided: field 'mode' must be int"):
        EngineArgs(compilation_config={"mode": "fast"})


def _run_script(code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout)


def test_three_line_script_without_main_guard() -> None:
    result = _run_script(
        """
        from pagellm import LLM; llm = LLM(); print("OUT:" + repr(llm.generate("Hi", use_tqdm=False)[0].outputs[0].text))
        import psutil; print("CHILDREN:", [p.pid for p in psutil.Process().children()])
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = [line for line in result.stdout.splitlines() if line.startswith("OUT:")]
    assert len(out) == 1, result.stdout
    text = ast.literal_eval(out[0][len("OUT:"):])  # repr quotes with " when the text holds a '
    assert isinstance(text, str) and text
    assert "bootstrapping" not in result.stderr


def test_engine_exits_when_parent_is_killed() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from pagellm import LLM; import sys, time; llm = LLM(); print('READY', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engine_gone_after_llm_is_collected() -> None:
    result = _run_script(
        """
        import gc, psutil
        from pagellm import LLM
        llm = LLM()
        pids = llm.llm_engine.engine_core.engine_pids
        del llm; gc.collect()
        import time; time.sleep(0.5)
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        print("ALIVE", alive)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ALIVE []" in result.stdout


def test_llm_claims_a_prestarted_engine_process(reference_tokens) -> None:
    from pagellm.engine import prestart

    prestart.prestart_engine_core()
    waiting = prestart._waiting
    assert waiting is not None and waiting.proc.poll() is None
    llm = LLM()
    try:
        assert prestart._waiting is None
        assert llm.llm_engine.engine_core.engine_pids == [waiting.proc.pid]
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == reference_tokens
    finally:
        llm.shutdown()
    assert waiting.proc.wait(timeout=10) is not None
    assert not os.path.exists(waiting.tmpdir)


def test_unclaimed_prestarted_engine_exits_and_cleans_up() -> None:
    from pagellm.engine import prestart

    prestart.prestart_engine_core()
    waiting = prestart._waiting
    assert waiting is not None and os.path.isdir(waiting.tmpdir)
    assert waiting.proc.stdin is not None
    waiting.proc.stdin.close()  # what a frontend that never claims it leaves: end of file
    assert waiting.proc.wait(timeout=60) == 0  # after its imports, without loading a model
    prestart.discard_prestarted()
    assert prestart._waiting is None
    assert not os.path.exists(waiting.tmpdir)
    assert prestart.claim_prestarted() is None
