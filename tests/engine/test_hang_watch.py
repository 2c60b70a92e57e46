"""The watchdog over engine cores that stop making progress without dying
(engine_iteration_timeout_s): its rules on a fake clock, a stopped core under LLM, and a
prefill step longer than the timeout that is not a hang (its layers count)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.protocol import heartbeat_frame
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_client import HangWatch
from pagellm.engine.exceptions import EngineDeadError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float, watch: HangWatch, beats: list[tuple[int, int, bool]] = ()) -> list:
        """Moves time on in 0.25 s ticks (the client's check interval), sending `beats`
        (rank, progress, busy) at each tick; returns what the last check found."""
        found = []
        for _ in range(round(seconds / 0.25)):
            self.now += 0.25
            for rank, progress, busy in beats:
                watch.beat(heartbeat_frame(rank, progress, busy))
            found = watch.hung([0, 1])
        return found


def test_silence_is_a_hang_after_the_timeout() -> None:
    clock = Clock()
    watch = HangWatch(5.0, [0, 1], clock)
    assert clock.advance(4.0, watch, [(0, 1, False), (1, 1, False)]) == []
    # rank 1 goes silent (SIGSTOP): found once 5 s have passed since its last heartbeat
    assert clock.advance(5.0, watch, [(0, 1, False)]) == []
    assert clock.advance(0.25, watch, [(0, 1, False)]) == [(1, "hung: no heartbeat for 5 s")]


def test_work_without_progress_is_a_hang_and_progress_or_idleness_is_not() -> None:
    clock = Clock()
    watch = HangWatch(5.0, [0, 1], clock)
    # rank 0 has work and its count moves every tick (a long prefill, a layer at a time);
    # rank 1 is idle with a count that stands still: neither is hung
    beats = [(0, p, True) for p in range(100)]
    for p in range(40):
        assert clock.advance(0.25, watch, [beats[p], (1, 7, False)]) == []
    # rank 0's count stops while it has work: hung once 5 s pass without a move
    assert clock.advance(5.0, watch, [(0, 39, True), (1, 7, False)]) == []
    assert clock.advance(0.25, watch, [(0, 39, True), (1, 7, False)]) == [
        (0, "hung: no progress for 5 s with work to do")]


def test_idle_time_before_work_is_not_counted() -> None:
    clock = Clock()
    watch = HangWatch(5.0, [0, 1], clock)
    assert clock.advance(30.0, watch, [(0, 3, False), (1, 3, False)]) == []
    # work arrives; the count has not moved yet: the clock starts at the first busy beat
    assert clock.advance(4.75, watch, [(0, 3, True), (1, 3, False)]) == []
    assert clock.advance(1.0, watch, [(0, 4, True), (1, 3, False)]) == []


def test_a_late_check_forgives_the_silence_it_caused() -> None:
    """The frontend itself stalled (its loop blocked 20 s): nothing is judged hung for
    heartbeats it did not read; a core that stays silent is found a timeout later."""
    clock = Clock()
    watch = HangWatch(5.0, [0, 1], clock)
    clock.now += 20.0
    assert watch.hung([0, 1]) == []
    assert clock.advance(4.75, watch, [(0, 1, False)]) == []
    assert clock.advance(0.5, watch, [(0, 1, False)]) == [(1, "hung: no heartbeat for 5 s")]


def test_timeout_0_turns_the_watchdog_off_and_restarted_ranks_start_fresh() -> None:
    clock = Clock()
    off = HangWatch(0.0, [0, 1], clock)
    assert clock.advance(60.0, off) == []
    watch = HangWatch(5.0, [0, 1], clock)
    assert clock.advance(5.25, watch, [(0, 1, False)]) == [(1, "hung: no heartbeat for 5 s")]
    watch.reset(1)  # a new process took rank 1 over
    assert clock.advance(4.75, watch, [(0, 1, False)]) == []


@pytest.mark.parametrize(("value", "message"), [
    (0.5, "engine_iteration_timeout_s must be 0 (no watchdog) or at least 1 second, got 0.5."),
    (-1.0, "engine_iteration_timeout_s must be 0 (no watchdog) or at least 1 second, got -1.0."),
    (float("inf"), "engine_iteration_timeout_s must be 0 (no watchdog) or at least 1 second, got inf."),
])
def test_bad_timeouts_are_refused_before_the_model_loads(value: float, message: str) -> None:
    with pytest.raises(ValueError) as e:
        EngineArgs(model="/nonexistent", engine_iteration_timeout_s=value).verify_args()
    assert str(e.value) == message


def test_bad_environment_timeout_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGELLM_ENGINE_ITERATION_TIMEOUT_S", "soon")
    with pytest.raises(ValueError) as e:
        EngineArgs(model="/nonexistent").verify_args()
    assert str(e.value) == "PAGELLM_ENGINE_ITERATION_TIMEOUT_S must be a number of seconds, got 'soon'."
    monkeypatch.setenv("PAGELLM_ENGINE_ITERATION_TIMEOUT_S", "0")
    EngineArgs(model="/nonexistent").verify_args()
    monkeypatch.setenv("PAGELLM_ENGINE_ITERATION_TIMEOUT_S", "7.5")
    assert EngineArgs(model="/nonexistent")._iteration_timeout() == 7.5
    assert EngineArgs(model="/nonexistent", engine_iteration_timeout_s=2)._iteration_timeout() == 2.0


def test_llm_with_a_stopped_engine_core_raises_engine_dead_and_kills_it() -> None:
    llm = LLM(engine_iteration_timeout_s=1)
    (pid,) = llm.llm_engine.engine_core.engine_pids
    try:
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineDeadError) as e:
            llm.generate(["Hello"], SamplingParams(max_tokens=8), use_tqdm=False)
        assert str(e.value) == "Engine core 0 was hung: no heartbeat for 1 s and has been killed."
        assert time.monotonic() - start < 1 + 5
        assert not psutil.pid_exists(pid)  # killed and reaped before the error was raised
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
        llm.llm_engine.engine_core.shutdown()


def test_a_prefill_step_longer_than_the_timeout_is_not_a_hang() -> None:
    """One 4000-token prefill step of the default model (30 layers) takes several seconds
    here; with a 1 s timeout it completes because each layer moves the count."""
    llm = LLM(max_model_len=4096, max_num_batched_tokens=4096, engine_iteration_timeout_s=1)
    try:
        prompt = {"prompt_token_ids": [(i * 7919) % 30000 + 100 for i in range(4000)]}
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        start = time.monotonic()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        took = time.monotonic() - start
        assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"
        if took < 2.5:
            pytest.skip(f"the prefill step took {took:.1f} s: this machine is too fast for it to outlast "
                        "the 1 s timeout")
        (again,) = llm.generate(["Hello"], params, use_tqdm=False)  # the same process still serves
        assert len(again.outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_remote_rank_is_lost_after_its_own_silence_limit_even_with_the_watchdog_off() -> None:
    """Rank 1 runs on another node: no process here to watch, so one second without a
    heartbeat or an output loses it, while the local rank 0 (watchdog off) is never hung."""
    clock = Clock()
    watch = HangWatch(0.0, [0, 1], clock, remote_ranks=[1], remote_timeout=1.0)
    assert clock.advance(0.75, watch, beats=[(1, 5, True)]) == []
    assert clock.advance(0.75, watch) == []  # 0.75 s of silence: within the limit
    watch.alive(1)  # an output counts as a sign of life (heartbeats may queue behind outputs)
    assert clock.advance(1.0, watch) == []
    assert clock.advance(0.25, watch) == [(1, "lost: no heartbeat for 1 s")]
    watch.reset(1)  # a new core of that node joined
    assert clock.advance(0.5, watch) == []
