"""AsyncLLM: the asyncio engine behind the OpenAI server (`generate()` streams outputs).

Same frontend as LLMEngine (InputProcessor, OutputProcessor), but the engine core always
runs in other processes (AsyncMPClient, or DPLBAsyncMPClient for data parallelism) and a
lazily started `output_handler` task pushes outputs into per-request collectors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.core.protocol import EngineCoreRequest
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_client import EngineCoreClient, EngineFailure
from pagellm.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineRestartingError,
    StreamTooSlowError,
)
from pagellm.engine.llm_engine import apply_ready_response, fan_out, start_frontend_and_core
from pagellm.engine.output_processor import OutputProcessor, RequestOutputCollector
from pagellm.inputs import PromptType
from pagellm.logger import init_logger
from pagellm.outputs import PoolingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

logger = init_logger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig, log_stats: bool = True, stat_loggers: list[Any] | None = None):
        self.tokenizer, self.input_processor, self.engine_core = start_frontend_and_core(
            config, lambda: EngineCoreClient.make_client(True, True, config)
        )
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=log_stats,
                                                stream_buffer_tokens=envs.PAGELLM_STREAM_BUFFER_TOKENS)
        self.config = apply_ready_response(config, self.engine_core)
        self.model_config = self.config.model_config
        self.log_stats = log_stats
        # Objects with record(scheduler_stats, iteration_stats, engine_index) (metrics, logs).
        self.stat_loggers: list[Any] = list(stat_loggers or [])
        self.output_handler: asyncio.Task | None = None
        self._shutdown = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(engine_args.create_engine_config(), **kwargs)

    # -- state -------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        handler_done = self.output_handler is not None and self.output_handler.done()
        return self.engine_core.engine_dead or handler_done

    @property
    def is_running(self) -> bool:
        return not self._shutdown and not self.errored

    @property
    def restarting_engines(self) -> list[int]:
        """Ranks whose engine core died and is being restarted (restart_engine_on_failure)."""
        return sorted(getattr(self.engine_core, "restarting", ()))

    def start(self) -> None:
        """Starts the output handler in the running event loop (the server does this at
        start-up, so an engine that dies before the first request is noticed)."""
        self._run_output_handler()

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError()

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- requests ----------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
        data_parallel_rank: int | None = None,
        prompt_text: str | None = None,
    ) -> RequestOutputCollector:
        if self.errored:
            raise self.dead_error
        if self.output_processor.has_request(request_id):
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if isinstance(prompt, EngineCoreRequest):
            request = prompt
            _check_ready_made(request, request_id)
        else:
            request, prompt_text = self.input_processor.process_inputs(
                request_id, prompt, params, arrival_time or time.time(), priority,
                add_special_tokens, data_parallel_rank,
            )
        self._run_output_handler()
        collector = RequestOutputCollector(request.sampling_params.output_kind, request_id)
        parent, core_requests = fan_out(request)
        try:
            for index, core_request in enumerate(core_requests):
                self.output_processor.add_request(core_request, prompt_text, parent, index, collector)
                await self.engine_core.add_request_async(core_request)
        except BaseException:
            # A failed add leaves nothing behind: the id can be used again.
            internal = self.output_processor.abort_requests([request_id])
            if internal and not self.errored:
                await self.engine_core.abort_requests_async(internal)
            raise
        return collector

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields RequestOutputs for one request until it finishes (as its output_kind says)."""
        collector: RequestOutputCollector | None = None
        try:
            collector = await self.add_request(
                request_id, prompt, sampling_params, priority=priority,
                add_special_tokens=add_special_tokens, data_parallel_rank=data_parallel_rank,
            )
            finished = False
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            if collector is not None:
                await self.abort(request_id)
            raise
        except (EngineDeadError, ValueError, StreamTooSlowError):
            raise
        except Exception as e:
            await self.abort(request_id)
            raise EngineGenerateError(str(e)) from e

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """vLLM's AsyncLLM.encode (a pooling engine): one PoolingRequestOutput, once the
        prompt has run."""
        async for out in self.generate(prompt, pooling_params, request_id, priority=priority):  # type: ignore[arg-type]
            yield out  # type: ignore[misc]

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        internal = self.output_processor.abort_requests(ids)
        if internal:
            for stat_logger in self.stat_loggers:
                if hasattr(stat_logger, "record_abort"):
                    stat_logger.record_abort(len(ids))
        if internal and not self.engine_core.engine_dead:
            await self.engine_core.abort_requests_async(internal)

    # -- the output handler ------------------------------------------------------------

    def _run_output_handler(self) -> None:
        if self.output_handler is not None:
            return
        engine_core, output_processor = self.engine_core, self.output_processor
        chunk_size = envs.PAGELLM_OUTPUT_PROC_CHUNK_SIZE
        stat_loggers, log_stats = self.stat_loggers, self.log_stats

        async def on_failure(failure: EngineFailure) -> None:
            logger.error("Engine core %d died (%s); %d request(s) in flight on it failed; restarting it.",
                         failure.rank, failure.cause, len(failure.request_ids))
            error = EngineRestartingError(
                f"The engine core serving this request died ({failure.cause}) and is restarting; "
                "retry the request."
            )
            siblings = output_processor.fail_requests(failure.request_ids, error)
            if siblings:  # n > 1 children on other ranks
                await engine_core.abort_requests_async(siblings)
            for stat_logger in stat_loggers:
                if hasattr(stat_logger, "record_engine_restart"):
                    stat_logger.record_engine_restart(failure.rank)

        async def output_handler() -> None:
            try:
                while True:
                    outputs = await engine_core.get_output_async()
                    if isinstance(outputs, EngineFailure):
                        await on_failure(outputs)
                        continue
                    items = outputs.outputs
                    iteration_stats = _new_iteration_stats() if log_stats else None
                    for start in range(0, max(len(items), 1), chunk_size):
                        chunk = items[start : start + chunk_size]
                        processed = output_processor.process_outputs(chunk, outputs.timestamp, iteration_stats)
                        if start + chunk_size < len(items):
                            await asyncio.sleep(0)  # let streams flush between chunks
                        if processed.reqs_to_abort:
                            await engine_core.abort_requests_async(processed.reqs_to_abort)
                    for stat_logger in stat_loggers:
                        stat_logger.record(outputs.scheduler_stats, iteration_stats, outputs.engine_index)
            except Exception as e:
                logger.error("AsyncLLM output handler failed: %r", e)
                output_processor.propagate_error(e if isinstance(e, EngineDeadError) else EngineDeadError(str(e)))

        self.output_handler = asyncio.get_running_loop().create_task(output_handler())

    # -- utilities -----------------------------------------------------------------------

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    async def call_utility(self, method: str, *args: Any, rank: int | None = None) -> Any:
        return await self.engine_core.call_utility_async(method, *args, rank=rank)

    def shutdown(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        if self.output_handler is not None and not self.output_handler.done():
            try:
                self.output_handler.cancel()
            except RuntimeError:
                pass
        try:  # generate() calls still waiting end instead of hanging
            self.output_processor.propagate_error(EngineDeadError("The engine was shut down."))
        except RuntimeError:
            pass  # their event loop is already closed
        self.engine_core.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _check_ready_made(request: EngineCoreRequest, request_id: str) -> None:
    """A ready-made EngineCoreRequest skips the InputProcessor, so it must already carry
    what the processor would have filled in."""
    if request.request_id != request_id:
        raise ValueError(f"request_id {request_id!r} differs from the EngineCoreRequest's {request.request_id!r}.")
    if request.sampling_params.max_tokens is None:
        raise ValueError("An EngineCoreRequest needs max_tokens set (InputProcessor.process_inputs fills it).")


def _new_iteration_stats() -> Any:
    from pagellm.metrics.stats import IterationStats

    return IterationStats()
