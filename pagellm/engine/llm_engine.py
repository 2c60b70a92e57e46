"""LLMEngine: the synchronous engine behind `LLM` (add_request / step loop).

Frontend only: tokenizes through the InputProcessor, sends EngineCoreRequests through an
EngineCoreClient (in-process or a separate process) and turns EngineCoreOutputs into
RequestOutputs with the OutputProcessor.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.core.protocol import EngineCoreRequest
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_client import EngineCoreClient
from pagellm.engine.input_processor import InputProcessor
from pagellm.engine.output_processor import OutputProcessor, ParentRequest
from pagellm.inputs import PromptType
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


def load_frontend(config: EngineConfig) -> tuple[Any, InputProcessor]:
    from pagellm.model_executor.loader import load_tokenizer

    tokenizer = load_tokenizer(config.model_config.model_path, config.model_config.tokenizer)
    return tokenizer, InputProcessor(
        config.model_config,
        tokenizer,
        config.parallel_config.data_parallel_size,
        structured_outputs_backend=config.structured_outputs_config.backend,
    )


def start_frontend_and_core(config: EngineConfig, make_client: Callable[[], EngineCoreClient]) -> tuple[Any, InputProcessor, EngineCoreClient]:
    """Loads the tokenizer on a thread while the engine core starts, so start-up pays for
    the slower of the two, not their sum."""
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        frontend = pool.submit(load_frontend, config)
        try:
            client = make_client()
        except BaseException:
            frontend.cancel()
            raise
        try:
            tokenizer, input_processor = frontend.result()
        except BaseException:
            client.shutdown()
            raise
    return tokenizer, input_processor, client


def apply_ready_response(config: EngineConfig, client: EngineCoreClient) -> EngineConfig:
    """Writes what the engine core measured (KV blocks, the quantization its kernels
    allow) back into the frontend's config."""
    ready = client.ready
    return dataclasses.replace(
        config,
        model_config=dataclasses.replace(config.model_config, quantization=ready.quantization),
        cache_config=dataclasses.replace(config.cache_config, num_gpu_blocks=ready.num_gpu_blocks),
    )


def resolve_multiprocess_mode(multiprocess_mode: bool | None) -> bool:
    """multiprocess_mode, None meaning PAGELLM_ENABLE_MULTIPROCESSING. When the engine core
    will compute in this process, first imports torch with pagellm's OpenMP wait policy
    (envs.import_torch_with_openmp_defaults; nothing changes if torch is already loaded),
    before anything here imports it (the tokenizer, the config, the engine core)."""
    if multiprocess_mode is None:
        multiprocess_mode = envs.PAGELLM_ENABLE_MULTIPROCESSING
    if not multiprocess_mode:
        envs.import_torch_with_openmp_defaults()
    return multiprocess_mode


class LLMEngine:
    def __init__(self, config: EngineConfig, multiprocess_mode: bool | None = None, log_stats: bool = False):
        multiprocess_mode = resolve_multiprocess_mode(multiprocess_mode)
        self.tokenizer, self.input_processor, self.engine_core = start_frontend_and_core(
            config, lambda: EngineCoreClient.make_client(multiprocess_mode, False, config)
        )
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=log_stats)
        self.config = apply_ready_response(config, self.engine_core)
        self.model_config = self.config.model_config

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess_mode: bool | None = None) -> LLMEngine:
        # create_engine_config may import torch (to ask for a GPU): resolve first.
        multiprocess_mode = resolve_multiprocess_mode(multiprocess_mode)
        return cls(engine_args.create_engine_config(), multiprocess_mode)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> None:
        request, prompt_text = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time or time.time(), priority, add_special_tokens
        )
        parent, core_requests = fan_out(request)
        try:
            for index, core_request in enumerate(core_requests):
                self.output_processor.add_request(core_request, prompt_text, parent, index)
                self.engine_core.add_request(core_request)
        except BaseException:
            self.abort_request([request_id])  # a failed add leaves nothing behind
            raise

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def abort_request(self, request_ids: list[str]) -> None:
        internal = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(internal)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def fan_out(request: EngineCoreRequest) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
    """The requests the engine core runs for one user request: the request itself when
    n == 1, else n children (one completion each) under a ParentRequest that gathers
    their outputs. Shared by LLMEngine and AsyncLLM."""
    if request.sampling_params.n == 1:
        return None, [request]
    parent = ParentRequest(request.request_id, request.sampling_params)
    return parent, [_with(request, child_id, params) for child_id, params in parent.make_child_requests()]


def _with(request: EngineCoreRequest, request_id: str, params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=params,
        arrival_time=request.arrival_time,
        priority=request.priority,
        data_parallel_rank=request.data_parallel_rank,
        client_index=request.client_index,
    )
