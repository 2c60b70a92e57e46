"""EngineCore: scheduler + model runner, as pure logic with no sockets or threads.

In: EngineCoreRequests and aborts. Out: one EngineCoreOutputs per client per step.
EngineCoreProc wraps it in a process; InprocClient calls it directly.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import os
import queue
import time
from typing import Any

import msgspec
import torch

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.core.kv_cache.hashing import get_request_block_hasher
from pagellm.core.protocol import EngineCoreOutputs, EngineCoreReadyResponse, EngineCoreRequest
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.scheduler import Scheduler
from pagellm.logger import init_logger
from pagellm.model_executor.loader import load_tokenizer
from pagellm.platforms import platform_of
from pagellm.spec_decode.draft_model import DraftModelProposer, DraftRequest
from pagellm.structured_output import StructuredOutputManager
from pagellm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


def _confirm_quantization(config: EngineConfig) -> EngineConfig:
    """The frontend resolves an auto 'gguf' from the compiler's presence (see
    resolve_quantization); a kernel build that fails here (logged by load_kernels)
    falls back to dequantizing the GGUF file, as resolve_quantization would have. A q8_0
    KV cache, chosen the same way (config.q8_kv_cache_refusal) and read only by the
    kernels, falls back to float16."""
    q8_cache = config.cache_config.cache_dtype == "q8_0"
    if config.model_config.quantization != "gguf" and not q8_cache:
        return config
    from pagellm.kernels import load_kernels

    if load_kernels() is not None:
        return config
    if q8_cache:
        logger.warning("pagellm's C kernels did not build: the KV cache is float16, not q8_0 (only the "
                       "kernels read q8_0)")
        config = dataclasses.replace(config, cache_config=dataclasses.replace(config.cache_config,
                                                                              cache_dtype="float16"))
    if config.model_config.quantization != "gguf":
        return config
    spec = config.speculative_config
    if spec is not None and spec.draft_model_config is not None and spec.draft_model_config.quantization == "gguf":
        draft = dataclasses.replace(spec.draft_model_config, quantization=None)
        config = dataclasses.replace(config, speculative_config=dataclasses.replace(spec, draft_model_config=draft))
    return dataclasses.replace(config, model_config=dataclasses.replace(config.model_config, quantization=None))


class EngineCore:
    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        _set_num_threads(config)
        if config.model_config.seed is not None:  # None: unseeded, as in vLLM
            torch.manual_seed(config.model_config.seed)
        self.fingerprint = config.fingerprint()  # as asked for: the head compares flags, not kernels
        config = _confirm_quantization(config)
        if config.parallel_config.tensor_parallel_size > 1:
            from pagellm.core.tensor_parallel import TensorParallelRunner

            self.model_runner: ModelRunner | TensorParallelRunner = TensorParallelRunner(config)
        else:
            self.model_runner = ModelRunner(config)
        self.model_runner.load_model()
        self.drafter: DraftModelProposer | None = None
        """The draft model of speculative method 'draft_model': loaded before the KV cache is
        sized, its cache as many blocks as the target's, both in one budget."""
        if config.speculative_config is not None and config.speculative_config.method == "draft_model":
            self.drafter = DraftModelProposer(config)
            self.drafter.load_model()
        draft_bytes = self.drafter.kv_bytes_per_block() if self.drafter is not None else 0
        num_blocks = self.model_runner.determine_num_blocks(extra_bytes_per_block=draft_bytes)
        _check_pool_holds_a_sequence(config, num_blocks)
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)
        self.config = dataclasses.replace(
            config, cache_config=dataclasses.replace(config.cache_config, num_gpu_blocks=num_blocks)
        )
        mc = self.config.model_config
        self.structured_output_manager = StructuredOutputManager(
            self.config, functools.partial(load_tokenizer, mc.model_path, mc.tokenizer))
        self.scheduler = Scheduler(
            self.config.scheduler_config,
            self.config.cache_config,
            log_stats=not config.observability_config.disable_log_stats,
            structured_output_manager=self.structured_output_manager,
            speculative_config=self.config.speculative_config,
        )
        self.block_hasher = None
        if config.cache_config.enable_prefix_caching:
            self.block_hasher = get_request_block_hasher(config.cache_config.block_size)
        self.check_invariants = envs.PAGELLM_CHECK_INVARIANTS
        # Aborts that arrive from another thread (the process's input thread) come twice:
        # early, applied between a forward and its update so an aborted request emits
        # nothing more, and in order with the adds. See receive_abort / abort_in_order.
        self._abort_seq = itertools.count()
        self._early_aborts: queue.SimpleQueue[tuple[int, list[str]]] = queue.SimpleQueue()
        self._aborts_done: set[int] = set()
        self._aborts_left: dict[int, list[str]] = {}
        # What loading left (torch, the model, the tokenizer: millions of objects) moves
        # to the collector's permanent generation, as vLLM's engine core does: a full
        # collection during decoding then scans only what steps allocate (profiled on the
        # default model before: 5% of a decode step's time in gc_collect_main).
        gc.collect()
        gc.freeze()
        logger.info("Engine core ready in %.2f s", time.perf_counter() - start)

    def ready_response(self) -> EngineCoreReadyResponse:
        return EngineCoreReadyResponse(num_gpu_blocks=self.config.cache_config.num_gpu_blocks or 0,
                                       quantization=self.config.model_config.quantization,
                                       rank=self.config.parallel_config.data_parallel_rank or 0,
                                       fingerprint=self.fingerprint)

    # -- requests --------------------------------------------------------------------

    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """Builds the core-side Request (and its prompt block hashes)."""
        return Request.from_engine_core_request(request, self.block_hasher)

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        if isinstance(request, EngineCoreRequest):
            request = self.preprocess_add_request(request)
        if request.sampling_params.structured_outputs is not None:
            self.structured_output_manager.grammar_init(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Aborts the requests the core holds; returns the ids it does not hold."""
        missing = [r for r in request_ids if r not in self.scheduler.requests]
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if self.drafter is not None:
            self.drafter.keep_only(self.scheduler.running_req_ids())
        return missing

    def receive_abort(self, request_ids: list[str]) -> int:
        """Thread-safe: notes an abort that has just arrived and returns its number; the
        caller then queues (number, ids) for abort_in_order behind the adds before it."""
        seq = next(self._abort_seq)
        self._early_aborts.put((seq, request_ids))
        return seq

    def abort_in_order(self, seq: int, request_ids: list[str]) -> None:
        """The copy met in order with the adds: aborts what the early copy could not (ids
        whose ADD was still queued). Anything added after it is a newer request (an id
        reused), which it leaves alone."""
        if seq in self._aborts_left:
            self.abort_requests(self._aborts_left.pop(seq))
            return
        self._aborts_done.add(seq)
        self.abort_requests(request_ids)

    def _apply_early_aborts(self) -> None:
        """Between a forward and its update: aborts the requests the core holds now. Ids
        it does not hold may still be on their way; those are left to the in-order copy."""
        while True:
            try:
                seq, request_ids = self._early_aborts.get_nowait()
            except queue.Empty:
                return
            if seq in self._aborts_done:  # the in-order copy came first and did it all
                self._aborts_done.remove(seq)
            else:
                self._aborts_left[seq] = self.abort_requests(request_ids)

    # -- stepping --------------------------------------------------------------------

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Schedules, runs the model once and updates requests. Returns outputs per
        client index and whether the model ran."""
        if not self.scheduler.has_requests():
            return {}, False
        if self.drafter is not None:
            self._draft()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self.scheduler.waiting_for_grammar:
            # Nothing runs until a grammar is ready: wait for one instead of spinning (the
            # compile thread needs the core), a few ms at a time so inputs are still read.
            self.structured_output_manager.wait_for_any(self.scheduler.waiting_for_grammar, 0.005)
        runner_output = self.model_runner.execute_model(scheduler_output)
        self._apply_early_aborts()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.drafter is not None:  # finished and preempted requests' draft KV
            self.drafter.keep_only(self.scheduler.running_req_ids())
        if self.check_invariants:
            self.scheduler.check_invariants()
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def _draft(self) -> None:
        """The draft model's proposals for the step about to be scheduled (vLLM drafts at
        the end of the step before; the same tokens, one step's order earlier)."""
        assert self.drafter is not None
        wanted = self.scheduler.draft_requests()
        if wanted:
            self.scheduler.update_draft_token_ids(self.drafter.propose([
                DraftRequest(r.request_id, r.all_token_ids, r.num_prompt_tokens, k) for r, k in wanted]))

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    # -- utilities (callable through the client's call_utility) -------------------------

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def get_scheduler_stats(self) -> dict[str, Any]:
        """A plain dict (utility results cross the wire without their struct type)."""
        return msgspec.structs.asdict(self.scheduler.make_stats())

    def get_spec_decode_totals(self) -> dict[str, Any]:
        """Speculative decoding since start: verify runs, proposed and accepted tokens, and
        the draft model's forwards (0 without one)."""
        totals = self.scheduler.spec_totals
        return {"num_drafts": totals.num_drafts, "num_draft_tokens": totals.num_draft_tokens,
                "num_accepted_tokens": totals.num_accepted_tokens,
                "draft_forwards": self.drafter.num_forwards if self.drafter is not None else 0}

    def get_num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def run_check_invariants(self) -> bool:
        self.scheduler.check_invariants()
        return True

    def get_pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        stop_ranks = getattr(self.model_runner, "shutdown", None)
        if stop_ranks is not None:  # tensor parallelism: the other ranks' processes
            stop_ranks()


def _check_pool_holds_a_sequence(config: EngineConfig, num_blocks: int) -> None:
    """A pool that cannot hold one max_model_len sequence would cut long requests short
    at run time; refuse at start instead and say what would fit (as vLLM does)."""
    block_size, max_len = config.cache_config.block_size, config.model_config.max_model_len
    holds = (num_blocks - 1) * block_size  # block 0 is the null block
    if holds < max_len:
        raise ValueError(
            f"The KV cache holds {holds} tokens ({num_blocks - 1} blocks of {block_size}), fewer "
            f"than one sequence of max_model_len={max_len}; lower max_model_len to at most {holds} "
            "or give the cache more room (kv_cache_memory_bytes, num_gpu_blocks_override)."
        )


def _set_num_threads(config: EngineConfig) -> None:
    """Each of the machine's compute processes (its engine cores' tensor-parallel ranks)
    takes its share of the cores."""
    pc = config.parallel_config
    platform_of(config.device_config.device).set_num_threads(
        pc.num_engines_on_this_machine * pc.tensor_parallel_size, envs.PAGELLM_NUM_THREADS)
