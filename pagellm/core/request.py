"""Request: the engine core's mutable state for one sequence.

Built from an EngineCoreRequest by the engine core's input path; owned by the
scheduler. Holds token ids, progress (num_computed_tokens), status and block hashes.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagellm.core.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreRequest,
    FinishReason,
)
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.core.kv_cache.hashing import BlockHash
    from pagellm.structured_output import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its grammar is still compiling
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        client_index: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.client_index = client_index
        # Set for a pooling request: it runs its prompt once and finishes with the pooled
        # hidden state the runner returns, sampling nothing.
        self.pooling_params = pooling_params
        self.eos_token_id = sampling_params.eos_token_id
        if sampling_params.max_tokens is None:  # the input processor fills it from the context left
            raise ValueError(f"Request {request_id!r} reached the engine core without max_tokens.")
        self.max_tokens = sampling_params.max_tokens

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        # prompt + output; the scheduler and runner read token ids from here.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Tokens whose KV is in the cache (or is written by the step in flight).
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at first scheduling; -1 = not yet.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.events: list[EngineCoreEvent] = []
        # Set by the structured output manager when sampling_params.structured_outputs is.
        self.structured_output_request: StructuredOutputRequest | None = None

        self._block_hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        if block_hasher is not None:
            self.block_hashes = block_hasher(self)

    @classmethod
    def from_engine_core_request(
        cls,
        request: EngineCoreRequest,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
    ) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            arrival_time=request.arrival_time,
            priority=request.priority,
            block_hasher=block_hasher,
            client_index=request.client_index,
            pooling_params=request.pooling_params,
        )

    # -- token bookkeeping -------------------------------------------------------------

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    # -- status ------------------------------------------------------------------------

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        self.events.append(EngineCoreEvent(event_type, timestamp or time.monotonic()))

    def take_events(self) -> list[EngineCoreEvent] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def __lt__(self, other: Request) -> bool:
        # Priority queue order: lower priority value first, then earlier arrival.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
