"""The periodic stats line: printed while there is work, once when it goes idle, then
never again until work comes back (an idle server's log stays still)."""

from __future__ import annotations

import asyncio

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
