"""Stat loggers fed by AsyncLLM's output handler: Prometheus metrics and a periodic log line.

Each has `record(scheduler_stats, iteration_stats, engine_index)`; the log line is printed
every few seconds by `log()` (the server calls it from a background task).
"""

from __future__ import annotations

import time

import prometheus_client as prom

from pagellm.core.protocol import SchedulerStats
from pagellm.logger import init_logger
from pagellm.metrics.stats import IterationStats

logger = init_logger(__name__)

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
_TOKENS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
_PHASE_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0]


class PrometheusStatLogger:
    """vLLM-named metrics in a registry of its own, exported twice: as `pagellm:<name>`
    and as `vllm:<name>`, so dashboards and alerts made for vLLM read them unchanged."""

    def __init__(self, model_name: str, num_engines: int = 1):
        self.registry = prom.CollectorRegistry()
        labels = ["model_name", "engine"]
        r = self.registry

        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(f"pagellm:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> prom.Counter:
            return prom.Counter(f"pagellm:{name}", doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: list[float]) -> prom.Histogram:
            return prom.Histogram(f"pagellm:{name}", doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.request_success = counter("request_success", "Finished requests by reason.", ("finished_reason",))
        self.engine_restarts = counter("engine_restarts", "Engine-core processes that died and were restarted "
                                       "(--restart-engine-on-failure).")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verify runs (a request's proposals in a step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens accepted, by position in the run.", ("position",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.", _E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time a request waited before its first scheduling.", _PHASE_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduling to the first token.", _PHASE_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from the first token to the last.", _PHASE_BUCKETS)
        self.prompt_tokens_per_request = histogram("request_prompt_tokens", "Prompt tokens per finished request.", _TOKENS_BUCKETS)
        self.generation_tokens_per_request = histogram("request_generation_tokens", "Generated tokens per finished request.", _TOKENS_BUCKETS)
        self._vllm_view = prom.CollectorRegistry()
        self._vllm_view.register(_Renamed(self.registry, "pagellm:", "vllm:"))
        self.model_name = model_name
        for engine in range(num_engines):  # export zeros before the first request
            self.running.labels(model_name, str(engine)).set(0)
            self.waiting.labels(model_name, str(engine)).set(0)
            self.kv_usage.labels(model_name, str(engine)).set(0)
            self.engine_restarts.labels(model_name, str(engine))

    def record(self, sched: SchedulerStats | None, it: IterationStats | None, engine_index: int = 0) -> None:
        lbl = (self.model_name, str(engine_index))
        if sched is not None:
            self.running.labels(*lbl).set(sched.num_running_reqs)
            self.waiting.labels(*lbl).set(sched.num_waiting_reqs)
            self.kv_usage.labels(*lbl).set(sched.kv_cache_usage)
            self.prefix_queries.labels(*lbl).inc(sched.prefix_cache_queries)
            self.prefix_hits.labels(*lbl).inc(sched.prefix_cache_hits)
            self.preemptions.labels(*lbl).inc(sched.num_preemptions)
            if sched.spec_num_drafts:
                self.spec_drafts.labels(*lbl).inc(sched.spec_num_drafts)
                self.spec_draft_tokens.labels(*lbl).inc(sched.spec_num_draft_tokens)
                self.spec_accepted.labels(*lbl).inc(sched.spec_num_accepted_tokens)
                for pos, n in enumerate(sched.spec_accepted_per_pos):
                    self.spec_accepted_per_pos.labels(*lbl, str(pos)).inc(n)
        if it is None:
            return
        self.prompt_tokens.labels(*lbl).inc(it.num_prompt_tokens)
        self.generation_tokens.labels(*lbl).inc(it.num_generation_tokens)
        for v in it.time_to_first_tokens_iter:
            self.ttft.labels(*lbl).observe(v)
        for v in it.inter_token_latencies_iter:
            self.itl.labels(*lbl).observe(v)
        for fin in it.finished_requests:
            self.e2e.labels(*lbl).observe(fin.e2e_latency)
            self.request_success.labels(*lbl, fin.finish_reason).inc()
            self.queue_time.labels(*lbl).observe(fin.queued_time)
            # the first-token time is the frontend's (from arrival); the queue time the engine's
            self.prefill_time.labels(*lbl).observe(max(0.0, fin.time_to_first_token - fin.queued_time))
            self.decode_time.labels(*lbl).observe(fin.decode_time)
            self.prompt_tokens_per_request.labels(*lbl).observe(fin.num_prompt_tokens)
            self.generation_tokens_per_request.labels(*lbl).observe(fin.num_generation_tokens)

    def record_abort(self, count: int = 1, engine_index: int = 0) -> None:
        self.request_success.labels(self.model_name, str(engine_index), "abort").inc(count)

    def record_engine_restart(self, engine_index: int) -> None:
        self.engine_restarts.labels(self.model_name, str(engine_index)).inc()

    def render(self) -> bytes:
        return prom.generate_latest(self.registry) + prom.generate_latest(self._vllm_view)


class _Renamed:
    """A read-only view of a registry's metrics under another name prefix."""

    def __init__(self, source: prom.CollectorRegistry, old: str, new: str) -> None:
        self.source, self.old, self.new = source, old, new

    def _name(self, name: str) -> str:
        return self.new + name[len(self.old):] if name.startswith(self.old) else name

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        for family in self.source.collect():
            renamed = prom.Metric(self._name(family.name), family.documentation, family.type, family.unit)
            for s in family.samples:
                renamed.add_sample(self._name(s.name), s.labels, s.value, s.timestamp, s.exemplar)
            yield renamed


class LoggingStatLogger:
    """Accumulates throughput and prints one line per interval while there is news: tokens
    processed, or running/waiting counts other than the last line showed. The first
    quiet interval after work gets one line (zero throughput), then nothing until work
    comes back, so an idle server's log stays still. (Quiet is judged by news, not by a
    running count of 0: the counts come with engine steps, and none follows an abort.)"""

    def __init__(self, num_engines: int = 1):
        self.last_log = time.monotonic()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.sched: dict[int, SchedulerStats] = {}
        self.num_engines = num_engines
        self.shown_counts = (0, 0)  # (running, waiting) of the last line
        self.quiet_logged = True  # a server that has not worked yet has nothing to say
        self.spec = [0, 0, 0]  # speculative decoding this interval: runs, proposed, accepted

    def record(self, sched: SchedulerStats | None, it: IterationStats | None, engine_index: int = 0) -> None:
        if sched is not None:
            self.sched[engine_index] = sched
            self.spec[0] += sched.spec_num_drafts
            self.spec[1] += sched.spec_num_draft_tokens
            self.spec[2] += sched.spec_num_accepted_tokens
        if it is not None:
            self.prompt_tokens += it.num_prompt_tokens
            self.generation_tokens += it.num_generation_tokens

    def log(self) -> str | None:
        """Logs and returns this interval's line, or None when it stays quiet."""
        now = time.monotonic()
        elapsed = max(now - self.last_log, 1e-9)
        stats = list(self.sched.values())
        running = sum(s.num_running_reqs for s in stats)
        waiting = sum(s.num_waiting_reqs for s in stats)
        usage = max((s.kv_cache_usage for s in stats), default=0.0)
        quiet = not (self.prompt_tokens or self.generation_tokens) and (running, waiting) == self.shown_counts
        line = None
        if not (quiet and self.quiet_logged):
            line = (
                f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {usage * 100:.1f}%"
            )
            runs, proposed, accepted = self.spec
            if proposed:  # vLLM's spec decoding figures: accepted share, tokens per verify run
                line += (f", Draft acceptance rate: {accepted / proposed * 100:.1f}%, "
                         f"Mean acceptance length: {1 + accepted / runs:.2f}")
            logger.info(line)
            self.shown_counts = (running, waiting)
        self.quiet_logged = quiet
        self.prompt_tokens = self.generation_tokens = 0
        self.spec = [0, 0, 0]
        self.last_log = now
        return line
