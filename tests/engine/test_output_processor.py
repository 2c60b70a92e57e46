"""OutputProcessor on synthetic engine-core output streams: output kinds, n > 1 fan-in,
stop strings (abort + trimming), aborts, logprobs, collectors and iteration stats."""

from __future__ import annotations

from typing import Any

import pytest

from pagellm.core.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
)
from pagellm.engine.output_processor import (
    OutputProcessor,
    ParentRequest,
    RequestOutputCollector,
)
from pagellm.metrics.stats import IterationStats
from pagellm.outputs import CompletionOutput, LogprobsLists, RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

TEXT = "Hello world, how are you today? Fine, thanks."
CUMULATIVE, DELTA, FINAL = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)


def make_request(request_id: str, prompt_ids: list[int], **params: Any) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt_ids, SamplingParams(**params), 1000.0)


def step_outputs(
    request_id: str, token_ids: list[int], finish: FinishReason = FinishReason.LENGTH
) -> list[EngineCoreOutput]:
    """One EngineCoreOutput per token; the last one finishes the request."""
    outs = [EngineCoreOutput(request_id, [t]) for t in token_ids]
    outs[-1].finish_reason = finish
    return outs


def run(processor: OutputProcessor, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
    results = []
    for out in outputs:
        results.extend(processor.process_outputs([out]).request_outputs)
    return results


@pytest.fixture
def text_ids(tokenizer: Any) -> list[int]:
    return tokenizer.encode(TEXT)


def test_cumulative_outputs_grow_token_by_token(tokenizer: Any, text_ids: list[int]) -> None:
    processor = OutputProcessor(tokenizer, log_stats=False)
    processor.add_request(make_request("a", [1, 2], output_kind=CUMULATIVE), "prompt")
    results = run(processor, step_outputs("a", text_ids))
    assert len(results) == len(text_ids)
    for i, result in enumerate(results):
        assert result.outputs[0].token_ids == text_ids[: i + 1]
        assert result.outputs[0].text == tokenizer.decode(text_ids[: i + 1])
        assert result.finished == (i == len(text_ids) - 1)
    final = results[-1]
    assert (final.request_id, final.prompt, final.prompt_token_ids) == ("a", "prompt", [1, 2])
    assert final.outputs[0].finish_reason == "length" and final.outputs[0].text == TEXT
    assert results[0].outputs[0].token_ids == text_ids[:1]  # earlier outputs are not mutated
    assert not processor.has_unfinished_requests()


def test_delta_concatenation_equals_final_only(tokenizer: Any, text_ids: list[int]) -> None:
    texts: dict[RequestOutputKind, list[RequestOutput]] = {}
    for kind in (DELTA, FINAL):
        processor = OutputProcessor(tokenizer, log_stats=False)
        processor.add_request(make_request("a", [1], output_kind=kind, logprobs=1), None)
        texts[kind] = run(processor, step_outputs("a", text_ids))
    deltas, (final,) = texts[DELTA], texts[FINAL]
    assert len(deltas) == len(text_ids)
    assert "".join(d.outputs[0].text for d in deltas) == final.outputs[0].text == TEXT
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.outputs[0].token_ids
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert final.finished and final.outputs[0].finish_reason == "length"


def test_stop_string_aborts_and_trims_surplus_tokens(tokenizer: Any, text_ids: list[int]) -> None:
    processor = OutputProcessor(tokenizer, log_stats=False)
    processor.add_request(make_request("a", [1], stop=["you"]), None)
    # The engine sends three tokens per step; the stop string ends mid-step.
    steps = [EngineCoreOutput("a", text_ids[i : i + 3]) for i in range(0, len(text_ids), 3)]
    results: list[RequestOutput] = []
    aborts: list[str] = []
    for out in steps:
        processed = processor.process_outputs([out])
        results.extend(processed.request_outputs)
        aborts.extend(processed.reqs_to_abort)
    assert aborts == ["a"]
    final = results[-1].outputs[0]
    assert results[-1].finished
    assert (final.finish_reason, final.stop_reason) == ("stop", "you")
    assert final.text == "Hello world, how are "
    you_index = next(
        i for i, t in enumerate(text_ids) if "you" in tokenizer.decode(text_ids[: i + 1])
    )
    assert final.token_ids == text_ids[: you_index + 1]
    assert not processor.has_unfinished_requests()


def test_stop_string_on_engine_finished_step_needs_no_abort(
    tokenizer: Any, text_ids: list[int]
) -> None:
    processor = OutputProcessor(tokenizer, log_stats=False)
    processor.add_request(make_request("a", [1], stop=["world"], output_kind=FINAL), None)
    out = EngineCoreOutput("a", text_ids, finish_reason=FinishReason.LENGTH)
    processed = processor.process_outputs([out])
    assert processed.reqs_to_abort == []
    (result,) = processed.request_outputs
    assert (result.outputs[0].text, result.outputs[0].stop_reason) == ("Hello ", "world")


def test_eos_is_in_token_ids_but_not_in_text(tokenizer: Any, text_ids: list[int]) -> None:
    processor = OutputProcessor(tokenizer, log_stats=False)
    processor.add_request(make_request("a", [1], output_kind=FINAL), None)
    eos = tokenizer.eos_token_id
    (result,) = run(processor, step_outputs("a", [*text_ids[:2], eos], FinishReason.STOP))
    assert result.outputs[0].token_ids == [*text_ids[:2], eos]
    assert result.outputs[0].text == "Hello world"
    assert result.outputs[0].stop_reason is None


def add_parent(
    processor: OutputProcessor, params: SamplingParams, collector: RequestOutputCollector | None
) -> list[str]:
    parent = ParentRequest("p", params)
    child_ids = []
    for index, (child_id, child_params) in enumerate(parent.make_child_requests()):
        request = EngineCoreRequest(child_id, [1], child_params, 1000.0)
        processor.add_request(request, "hi", parent, index, collector)
        child_ids.append(child_id)
    return child_ids


def test_make_child_requests_ids_and_seeds() -> None:
    children = ParentRequest("req", SamplingParams(n=3, seed=10)).make_child_requests()
    assert [c[0] for c in children] == ["0_req", "1_req", "2_req"]
    assert [c[1].seed for c in children] == [10, 11, 12]
    assert all(c[1].n == 1 for c in children)
    unseeded = ParentRequest("req", SamplingParams(n=2)).make_child_requests()
    assert unseeded[0][1] is unseeded[1][1] and unseeded[0][1].seed is None


def test_n2_final_only_fans_in_one_output(tokenizer: Any, text_ids: list[int]) -> None:
    processor = OutputProcessor(tokenizer, log_stats=False)
    params = SamplingParams(n=2, output_kind=FINAL)
    assert add_parent(processor, params, None) == ["0_p", "1_p"]
    a, b = step_outputs("0_p", text_ids[:3]), step_outputs("1_p", text_ids[3:5])
    # Child 1 finishes first; nothing is emitted until both are done.
    results = run(processor, [a[0], *b, a[1], a[2]])
    (result,) = results
    assert result.request_id == "p" and result.finished
    assert [c.index for c in result.outputs] == [0, 1]
    assert result.outputs[0].token_ids == text_ids[:3]
    assert result.outputs[1].token_ids == text_ids[3:5]
    assert not processor.has_unfinished_requests() and not processor.parent_requests


def test_n2_delta_streams_each_child(tokenizer: Any, text_ids: list[int]) -> None:
    processor = OutputProcessor(tokenizer, log_stats=False)
    add_parent(processor, SamplingParams(n=2, output_kind=DELTA), None)
    a, b = step_outputs("0_p", text_ids[:2]), step_outputs("1_p", text_ids[2:4])
    results = run(processor, [a[0], b[0], a[1], b[1]])
    assert [r.outputs[0].index for r in results] == [0, 1, 0, 1]
    assert [r.finished for r in results] == [False, False, False, True]
    merged = results[0]
    for r in results[1:]:
        merged.add(r, aggregate=True)
    assert [c.text for c in merged.outputs] == [
        tokenizer.decode(text_ids[:2]),
        tokenizer.decode(text_ids[2:4]),
    ]


async def test_abort_with_parent_id_aborts_children(tokenizer: Any, text_ids: list[int]) -> None:
    processor = OutputProcessor(tokenizer, log_stats=False)
    collector = RequestOutputCollector(DELTA, "p")
    add_parent(processor, SamplingParams(n=2, output_kind=DELTA), collector)
    processor.process_outputs([EngineCoreOutput("0_p", text_ids[:1])])
    assert (await collector.get()).outputs[0].text == "Hello"
    assert processor.has_request("p") and processor.has_request("1_p")
    assert sorted(processor.abort_requests(["p"])) == ["0_p", "1_p"]
    assert not processor.has_unfinished_requests() and not processor.parent_requests
    assert not processor.has_request("p") and not processor.has_request("0_p")
    final = await collector.get()
    assert final.finished and {c.finish_reason for c in final.outputs} == {"abort"}
    # Late outputs of aborted requests are ignored.
    late = processor.process_outputs([EngineCoreOutput("1_p", text_ids[:1])])
    assert late.request_outputs == [] and collector.get_nowait() is None
    assert processor.abort_requests(["p", "unknown"]) == []


async def test_collector_merges_deltas_when_consumer_lags(
    tokenizer: Any, text_ids: list[int]
) -> None:
    processor = OutputProcessor(tokenizer, log_stats=False)
    collector = RequestOutputCollector(DELTA, "a")
    processor.add_request(make_request("a", [1], output_kind=DELTA), None, collector=collector)
    outs = step_outputs("a", text_ids)
    processor.process_outputs(outs[:3])  # three steps before the consumer wakes up
    first = await collector.get()
    assert first.outputs[0].token_ids == text_ids[:3]
    assert first.outputs[0].text == tokenizer.decode(text_ids[:3])
    assert collector.get_nowait() is None
    processor.process_outputs(outs[3:])
    rest = await collector.get()
    assert rest.finished and first.outputs[0].text + rest.outputs[0].text == TEXT


async def test_collector_cumulative_replaces_and_raises_errors() -> None:
    def output(text: str, finished: bool = False) -> RequestOutput:
        completion = CompletionOutput(0, text, [], None, None)
        return RequestOutput("a", None, [1], None, [completion], finished)

    collector = RequestOutputCollector(CUMULATIVE, "a")
    collector.put(output("a"))
    collector.put(output("ab", finished=True))
    got = await collector.get()
    assert got.outputs[0].text == "ab" and got.finished
    collector.put(RuntimeError("engine died"))
    collector.put(output("late"))
    with pytest.raises(RuntimeError, match="engine died"):
        await collector.get()


def test_propagate_error_reaches_every_queue() -> None:
    processor = OutputProcessor(None, log_stats=False)
    collectors = [RequestOutputCollector(DELTA, rid) for rid in ("a", "b")]
    for rid, collector in zip(("a", "b"), collectors):
        processor.add_request(make_request(rid, [1]), None, collector=collector)
    processor.propagate_error(ValueError("boom"))
    for collector in collectors:
        with pytest.raises(ValueError):
            collector.get_nowait()


def test_fail_requests_ends_exactly_the_lost_ones_and_names_their_siblings(tokenizer: Any) -> None:
    """A dead engine core's requests fail; an n=2 request with one child on the dead core
    fails whole, and its other child is returned for the caller to abort."""
    processor = OutputProcessor(tokenizer, log_stats=False)
    plain = RequestOutputCollector(DELTA, "a")
    processor.add_request(make_request("a", [1]), None, collector=plain)
    other = RequestOutputCollector(DELTA, "b")
    processor.add_request(make_request("b", [1]), None, collector=other)
    parent_collector = RequestOutputCollector(DELTA, "p")
    assert add_parent(processor, SamplingParams(n=2, output_kind=DELTA), parent_collector) == ["0_p", "1_p"]
    error = RuntimeError("engine core 1 died")
    assert processor.fail_requests(["a", "1_p", "gone"], error) == ["0_p"]
    for collector in (plain, parent_collector):
        with pytest.raises(RuntimeError, match="engine core 1 died"):
            collector.get_nowait()
    assert other.get_nowait() is None
    assert sorted(processor.request_states) == ["b"] and not processor.parent_requests


def lp_lists(token_ids: list[int], logprob: float) -> LogprobsLists:
    return LogprobsLists(
        [[t, t] for t in token_ids], [[logprob, logprob]] * len(token_ids), [1] * len(token_ids)
    )


def test_logprobs_and_prompt_logprobs_in_delta_mode(tokenizer: Any, text_ids: list[int]) -> None:
    processor = OutputProcessor(tokenizer, log_stats=False)
    params = dict(output_kind=DELTA, logprobs=1, prompt_logprobs=0)
    processor.add_request(make_request("a", [5, 6, 7], **params), None)
    first = EngineCoreOutput(
        "a", text_ids[:1], lp_lists(text_ids[:1], -0.5), lp_lists([6, 7], -1.0)
    )
    second = EngineCoreOutput(
        "a", text_ids[1:3], lp_lists(text_ids[1:3], -0.25), finish_reason=FinishReason.LENGTH
    )
    r1, r2 = run(processor, [first, second])
    assert r1.prompt_logprobs is not None and r1.prompt_logprobs[0] is None
    assert [list(p) for p in r1.prompt_logprobs[1:]] == [[6], [7]]  # type: ignore[union-attr]
    assert r2.prompt_logprobs is None  # sent once
    assert r1.outputs[0].cumulative_logprob == -0.5
    assert r2.outputs[0].cumulative_logprob == -1.0
    assert len(r2.outputs[0].logprobs or []) == 2
    entry = (r2.outputs[0].logprobs or [])[0][text_ids[1]]
    assert (entry.logprob, entry.rank, entry.decoded_token) == (-0.25, 1, " world")


def test_iteration_stats_and_metrics(tokenizer: Any, text_ids: list[int]) -> None:
    processor = OutputProcessor(tokenizer, log_stats=True)
    request = make_request("a", [1, 2, 3], output_kind=FINAL)
    processor.add_request(request, None)
    queued = EngineCoreEvent(EngineCoreEventType.QUEUED, 10.0)
    scheduled = EngineCoreEvent(EngineCoreEventType.SCHEDULED, 10.5)
    stats1, stats2 = IterationStats(), IterationStats()
    processor.process_outputs(
        [EngineCoreOutput("a", text_ids[:1], events=[queued, scheduled])], 1.0, stats1
    )
    out = EngineCoreOutput("a", text_ids[1:3], finish_reason=FinishReason.LENGTH)
    (result,) = processor.process_outputs([out], 2.0, stats2).request_outputs
    assert (stats1.num_prompt_tokens, stats1.num_generation_tokens) == (3, 1)
    assert len(stats1.time_to_first_tokens_iter) == 1 and not stats1.inter_token_latencies_iter
    assert (stats2.num_prompt_tokens, stats2.num_generation_tokens) == (0, 2)
    assert len(stats2.inter_token_latencies_iter) == 1
    (finished,) = stats2.finished_requests
    assert finished.finish_reason == "length" and finished.num_generation_tokens == 3
    assert finished.queued_time == 0.5
    assert result.metrics is not None and result.metrics.time_in_queue == 0.5
    assert result.metrics.finished_time is not None
