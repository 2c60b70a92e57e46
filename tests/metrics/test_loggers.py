"""The periodic stats line: printed while there is work, once when it goes idle, then
never again until work comes back (an idle server's log stays still)."""

from __future__ import annotations

import asyncio

import pytest

from pagellm.core.protocol import SchedulerStats
from pagellm.entrypoints.openai.api_server import _log_periodically
from pagellm.metrics.loggers import LoggingStatLogger
from pagellm.metrics.stats import IterationStats


def _step(stats: LoggingStatLogger, running: int, waiting: int = 0, generated: int = 0) -> None:
    stats.record(SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting),
                 IterationStats(num_generation_tokens=generated))


def _lines(stats: LoggingStatLogger, n: int) -> list[bool]:
    return [stats.log() is not None for _ in range(n)]


def test_a_fresh_idle_server_logs_nothing() -> None:
    assert _lines(LoggingStatLogger(), 3) == [False, False, False]


def test_lines_while_working_then_one_idle_line_then_silence() -> None:
    stats = LoggingStatLogger()
    _step(stats, running=0, waiting=1)  # queued, no token yet: news
    assert stats.log().endswith("Running: 0 reqs, Waiting: 1 reqs, KV cache usage: 0.0%")
    _step(stats, running=1, generated=5)
    line = stats.log()
    assert "Avg generation throughput: 0.0" not in line and "Running: 1 reqs" in line
    _step(stats, running=0, generated=1)  # the last token; the request finished
    assert stats.log() is not None
    idle = stats.log()  # the first interval without work
    assert idle.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s")
    assert _lines(stats, 4) == [False, False, False, False]
    _step(stats, running=1, generated=3)  # work again
    assert _lines(stats, 3) == [True, True, False]


def test_counts_left_by_an_abort_do_not_keep_it_logging() -> None:
    # an abort runs no further step, so the last counts seen still say 1 running
    stats = LoggingStatLogger()
    _step(stats, running=1, generated=2)
    assert _lines(stats, 4) == [True, True, False, False]


def test_idle_server_loop_logs_no_line_after_the_first_idle_one() -> None:
    stats = LoggingStatLogger()
    lines: list[str | None] = []
    log = stats.log
    stats.log = lambda: lines.append(log()) or lines[-1]  # type: ignore[method-assign]
    _step(stats, running=1, generated=4)

    async def run() -> None:
        task = asyncio.create_task(_log_periodically(stats, 0.001))
        while len(lines) < 6:
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(run())
    printed = [line is not None for line in lines[:6]]
    assert printed == [True, True, False, False, False, False]


def test_prometheus_exports_vllm_names_and_phase_histograms() -> None:
    """Every series also exists under vLLM's `vllm:` prefix with the same value, and a
    finished request feeds the queue / prefill / decode time and tokens-per-request
    histograms that vLLM's dashboards read."""
    from pagellm.metrics.loggers import PrometheusStatLogger
    from pagellm.metrics.stats import FinishedRequestStats, IterationStats

    prom_logger = PrometheusStatLogger("m")
    it = IterationStats(num_prompt_tokens=5, num_generation_tokens=3)
    it.finished_requests.append(FinishedRequestStats(
        finish_reason="stop", e2e_latency=1.0, num_prompt_tokens=5, num_generation_tokens=3,
        max_tokens_param=16, queued_time=0.1, time_to_first_token=0.4, decode_time=0.5))
    prom_logger.record(None, it)
    samples = {}
    for line in prom_logger.render().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    lbl = '{engine="0",model_name="m"}'
    expected = {
        "generation_tokens_total": 3.0,
        "request_queue_time_seconds_sum": 0.1,
        "request_prefill_time_seconds_sum": 0.4 - 0.1,
        "request_decode_time_seconds_sum": 0.5,
        "request_prompt_tokens_sum": 5.0,
        "request_generation_tokens_sum": 3.0,
    }
    for short, value in expected.items():
        assert samples[f"pagellm:{short}{lbl}"] == pytest.approx(value)
        assert samples[f"vllm:{short}{lbl}"] == pytest.approx(value)
    pagellm_names = {k.removeprefix("pagellm:") for k in samples if k.startswith("pagellm:")}
    vllm_names = {k.removeprefix("vllm:") for k in samples if k.startswith("vllm:")}
    assert pagellm_names == vllm_names


def test_speculative_decoding_counters_and_line() -> None:
    """vLLM's spec_decode counters (per position too) and the acceptance figures in the
    stats line, from the scheduler's counts since its last stats."""
    from pagellm.metrics.loggers import PrometheusStatLogger

    sched = SchedulerStats(num_running_reqs=1, spec_num_drafts=4, spec_num_draft_tokens=12,
                           spec_num_accepted_tokens=6, spec_accepted_per_pos=[3, 2, 1])
    prom_logger = PrometheusStatLogger("m")
    prom_logger.record(sched, None)
    prom_logger.record(sched, None)
    text = prom_logger.render().decode()
    for prefix in ("pagellm", "vllm"):
        assert f'{prefix}:spec_decode_num_drafts_total{{engine="0",model_name="m"}} 8.0' in text
        assert f'{prefix}:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} 24.0' in text
        assert f'{prefix}:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} 12.0' in text
        assert f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} 4.0' in text
    stats = LoggingStatLogger()
    stats.record(sched, IterationStats(num_generation_tokens=10))
    assert stats.log().endswith("Draft acceptance rate: 50.0%, Mean acceptance length: 2.50")
    _step(stats, running=1, generated=3)  # no proposals this interval: no figures
    assert "Draft" not in stats.log()
