"""Scheduler without a model: a fake runner samples deterministic tokens; invariants are
checked after every operation."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.core.kv_cache.hashing import get_request_block_hasher
from pagellm.core.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
)
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.scheduler import Scheduler
from pagellm.outputs import LogprobsLists, ModelRunnerOutput
from pagellm.sampling_params import SamplingParams
from pagellm.scheduler_output import SchedulerOutput

# -- helpers ------------------------------------------------------------------------------


def make_scheduler(
    num_blocks: int = 1000,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 2048,
    chunked: bool = True,
    policy: str = "fcfs",
    caching: bool = True,
) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            policy=policy,
        ),
        CacheConfig(
            block_size=block_size, enable_prefix_caching=caching, num_gpu_blocks=num_blocks
        ),
    )
    sched.check_invariants()
    return sched


def make_request(
    req_id: str,
    prompt: int | list[int],
    block_size: int = 16,
    priority: int = 0,
    arrival: float | None = None,
    client_index: int = 0,
    **params: object,
) -> Request:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    params.setdefault("max_tokens", 4)
    return Request(
        req_id,
        tokens,
        SamplingParams(**params),  # type: ignore[arg-type]
        arrival_time=arrival,
        priority=priority,
        block_hasher=get_request_block_hasher(block_size),
        client_index=client_index,
    )


def default_token(req_id: str, output_index: int) -> int:
    return 1000 + output_index


@dataclass
class _Row:
    token_ids: list[int]
    num_prompt: int
    num_computed: int
    block_ids: list[int]


class FakeRunner:
    """Keeps its own rows from the SchedulerOutput diffs (as a real runner would), checks
    them against the contract, and samples ``token_fn(req_id, output_index)`` for every
    request whose scheduled tokens reach the end of its known tokens."""

    def __init__(self, block_size: int = 16, token_fn: Callable[[str, int], int] = default_token):
        self.block_size = block_size
        self.token_fn = token_fn
        self.rows: dict[str, _Row] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.rows.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            tokens = new.prompt_token_ids + new.output_token_ids
            self.rows[new.req_id] = _Row(
                tokens, len(new.prompt_token_ids), new.num_computed_tokens, list(new.block_ids)
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            row = self.rows[req_id]
            assert row.num_computed == cached.num_computed_tokens[i]
            row.block_ids += cached.new_block_ids[i]
        req_ids, sampled = [], []
        for req_id, num in so.num_scheduled_tokens.items():
            row = self.rows[req_id]
            row.num_computed += num
            assert row.num_computed <= len(row.token_ids)
            assert len(row.block_ids) * self.block_size >= row.num_computed
            assert 0 not in row.block_ids  # the null block
            tokens: list[int] = []
            if row.num_computed == len(row.token_ids):
                tok = self.token_fn(req_id, len(row.token_ids) - row.num_prompt)
                row.token_ids.append(tok)
                tokens = [tok]
            req_ids.append(req_id)
            sampled.append(tokens)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(
    sched: Scheduler, runner: FakeRunner
) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
    so = sched.schedule()
    sched.check_invariants()
    outs = sched.update_from_output(so, runner.execute(so))
    sched.check_invariants()
    return so, outs


def outputs_by_id(outs: dict[int, EngineCoreOutputs]) -> dict[str, EngineCoreOutput]:
    return {o.request_id: o for eco in outs.values() for o in eco.outputs}


def run_to_completion(
    sched: Scheduler, runner: FakeRunner, max_steps: int = 1000
) -> tuple[dict[str, list[int]], dict[str, EngineCoreOutput], list[SchedulerOutput]]:
    tokens: dict[str, list[int]] = {}
    final: dict[str, EngineCoreOutput] = {}
    history = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so, outs = step(sched, runner)
        history.append(so)
        for req_id, out in outputs_by_id(outs).items():
            tokens.setdefault(req_id, []).extend(out.new_token_ids)
            if out.finished:
                final[req_id] = out
    assert not sched.has_unfinished_requests(), "did not finish"
    return tokens, final, history


def add(sched: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        sched.add_request(r)
        sched.check_invariants()


# -- token budget -------------------------------------------------------------------------


def test_token_budget_splits_a_long_prompt_into_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner()
    add(sched, make_request("a", 100, max_tokens=2))
    chunks = []
    sampled = []
    for _ in range(6):
        so, outs = step(sched, runner)
        chunks.append(so.num_scheduled_tokens.get("a", 0))
        sampled.append(outputs_by_id(outs).get("a"))
    assert chunks == [32, 32, 32, 4, 1, 0]
    # Only the step that completes the prompt samples; partial chunks emit nothing.
    assert sampled[:3] == [None, None, None]
    assert sampled[3] is not None and sampled[3].new_token_ids == [1000]
    assert sampled[4] is not None and sampled[4].finish_reason == FinishReason.LENGTH


def test_decodes_are_scheduled_before_new_prefills() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner()
    add(sched, make_request("a", 10, max_tokens=10))
    step(sched, runner)
    add(sched, make_request("b", 100))
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 31)]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    assert so.scheduled_cached_reqs.req_ids == ["a"]


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner()
    add(sched, *(make_request(f"r{i}", 8) for i in range(5)))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    assert sched.get_request_counts() == (2, 3)
    first = outputs_by_id(sched.update_from_output(so, runner.execute(so)))
    assert {rid: o.new_token_ids for rid, o in first.items()} == {"r0": [1000], "r1": [1000]}
    tokens, _, history = run_to_completion(sched, runner)
    assert all(len(so.num_scheduled_tokens) <= 2 for so in history)
    expected = {"r0": 3, "r1": 3, "r2": 4, "r3": 4, "r4": 4}  # r0, r1 sampled once above
    assert {rid: len(t) for rid, t in tokens.items()} == expected


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, chunked=False)
    runner = FakeRunner()
    # Different prompts (a shared one would hit the prefix cache and fit).
    add(sched, make_request("a", 40), make_request("b", list(range(100, 140))))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 40}
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 40}


# -- preemption ---------------------------------------------------------------------------


def test_preemption_when_blocks_run_out_then_resume() -> None:
    # 4 usable blocks of 4 tokens; two 4-token prompts with 6 output tokens each.
    # Both grow to 2 blocks; at 9 tokens each needs a 3rd: the newest (b) is preempted.
    sched = make_scheduler(num_blocks=5, block_size=4, caching=False)
    runner = FakeRunner(block_size=4)
    add(sched, make_request("a", [1, 2, 3, 4], 4, max_tokens=6))
    add(sched, make_request("b", [5, 6, 7, 8], 4, max_tokens=6))
    for _ in range(5):
        so, _ = step(sched, runner)
        assert so.preempted_req_ids == set()
    so, outs = step(sched, runner)  # step 6
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}
    assert outputs_by_id(outs)["a"].finish_reason == FinishReason.LENGTH
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.num_preemptions_total == 1

    so, outs = step(sched, runner)  # step 7: b comes back as a new request
    (resumed,) = so.scheduled_new_reqs
    assert resumed.req_id == "b"
    assert resumed.output_token_ids == [1000, 1001, 1002, 1003, 1004]
    assert resumed.num_computed_tokens == 0 and so.num_scheduled_tokens == {"b": 9}
    out = outputs_by_id(outs)["b"]
    assert out.new_token_ids == [1005] and out.finish_reason == FinishReason.LENGTH
    assert sched.kv_cache_manager.get_num_free_blocks() == 4
    assert not sched.has_unfinished_requests()


def test_resumed_request_hits_its_own_blocks_in_the_prefix_cache() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, caching=True)
    runner = FakeRunner(block_size=4)
    add(sched, make_request("a", [1, 2, 3, 4], 4, max_tokens=6))
    add(sched, make_request("b", [5, 6, 7, 8], 4, max_tokens=6))
    queries = hits = 0
    for _ in range(6):
        so, outs = step(sched, runner)
        queries += sum(o.scheduler_stats.prefix_cache_queries for o in outs.values() if o.scheduler_stats)
    assert so.preempted_req_ids == {"b"}
    so, outs = step(sched, runner)
    # b's tail block was evicted to let a grow; its head block [5, 6, 7, 8] survived.
    (resumed,) = so.scheduled_new_reqs
    assert resumed.num_computed_tokens == 4 and so.num_scheduled_tokens == {"b": 5}
    assert sched.requests == {} and sched.kv_cache_manager.get_num_free_blocks() == 4
    # the hit rate counts each request's first admission only, not its recomputation
    queries += sum(o.scheduler_stats.prefix_cache_queries for o in outs.values() if o.scheduler_stats)
    hits += sum(o.scheduler_stats.prefix_cache_hits for o in outs.values() if o.scheduler_stats)
    assert (queries, hits) == (8, 0)


def test_tiny_pool_every_request_finishes_and_all_blocks_return() -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], Scheduler]:
        sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16)
        runner = FakeRunner(block_size=4, token_fn=lambda rid, i: 100 * int(rid[1:]) + i)
        add(sched, *(make_request(f"r{i}", 6 + i, 4, max_tokens=10) for i in range(6)))
        tokens, final, _ = run_to_completion(sched, runner)
        assert all(out.finish_reason == FinishReason.LENGTH for out in final.values())
        return tokens, sched

    reference, roomy = run(num_blocks=200)
    assert roomy.num_preemptions_total == 0
    tokens, tiny = run(num_blocks=9)  # 8 usable blocks: 2 requests' worth at most
    assert tiny.num_preemptions_total > 0
    assert tokens == reference
    assert all(len(t) == 10 for t in tokens.values()) and len(tokens) == 6
    pool = tiny.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert tiny.kv_cache_manager.req_to_blocks == {}


def test_preempted_event_and_stats() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, caching=False)
    runner = FakeRunner(block_size=4)
    add(sched, make_request("a", 4, 4, max_tokens=6), make_request("b", 4, 4, max_tokens=6))
    events: dict[str, list[EngineCoreEventType]] = {}
    preemptions = 0
    for _ in range(7):
        _, outs = step(sched, runner)
        stats = outs[0].scheduler_stats
        assert stats is not None
        preemptions += stats.num_preemptions
        for o in outputs_by_id(outs).values():
            events.setdefault(o.request_id, []).extend(e.type for e in o.events or [])
    assert preemptions == 1
    Q, S, P = (
        EngineCoreEventType.QUEUED,
        EngineCoreEventType.SCHEDULED,
        EngineCoreEventType.PREEMPTED,
    )
    assert events == {"a": [Q, S], "b": [Q, S, P, S]}


# -- priority -----------------------------------------------------------------------------


def test_priority_policy_serves_lower_priority_value_first_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    runner = FakeRunner()
    add(
        sched,
        make_request("late", 4, priority=5, arrival=1.0),
        make_request("urgent", 4, priority=1, arrival=2.0),
        make_request("mid_b", 4, priority=3, arrival=4.0),
        make_request("mid_a", 4, priority=3, arrival=3.0),
    )
    order = []
    for _ in range(40):
        so, _ = step(sched, runner)
        order += [r.req_id for r in so.scheduled_new_reqs]
    assert order == ["urgent", "mid_a", "mid_b", "late"]


def test_fcfs_ignores_priority() -> None:
    sched = make_scheduler(max_num_seqs=1)
    add(sched, make_request("first", 4, priority=9), make_request("second", 4, priority=0))
    so = sched.schedule()
    assert [r.req_id for r in so.scheduled_new_reqs] == ["first"]


def test_priority_preemption_takes_back_an_already_scheduled_victim() -> None:
    # 3 usable blocks of 4 tokens. x (priority 10) runs first; y (priority 0) joins.
    # When y needs its 2nd block, x, though already scheduled this step, is the victim.
    sched = make_scheduler(num_blocks=4, block_size=4, policy="priority", caching=False)
    runner = FakeRunner(block_size=4)
    add(sched, make_request("x", 3, 4, priority=10, max_tokens=20))
    step(sched, runner)
    add(sched, make_request("y", 3, 4, priority=0, max_tokens=20))
    step(sched, runner)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"x": 1, "y": 1}
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"x"}
    assert so.num_scheduled_tokens == {"y": 1} and so.total_num_scheduled_tokens == 1
    assert so.scheduled_cached_reqs.req_ids == ["y"]
    assert sched.requests["x"].status == RequestStatus.PREEMPTED


# -- stopping -----------------------------------------------------------------------------


def scripted(script: list[int]) -> FakeRunner:
    return FakeRunner(token_fn=lambda rid, i: script[i])


@pytest.mark.parametrize(
    ("params", "script", "expected", "reason", "stop_reason"),
    [
        ({"eos_token_id": 7}, [5, 6, 7, 8], [5, 6, 7], FinishReason.STOP, None),
        (
            {"eos_token_id": 7, "ignore_eos": True, "max_tokens": 5},
            [7, 7, 7, 7, 7, 7],
            [7, 7, 7, 7, 7],
            FinishReason.LENGTH,
            None,
        ),
        ({"stop_token_ids": [6]}, [5, 6, 7, 8], [5, 6], FinishReason.STOP, 6),
        (
            {"eos_token_id": 7, "min_tokens": 3, "stop_token_ids": [6], "max_tokens": 9},
            [7, 6, 5, 7, 9],
            [7, 6, 5, 7],
            FinishReason.STOP,
            None,
        ),
        ({"max_tokens": 3}, [1, 2, 3, 4], [1, 2, 3], FinishReason.LENGTH, None),
        ({"eos_token_id": 7, "max_tokens": 2}, [5, 7], [5, 7], FinishReason.STOP, None),
    ],
    ids=["eos", "ignore_eos", "stop_token_ids", "min_tokens", "max_tokens", "eos_at_limit"],
)
def test_stop_conditions(
    params: dict[str, object],
    script: list[int],
    expected: list[int],
    reason: FinishReason,
    stop_reason: int | None,
) -> None:
    params.setdefault("max_tokens", 10)
    sched = make_scheduler()
    add(sched, make_request("r", 5, **params))
    tokens, final, _ = run_to_completion(sched, scripted(script))
    assert tokens["r"] == expected
    assert final["r"].finish_reason == reason and final["r"].stop_reason == stop_reason
    assert sched.kv_cache_manager.usage == 0.0


def test_context_limit_stops_with_length() -> None:
    sched = make_scheduler(max_model_len=12)
    add(sched, make_request("r", 10, max_tokens=100))
    tokens, final, _ = run_to_completion(sched, FakeRunner())
    assert tokens["r"] == [1000, 1001]
    assert final["r"].finish_reason == FinishReason.LENGTH


def test_prompt_longer_than_max_model_len_is_finished_without_running() -> None:
    sched = make_scheduler(max_model_len=8)
    add(sched, make_request("r", 9))
    assert sched.has_requests() and not sched.has_unfinished_requests()
    so, outs = step(sched, FakeRunner())
    assert so.is_empty
    out = outputs_by_id(outs)["r"]
    assert out.new_token_ids == [] and out.finish_reason == FinishReason.LENGTH
    assert outs[0].finished_requests == ["r"]
    assert not sched.has_requests()


# -- aborts -------------------------------------------------------------------------------


def test_abort_running_and_waiting_requests() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner()
    add(sched, make_request("run", 20, max_tokens=50), make_request("wait", 20))
    step(sched, runner)
    assert sched.kv_cache_manager.get_block_ids("run") != []
    sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert sched.kv_cache_manager.usage == 0.0
    assert not sched.has_unfinished_requests() and sched.has_requests()
    so, outs = step(sched, runner)
    assert so.finished_req_ids == {"run", "wait"} and so.is_empty
    assert outputs_by_id(outs) == {}
    assert outs[0].finished_requests == ["run", "wait"]
    assert not sched.has_requests()


def test_abort_while_step_in_flight_emits_nothing() -> None:
    sched = make_scheduler()
    runner = FakeRunner()
    add(sched, make_request("a", 8, max_tokens=10), make_request("b", 8, max_tokens=10))
    step(sched, runner)
    so = sched.schedule()
    runner_out = runner.execute(so)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    outs = sched.update_from_output(so, runner_out)
    sched.check_invariants()
    assert list(outputs_by_id(outs)) == ["b"]
    so, outs = step(sched, runner)
    assert "a" in so.finished_req_ids and "a" not in so.num_scheduled_tokens
    assert list(outputs_by_id(outs)) == ["b"]


# -- prefix cache, stats, outputs ---------------------------------------------------------


def test_shared_prefix_reports_cached_tokens() -> None:
    sched = make_scheduler()
    runner = FakeRunner()
    prompt = list(range(500, 564))  # 64 tokens
    add(sched, make_request("a", prompt))
    _, outs = step(sched, runner)
    assert outputs_by_id(outs)["a"].num_cached_tokens == 0
    add(sched, make_request("b", prompt))
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens["b"] == 16
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 48
    assert new.block_ids[:3] == sched.kv_cache_manager.get_block_ids("a")[:3]
    assert outputs_by_id(outs)["b"].num_cached_tokens == 48
    stats = outs[0].scheduler_stats
    assert stats is not None
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (64, 48)
    assert stats.num_running_reqs == 2 and stats.num_waiting_reqs == 0


def test_reset_prefix_cache_only_when_idle() -> None:
    sched = make_scheduler()
    runner = FakeRunner()
    add(sched, make_request("a", 40))
    step(sched, runner)
    assert sched.reset_prefix_cache() is False
    run_to_completion(sched, runner)
    assert sched.reset_prefix_cache() is True
    sched.check_invariants()


def test_outputs_grouped_by_client_with_stats_on_one() -> None:
    sched = make_scheduler()
    add(sched, make_request("a", 4, client_index=0), make_request("b", 4, client_index=1))
    _, outs = step(sched, FakeRunner())
    assert sorted(outs) == [0, 1]
    assert [o.request_id for o in outs[1].outputs] == ["b"]
    assert outs[0].scheduler_stats is not None and outs[1].scheduler_stats is None


def test_logprobs_are_passed_through() -> None:
    sched = make_scheduler()
    add(sched, make_request("a", 4, logprobs=1))
    so = sched.schedule()
    lp = LogprobsLists([[1000, 3]], [[-0.1, -2.5]], [1])
    runner_out = ModelRunnerOutput(["a"], [[1000]], logprobs={"a": lp})
    out = outputs_by_id(sched.update_from_output(so, runner_out))["a"]
    assert out.new_logprobs == lp


def test_empty_schedule_when_idle() -> None:
    sched = make_scheduler()
    assert not sched.has_requests()
    so, outs = step(sched, FakeRunner())
    assert so.is_empty and outputs_by_id(outs) == {}
    assert sched.get_request_counts() == (0, 0)


def test_scheduler_requires_num_gpu_blocks() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        Scheduler(SchedulerConfig(), CacheConfig())


def test_request_outgrowing_the_whole_pool_finishes_instead_of_looping() -> None:
    # 3 usable blocks of 4 tokens hold 12 tokens; the 13th needs a 4th block.
    sched = make_scheduler(num_blocks=4, block_size=4, caching=False)
    add(sched, make_request("r", 8, 4, max_tokens=50))
    tokens, final, _ = run_to_completion(sched, FakeRunner(block_size=4), max_steps=20)
    assert tokens["r"] == [1000, 1001, 1002, 1003, 1004]  # 8 + 5 = 13 tokens known
    assert final["r"].finish_reason == FinishReason.LENGTH
    assert sched.num_preemptions_total == 0 and sched.kv_cache_manager.usage == 0.0


def test_prompt_larger_than_the_pool_finishes_without_chunking() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, chunked=False, caching=False)
    add(sched, make_request("big", 16, 4), make_request("small", 4, 4, max_tokens=2))
    tokens, final, _ = run_to_completion(sched, FakeRunner(block_size=4), max_steps=20)
    assert final["big"].finish_reason == FinishReason.LENGTH and tokens["big"] == []
    assert tokens["small"] == [1000, 1001]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked", [True, False])
def test_random_workload_with_aborts(policy: str, chunked: bool) -> None:
    """Tiny pool, shared prefixes, random aborts: invariants hold after every operation,
    aborted requests go silent, every other request gets exactly its tokens."""
    rng = random.Random(f"{policy}-{chunked}")
    sched = make_scheduler(
        num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=32, chunked=chunked, policy=policy,
    )  # fmt: skip
    runner = FakeRunner(block_size=4, token_fn=lambda rid, i: 50 + (i * 7 + len(rid)) % 11)
    max_tokens: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    aborted: set[str] = set()
    finished: set[str] = set()
    for step_index in range(400):
        if step_index < 120 and rng.random() < 0.4:
            rid = f"q{len(max_tokens)}"
            prompt = [rng.choice([1, 2]) for _ in range(rng.randint(1, 20))]
            max_tokens[rid] = rng.randint(1, 12)
            add(
                sched,
                make_request(
                    rid, prompt, 4, priority=rng.randint(0, 3), max_tokens=max_tokens[rid]
                ),
            )
        if sched.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            sched.check_invariants()
            aborted.add(victim)
        _, outs = step(sched, runner)
        for rid, out in outputs_by_id(outs).items():
            assert rid not in aborted and rid not in finished
            tokens.setdefault(rid, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(rid)
    assert not sched.has_unfinished_requests() and sched.num_preemptions_total > 0
    assert finished | aborted == set(max_tokens) and not finished & aborted
    for rid in finished:
        assert tokens[rid] == [50 + (i * 7 + len(rid)) % 11 for i in range(max_tokens[rid])]
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_a_request_without_max_tokens_is_refused_not_given_one_token() -> None:
    with pytest.raises(ValueError, match="'r' reached the engine core without max_tokens"):
        Request("r", [1, 2, 3], SamplingParams(max_tokens=None))


# -- speculative decoding -------------------------------------------------------------------


def _spec_scheduler(k: int = 4, **kwargs: object) -> Scheduler:
    from pagellm.config import SpeculativeConfig

    sched = make_scheduler(**kwargs)  # type: ignore[arg-type]
    return Scheduler(sched.scheduler_config, sched.cache_config, speculative_config=SpeculativeConfig(
        num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=3))


def _verify_step(sched: Scheduler, picks: dict[str, list[int]]) -> SchedulerOutput:
    """One step whose runner keeps `picks[req]` (a verify run's accepted proposals and its
    own token; a plain decode's one token)."""
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[picks[r] for r in ids]))
    sched.check_invariants()
    return out


def test_proposals_are_scheduled_and_rejected_ones_rolled_back() -> None:
    sched = _spec_scheduler(k=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6]  # suffix (5, 6) occurred at 0: propose 7, 8, 9, 10
    sched.add_request(make_request("a", prompt, max_tokens=50, ignore_eos=True))
    _verify_step(sched, {"a": [7]})  # the prompt; its first token 7
    req = sched.requests["a"]
    assert (req.num_tokens, req.num_computed_tokens) == (10, 9)
    out = _verify_step(sched, {"a": [8, 9, 42]})  # (6, 7) -> 8, 9, 10, 11 proposed; 2 kept
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9, 10, 11]}
    assert out.num_scheduled_tokens == {"a": 5}
    assert req.output_token_ids == [7, 8, 9, 42]
    assert (req.num_tokens, req.num_computed_tokens) == (13, 12)  # the KV of 10, 11 dropped
    assert sched.spec_totals.num_draft_tokens == 4 and sched.spec_totals.num_accepted_tokens == 2
    assert sched.spec_totals.accepted_per_pos == [1, 1, 0, 0]
    # the next run is one past what the last one kept (3), and only where a match exists
    req.append_output_token_ids([5, 6])  # the runner's picks would be these: (5, 6) -> 7, 8, 9
    req.num_computed_tokens += 2
    out = _verify_step(sched, {"a": [7, 8, 9, 10]})
    assert out.scheduled_spec_decode_tokens == {"a": [7, 8, 9]}
    assert (req.num_tokens, req.num_computed_tokens) == (19, 18)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert sched.kv_cache_manager.get_num_free_blocks() == sched.kv_cache_manager.block_pool.num_usable_blocks


def test_proposals_stop_at_max_tokens_and_share_the_step_rows() -> None:
    sched = _spec_scheduler(k=8)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    sched.add_request(make_request("a", prompt, max_tokens=3, ignore_eos=True))
    _verify_step(sched, {"a": [3]})
    out = _verify_step(sched, {"a": [4, 5]})  # 2 outputs left: one proposal at most
    assert out.scheduled_spec_decode_tokens == {"a": [4]}
    assert sched.requests == {}  # max_tokens reached inside the run
    # 6 decoding requests: (16 - 6) // 6 = 1 proposal each
    for i in range(6):
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=20, ignore_eos=True))
    _verify_step(sched, {f"r{i}": [3] for i in range(6)})
    out = _verify_step(sched, {f"r{i}": [4, 5] for i in range(6)})
    assert out.scheduled_spec_decode_tokens == {f"r{i}": [4] for i in range(6)}
