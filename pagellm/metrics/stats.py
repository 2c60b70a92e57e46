"""Frontend statistics: per-request timing state and per-iteration counters.

The OutputProcessor fills these while turning engine-core outputs into RequestOutputs;
loggers and the Prometheus exporter read them. Plain data, no I/O, no clocks of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RequestStateStats:
    """Timing of one request, updated each time it produces tokens."""

    arrival_time: float  # time.time() when the frontend received the request
    queued_ts: float = 0.0  # engine-core clock, from the QUEUED event
    scheduled_ts: float = 0.0  # engine-core clock, from the first SCHEDULED event
    first_token_time: float = 0.0  # time.time() when the first token reached the frontend
    last_token_time: float = 0.0  # time.time() of the latest token
    num_generation_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class FinishedRequestStats:
    """Summary of a request that finished during this iteration."""

    finish_reason: str
    e2e_latency: float  # seconds from arrival to the final output
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    queued_time: float  # seconds between QUEUED and first SCHEDULED (engine clock)
    time_to_first_token: float
    decode_time: float  # seconds from first to last token


@dataclass
class IterationStats:
    """What one process_outputs() call saw."""

    iteration_timestamp: float = field(default_factory=time.time)
    engine_core_timestamp: float | None = None
    num_prompt_tokens: int = 0  # prompts whose first token arrived this iteration
    num_generation_tokens: int = 0
    num_preempted_reqs: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
