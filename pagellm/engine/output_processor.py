"""OutputProcessor: engine-core outputs (token ids, logprobs) -> user-facing RequestOutputs.

Owns the frontend per-request state: detokenizer, stop strings, logprobs, n > 1 fan-in,
output kinds and stats. It never talks to the engine core; the caller sends the aborts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagellm.core.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
)
from pagellm.engine.detokenizer import IncrementalDetokenizer, convert_logprobs
from pagellm.engine.exceptions import StreamTooSlowError
from pagellm.logger import init_logger
from pagellm.metrics.stats import FinishedRequestStats, IterationStats, RequestStateStats
from pagellm.outputs import (
    CompletionOutput,
    LogprobsLists,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from pagellm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


class RequestOutputCollector:
    """A one-slot mailbox between the output handler (producer) and generate() (consumer).

    Put and get run on the same event loop thread. If the consumer lags, DELTA outputs
    are merged into the waiting one (`pending_tokens` counts them); other kinds replace
    per completion index.
    """

    def __init__(self, output_kind: RequestOutputKind, request_id: str) -> None:
        self.request_id = request_id
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | Exception | None = None
        self.pending_tokens = 0
        """Tokens in the waiting output (DELTA: what the consumer has not taken yet)."""
        # Created lazily so the collector can be built outside a running loop.
        self._ready: asyncio.Event | None = None

    @property
    def ready(self) -> asyncio.Event:
        if self._ready is None:
            self._ready = asyncio.Event()
        return self._ready

    def put(self, output: RequestOutput | Exception) -> None:
        if isinstance(output, RequestOutput):
            self.pending_tokens += sum(len(c.token_ids) for c in output.outputs)
        if self.output is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            self.output.add(output, aggregate=self.aggregate)
        # An exception already waiting wins over later outputs.

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.pending_tokens = 0
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        assert output is not None
        return output


class ParentRequest:
    """Fans a request with n > 1 out into n child requests and their outputs back in."""

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.output_kind = sampling_params.output_kind
        self.child_requests: set[str] = {self.child_id(i, request_id) for i in range(self.n)}
        # FINAL_ONLY: each child's final completion, by index, until all have finished.
        self.output_aggregator: list[CompletionOutput | None] = [None] * self.n

    @staticmethod
    def child_id(index: int, parent_id: str) -> str:
        return f"{index}_{parent_id}"

    def make_child_requests(self) -> list[tuple[str, SamplingParams]]:
        """Child ids and params: n=1 each; seeded requests get seed + i per child."""
        request_id, params = self.request_id, self.sampling_params
        shared: SamplingParams | None = None
        children = []
        for i in range(params.n):
            if params.seed is None:
                if shared is None:
                    shared = params.clone()
                    shared.n = 1
                child_params = shared
            else:
                child_params = params.clone()
                child_params.n = 1
                child_params.seed = params.seed + i
            children.append((ParentRequest.child_id(i, request_id), child_params))
        return children

    def get_outputs(
        self, child_request_id: str, completion: CompletionOutput
    ) -> tuple[list[CompletionOutput], bool]:
        """Completions to emit now for the parent, and whether the parent has finished."""
        if completion.finished():
            self.child_requests.discard(child_request_id)
        finished = not self.child_requests
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            return [completion], finished
        self.output_aggregator[completion.index] = completion
        if not finished:
            return [], False
        return [c for c in self.output_aggregator if c is not None], True


class RequestState:
    """Frontend state of one request (or one child of an n > 1 request)."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer: Any,
        parent_req: ParentRequest | None,
        request_index: int,
        collector: RequestOutputCollector | None,
        log_stats: bool,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.parent_req = parent_req
        self.request_index = request_index
        self.output_kind = params.output_kind
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.max_tokens_param = params.max_tokens
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        self.collector = collector  # AsyncLLM's mailbox for this request; None for LLMEngine
        self.num_cached_tokens = 0
        # Logprobs: None when not requested. The *_sent counters drive DELTA emission.
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # nothing predicts the first prompt token
        self._num_logprobs_sent = 0
        self._num_prompt_logprobs_sent = 0
        self.stats = RequestStateStats(arrival_time=request.arrival_time) if log_stats else None
        self.pooling_params = request.pooling_params  # set: a pooling request

    def make_pooling_output(self, pooled: bytes) -> PoolingRequestOutput:
        """The pooled vector cut to PoolingParams.dimensions, then normalised if asked
        (the input processor filled `normalize` with the model's default)."""
        import numpy as np

        params = self.pooling_params
        assert params is not None
        vec = np.frombuffer(pooled, dtype=np.float32)
        if params.dimensions is not None:
            vec = vec[: params.dimensions]
        if params.normalize:
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
        return PoolingRequestOutput(self.request_id, PoolingOutput(np.array(vec, dtype=np.float32)),
                                    self.prompt_token_ids, True, self.prompt, self.num_cached_tokens)

    # -- updates from one EngineCoreOutput ---------------------------------------------

    def update_logprobs(self, new: LogprobsLists | None, num_tokens: int) -> None:
        """Appends logprobs of the first num_tokens new tokens (the rest were trimmed)."""
        if self.logprobs is None or new is None or num_tokens == 0:
            return
        kept = new.first(num_tokens)
        positions = convert_logprobs(self.tokenizer, kept, self.num_logprobs or 0)
        self.logprobs.extend(positions)
        assert self.cumulative_logprob is not None
        self.cumulative_logprob += sum(lps[0] for lps in kept.logprobs)

    def update_prompt_logprobs(self, new: LogprobsLists | None) -> None:
        if self.prompt_logprobs is None or new is None:
            return
        self.prompt_logprobs.extend(
            convert_logprobs(self.tokenizer, new, self.num_prompt_logprobs or 0)
        )

    # -- building outputs ------------------------------------------------------------------

    def make_request_output(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> RequestOutput | None:
        """The RequestOutput to emit now for this request (None: nothing to emit)."""
        finished = finish_reason is not None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        new_prompt_logprobs = self._has_unsent_prompt_logprobs()
        if not (new_token_ids or finished or new_prompt_logprobs):
            return None
        completion = self._make_completion(new_token_ids, finish_reason, stop_reason)
        outputs = [completion]
        request_id = self.request_id
        if self.parent_req is not None:
            request_id = self.parent_req.request_id
            outputs, finished = self.parent_req.get_outputs(self.request_id, completion)
            if not outputs:
                return None
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(),
            outputs=outputs,
            finished=finished,
            metrics=self._make_metrics(finished),
            num_cached_tokens=self.num_cached_tokens,
        )

    def _make_completion(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> CompletionOutput:
        delta = self.output_kind == RequestOutputKind.DELTA
        finished = finish_reason is not None
        text = self.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = list(new_token_ids)
        else:
            token_ids = list(self.detokenizer.output_token_ids)
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self._take_logprobs(delta),
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason,
        )

    def _take_logprobs(self, delta: bool) -> SampleLogprobs | None:
        if self.logprobs is None:
            return None
        start = self._num_logprobs_sent if delta else 0
        self._num_logprobs_sent = len(self.logprobs)
        return self.logprobs[start:]

    def _has_unsent_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and (
            len(self.prompt_logprobs) > self._num_prompt_logprobs_sent
        )

    def _take_prompt_logprobs(self) -> PromptLogprobs | None:
        """DELTA sends each prompt position once; other kinds send all of them each time."""
        if self.prompt_logprobs is None:
            return None
        if self.output_kind != RequestOutputKind.DELTA:
            return list(self.prompt_logprobs)
        start, self._num_prompt_logprobs_sent = (
            self._num_prompt_logprobs_sent,
            len(self.prompt_logprobs),
        )
        return self.prompt_logprobs[start:] or None

    def _make_metrics(self, finished: bool) -> RequestMetrics | None:
        s = self.stats
        if s is None:
            return None
        time_in_queue = s.scheduled_ts - s.queued_ts if s.queued_ts and s.scheduled_ts else None
        return RequestMetrics(
            arrival_time=s.arrival_time,
            last_token_time=s.last_token_time or None,
            first_scheduled_time=(
                s.arrival_time + time_in_queue if time_in_queue is not None else None
            ),
            first_token_time=s.first_token_time or None,
            time_in_queue=time_in_queue,
            finished_time=time.time() if finished else None,
            num_generation_tokens=s.num_generation_tokens,
        )


@dataclass
class OutputProcessorOutput:
    # Outputs of requests that have no collector (LLM / LLMEngine callers read these).
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Requests the frontend finished (stop string) that the engine core still runs.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Turns each step's EngineCoreOutputs into RequestOutputs, for every live request."""

    def __init__(self, tokenizer: Any, log_stats: bool, stream_buffer_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.stream_buffer_tokens = stream_buffer_tokens
        """A DELTA stream's consumer may leave this many tokens waiting; past it the
        request fails with StreamTooSlowError (its ids go to reqs_to_abort). 0: no limit."""
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def has_request(self, request_id: str) -> bool:
        """Whether a user request (or an n > 1 parent) with this id is still live."""
        return request_id in self.request_states or request_id in self.parent_requests

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        collector: RequestOutputCollector | None = None,
    ) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id!r} is already running.")
        self.request_states[request.request_id] = RequestState(
            request, prompt, self.tokenizer, parent_req, request_index, collector, self.log_stats
        )
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req

    def process_outputs(
        self,
        engine_core_outputs: list[EngineCoreOutput],
        engine_core_timestamp: float | None = None,
        iteration_stats: IterationStats | None = None,
    ) -> OutputProcessorOutput:
        """Per output: (1) stats, (2) detokenize and match stop strings, (3) logprobs,
        (4) build the RequestOutput and route it, (5) drop finished requests."""
        result = OutputProcessorOutput()
        if iteration_stats is not None:
            iteration_stats.engine_core_timestamp = engine_core_timestamp
        now = time.time()
        for engine_output in engine_core_outputs:
            req_state = self.request_states.get(engine_output.request_id)
            if req_state is None:  # aborted meanwhile: the engine's late output is dropped
                continue
            _update_stats(req_state, engine_output, now, iteration_stats)
            self._process_one(req_state, engine_output, now, result, iteration_stats)
        return result

    def _process_one(
        self,
        req_state: RequestState,
        out: EngineCoreOutput,
        now: float,
        result: OutputProcessorOutput,
        iteration_stats: IterationStats | None,
    ) -> None:
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        req_state.num_cached_tokens = out.num_cached_tokens or req_state.num_cached_tokens
        if req_state.pooling_params is not None:
            self._process_pooling(req_state, out, now, result, iteration_stats)
            return
        detokenizer = req_state.detokenizer
        num_before = detokenizer.num_output_tokens()
        stop_str = detokenizer.update(out.new_token_ids, finish_reason == FinishReason.STOP)
        # Tokens after a matched stop string were dropped by the detokenizer.
        new_token_ids = detokenizer.output_token_ids[num_before:]
        if stop_str is not None:
            finish_reason, stop_reason = FinishReason.STOP, stop_str
            if not out.finished:
                result.reqs_to_abort.append(req_state.request_id)
        req_state.update_logprobs(out.new_logprobs, len(new_token_ids))
        req_state.update_prompt_logprobs(out.new_prompt_logprobs)

        request_output = req_state.make_request_output(new_token_ids, finish_reason, stop_reason)
        if request_output is not None:
            if req_state.collector is not None:
                req_state.collector.put(request_output)
                if self._too_far_behind(req_state, finish_reason is not None, result):
                    return
            else:
                result.request_outputs.append(request_output)
        if finish_reason is not None:
            self._finish_request(req_state)
            _record_finished(req_state, finish_reason, now, iteration_stats)

    def _too_far_behind(self, req_state: RequestState, finished: bool, result: OutputProcessorOutput) -> bool:
        """A stream whose consumer has left more than stream_buffer_tokens waiting (a
        client that stopped reading): the request fails, its tokens are dropped, and the
        engine aborts it (every child of an n > 1 request)."""
        collector = req_state.collector
        assert collector is not None
        limit = self.stream_buffer_tokens
        if not limit or finished or not collector.aggregate or collector.pending_tokens <= limit:
            return False
        request_id = req_state.parent_req.request_id if req_state.parent_req else req_state.request_id
        logger.warning("Request %s aborted: its stream's reader fell %d tokens behind (limit %d, "
                       "PAGELLM_STREAM_BUFFER_TOKENS).", request_id, collector.pending_tokens, limit)
        error = StreamTooSlowError(
            f"The stream was read too slowly: {collector.pending_tokens} tokens were waiting to be sent "
            f"(limit {limit}); the request was aborted.")
        result.reqs_to_abort.append(req_state.request_id)
        result.reqs_to_abort.extend(self.fail_requests([req_state.request_id], error))
        return True

    def _process_pooling(
        self,
        req_state: RequestState,
        out: EngineCoreOutput,
        now: float,
        result: OutputProcessorOutput,
        iteration_stats: IterationStats | None,
    ) -> None:
        """A pooling request reports once, when it finishes: its vector, or (cut short by
        an engine error) an error for its caller."""
        if out.finish_reason is None:
            return
        self._finish_request(req_state)
        _record_finished(req_state, out.finish_reason, now, iteration_stats)
        if out.pooling_output is None:
            error = RuntimeError(f"Pooling request {req_state.request_id} finished without a result "
                                 f"({out.finish_reason}).")
            if req_state.collector is None:
                raise error
            req_state.collector.put(error)
            return
        pooled = req_state.make_pooling_output(out.pooling_output)
        if req_state.collector is not None:
            req_state.collector.put(pooled)  # type: ignore[arg-type]
        else:
            result.request_outputs.append(pooled)  # type: ignore[arg-type]

    def _finish_request(self, req_state: RequestState) -> None:
        self.request_states.pop(req_state.request_id, None)
        parent = req_state.parent_req
        if parent is not None and not parent.child_requests:
            self.parent_requests.pop(parent.request_id, None)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Drops the state of these requests (a parent id stands for all its children).

        Returns the internal ids the engine core must abort. A request with a collector
        gets a final ABORT output so its generate() call returns.
        """
        to_abort: list[str] = []
        for request_id in request_ids:
            req_state = self.request_states.get(request_id)
            if req_state is not None:
                to_abort.append(request_id)
                self._abort_one(req_state)
            elif (parent := self.parent_requests.pop(request_id, None)) is not None:
                children = [c for c in parent.child_requests if c in self.request_states]
                to_abort.extend(self.abort_requests(sorted(children)))
        return to_abort

    def _abort_one(self, req_state: RequestState) -> None:
        request_output = req_state.make_request_output([], FinishReason.ABORT, None)
        self._finish_request(req_state)
        if req_state.collector is not None and request_output is not None:
            req_state.collector.put(request_output)

    def fail_requests(self, request_ids: Iterable[str], e: Exception) -> list[str]:
        """Ends these internal requests with `e` (their engine core died). A request with
        n > 1 fails whole: returns its other children, which the caller must abort where
        they still run."""
        failed = set(request_ids)
        siblings: list[str] = []
        for request_id in sorted(failed):
            req_state = self.request_states.get(request_id)
            if req_state is None:
                continue
            parent = req_state.parent_req
            states = [req_state] if parent is None else [
                self.request_states[c] for c in sorted(parent.child_requests) if c in self.request_states
            ]
            for state in states:
                if state.request_id not in failed:
                    siblings.append(state.request_id)
                self._finish_request(state)
            if parent is not None:
                self.parent_requests.pop(parent.request_id, None)
            if req_state.collector is not None:
                req_state.collector.put(e)
        return siblings

    def propagate_error(self, e: Exception) -> None:
        """Hands an engine failure to every waiting consumer."""
        for req_state in self.request_states.values():
            if req_state.collector is not None:
                req_state.collector.put(e)


def _update_stats(
    req_state: RequestState,
    out: EngineCoreOutput,
    now: float,
    iteration_stats: IterationStats | None,
) -> None:
    """Request timing from engine events and token arrival; iteration counters if asked."""
    stats = req_state.stats
    if stats is None:
        return
    for event in out.events or []:
        if event.type == EngineCoreEventType.QUEUED:
            stats.queued_ts = event.timestamp
        elif event.type == EngineCoreEventType.SCHEDULED and not stats.scheduled_ts:
            stats.scheduled_ts = event.timestamp
        elif event.type == EngineCoreEventType.PREEMPTED:
            stats.num_preemptions += 1
            if iteration_stats is not None:
                iteration_stats.num_preempted_reqs += 1
    num_new = len(out.new_token_ids)
    if num_new == 0:
        return
    if iteration_stats is not None:
        iteration_stats.num_generation_tokens += num_new
        if not stats.first_token_time:
            iteration_stats.num_prompt_tokens += len(req_state.prompt_token_ids)
            iteration_stats.time_to_first_tokens_iter.append(now - stats.arrival_time)
        else:
            iteration_stats.inter_token_latencies_iter.append(now - stats.last_token_time)
    if not stats.first_token_time:
        stats.first_token_time = now
    stats.last_token_time = now
    stats.num_generation_tokens += num_new


def _record_finished(
    req_state: RequestState,
    finish_reason: FinishReason,
    now: float,
    iteration_stats: IterationStats | None,
) -> None:
    stats = req_state.stats
    if stats is None or iteration_stats is None:
        return
    e2e = now - stats.arrival_time
    iteration_stats.e2e_latencies.append(e2e)
    first = stats.first_token_time
    iteration_stats.finished_requests.append(
        FinishedRequestStats(
            finish_reason=str(finish_reason),
            e2e_latency=e2e,
            num_prompt_tokens=len(req_state.prompt_token_ids),
            num_generation_tokens=stats.num_generation_tokens,
            max_tokens_param=req_state.max_tokens_param,
            queued_time=(stats.scheduled_ts - stats.queued_ts) if stats.queued_ts else 0.0,
            time_to_first_token=(first - stats.arrival_time) if first else 0.0,
            decode_time=(stats.last_token_time - first) if first else 0.0,
        )
    )
