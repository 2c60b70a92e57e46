"""Messages that cross the frontend <-> engine-core boundary.

Positional msgspec structs (array_like): fields are encoded by position, so new fields
go at the end only. No pickle on the wire. Everything here is plain data. The one struct
defined elsewhere is LogprobsLists (pagellm/outputs.py), which the model runner makes too.
"""

from __future__ import annotations

import enum
import struct
import time
from typing import Any

import msgspec

from pagellm.outputs import LogprobsLists
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or the context limit
    ABORT = 2  # aborted by the user, a disconnect or shutdown
    ERROR = 3  # the engine could not process the request

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequestType(enum.Enum):
    """First frame of a client -> core message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    STOP = b"\x04"
    """The frontend drops this core: payload (reason, refused). refused: its handshake was
    refused (a config that differs from the head's, a rank taken or out of range), which
    a restart would not mend; else the frontend declared it dead (no heartbeat) and a new
    process may take the rank over."""


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    type: EngineCoreEventType
    timestamp: float


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    data_parallel_rank: int | None = None
    client_index: int = 0
    pooling_params: PoolingParams | None = None  # set: a pooling request (no sampling)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    num_cached_tokens: int = 0
    pooling_output: bytes | None = None  # a pooling request's pooled hidden state, float32

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found this step
    num_preemptions: int = 0  # preemptions this step
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # speculative decoding since the last stats (vLLM's spec_decode counters)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []  # accepted proposals by position in the run


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    failure_message: str | None = None
    result: Any = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None  # for the data-parallel load balancer

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()


class EngineCoreReadyResponse(msgspec.Struct, array_like=True, gc=False):
    """Sent by an engine core once its model is loaded and KV cache allocated: what it
    measured that the frontend's config cannot know."""

    num_gpu_blocks: int
    quantization: str | None = None
    """The quantization method the model runs with: the config's, or None where the
    config asked for 'gguf' and this process could not build the kernels (the frontend
    resolves 'gguf' from the compiler alone, without importing torch)."""
    rank: int = 0
    """The data-parallel rank this core serves."""
    fingerprint: dict[str, str] = {}
    """EngineConfig.fingerprint() of this core's config: the head compares it with its own
    (a core on another node built its config from that node's flags)."""


ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"

HANDSHAKE_FAILED = b"FAILED"
"""First frame of a handshake that reports a failed start-up (the cause follows)."""


def engine_dead_frame(rank: int, cause: str) -> bytes:
    """The last frame a failing engine core sends on its output socket: who died, and why."""
    return ENGINE_CORE_DEAD + engine_identity(rank) + cause.encode(errors="replace")


def parse_engine_dead_frame(frame: bytes) -> tuple[int, str] | None:
    """(rank, cause) of a dead frame; None for any other frame."""
    if not frame.startswith(ENGINE_CORE_DEAD):
        return None
    rest = frame[len(ENGINE_CORE_DEAD):]
    return rank_of_identity(rest[:2]), rest[2:].decode(errors="replace")


ENGINE_CORE_BEAT = b"ENGINE_CORE_BEAT"

HEARTBEAT_INTERVAL_S = 0.25
"""How often an engine core sends a heartbeat frame (with or without work)."""


def heartbeat_frame(rank: int, progress: int, busy: bool) -> bytes:
    """An engine core's sign of life: its progress count (steps and model layers run) and
    whether it has work (requests, or inputs not yet read); the frontend's watchdog
    reads them."""
    return ENGINE_CORE_BEAT + engine_identity(rank) + struct.pack("<QB", progress, busy)


def parse_heartbeat_frame(frame: bytes) -> tuple[int, int, bool]:
    """(rank, progress, busy) of a heartbeat frame."""
    rest = frame[len(ENGINE_CORE_BEAT):]
    progress, busy = struct.unpack("<QB", rest[2:])
    return rank_of_identity(rest[:2]), progress, bool(busy)


def engine_identity(rank: int, incarnation: bytes = b"") -> bytes:
    """The ZMQ identity of rank's engine core (its DEALER socket): the rank in two bytes,
    then what tells this process from another claiming the same rank (random bytes; none
    in heartbeats and dead frames). The client's ROUTER addresses the engine by the
    identity its accepted handshake came with, and reads the rank back from it."""
    return rank.to_bytes(2, "little") + incarnation


def rank_of_identity(identity: bytes) -> int:
    return int.from_bytes(identity[:2], "little")


ENGINE_REFUSED_EXIT_CODE = 3
"""Exit status of an engine core whose handshake the frontend refused: its node's
supervisor does not restart it (the same flags would be refused again)."""
