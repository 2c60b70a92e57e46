"""Shared request handling of the OpenAI endpoints: model check, prompt validation,
errors in OpenAI's shape, merging several generate() streams, SSE framing."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from http import HTTPStatus
from typing import Any

from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.exceptions import EngineDeadError, EngineRestartingError, StreamTooSlowError
from pagellm.engine.input_processor import POOLING_ON_GENERATE
from pagellm.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobsJson,
    UsageInfo,
)
from pagellm.outputs import PromptLogprobs, RequestOutput
from pagellm.sampling_params import ALL_LOGPROBS, SamplingParams, StructuredOutputsParams


class OpenAIError(Exception):
    """An error to return to the client as OpenAI's error JSON."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers
        self.err_type = err_type or {
            HTTPStatus.BAD_REQUEST: "BadRequestError",
            HTTPStatus.UNAUTHORIZED: "AuthenticationError",
            HTTPStatus.NOT_FOUND: "NotFoundError",
            HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
            HTTPStatus.REQUEST_TIMEOUT: "RequestTimeoutError",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
            HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
        }.get(status, "InternalServerError")

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.err_type, param=self.param, code=int(self.status)))


class Admission:
    """Admission control: requests beyond the running batch's capacity wait in the engine;
    past `max_queued` of them a new request gets 503 with Retry-After (as Ollama does at its
    queue cap) instead of joining an unbounded queue. Counts sequences (n per prompt) from
    acceptance to the end of the response."""

    def __init__(self, max_queued: int | None, capacity: int) -> None:
        self.max_queued = max_queued
        self.capacity = capacity
        self.in_flight = 0

    def take(self, n: int) -> AdmissionSlot:
        if self.max_queued is not None and self.in_flight + n > self.capacity + self.max_queued:
            waiting = max(0, self.in_flight - self.capacity)
            raise OpenAIError(
                f"The server is busy: {waiting} requests are waiting, its limit "
                f"(--max-num-queued-requests {self.max_queued}); retry later.",
                HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "1"},
            )
        self.in_flight += n
        return AdmissionSlot(self, n)


class AdmissionSlot:
    def __init__(self, admission: Admission, n: int) -> None:
        self._admission, self._n = admission, n

    def release(self) -> None:
        """Idempotent: the response's end and its garbage collection may both call it."""
        if self._n:
            self._admission.in_flight -= self._n
            self._n = 0


def engine_dead_error() -> OpenAIError:
    return OpenAIError(
        "The engine is dead and cannot serve requests; the server must be restarted.",
        HTTPStatus.SERVICE_UNAVAILABLE,
    )


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], chat_template: str | None = None,
                 metrics: Any = None, trust_request_chat_template: bool = False,
                 model_aliases: list[str] | None = None):
        self.engine = engine
        self.trust_request_chat_template = trust_request_chat_template
        self.served_model_names = served_model_names
        # Accepted in requests besides the served names, never listed (model_names.py).
        self.model_aliases = model_aliases or []
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        self.structured_outputs_backend = engine.config.structured_outputs_config.backend
        self.chat_template = chat_template
        self.metrics = metrics

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names and model not in self.model_aliases:
            raise OpenAIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model", "NotFoundError")

    def check_alive(self) -> None:
        if self.engine.errored:
            raise engine_dead_error()

    def check_pooling_engine(self) -> None:
        """Embeddings, scores and reranking need a pooling engine."""
        if self.engine.model_config.runner_type != "pooling":
            raise OpenAIError(POOLING_ON_GENERATE, param="model")

    def check_pooling_length(self, prompt_ids: list[int], param: str) -> None:
        """A text to embed fills at most the context (no token is generated after it)."""
        if len(prompt_ids) > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {len(prompt_ids)} tokens in the input for embedding generation. Please reduce "
                "the length of the input.", param=param)

    async def embed_all(self, prompts: list[list[int]], params: Any, base_id: str, priority: int) -> list[Any]:
        """Each prompt's pooled vector (numpy, float32), in order: one engine request per
        prompt, `{base_id}-{i}`, run together; a failure becomes OpenAI's error."""
        gens = [self.engine.encode({"prompt_token_ids": ids}, params, f"{base_id}-{i}", priority=priority)
                for i, ids in enumerate(prompts)]
        finals: dict[int, Any] = {}
        try:
            async for i, out in merge_generators(gens):  # type: ignore[arg-type]
                finals[i] = out
        except Exception as e:
            raise as_openai_error(e) from e
        return [finals[i].outputs.data for i in range(len(prompts))]

    def validate_length(self, prompt_ids: list[int], max_tokens: int | None, param: str = "max_tokens") -> int:
        """Returns the max_tokens to use; rejects prompts that leave no room."""
        n = len(prompt_ids)
        if n == 0:
            raise OpenAIError("The prompt is empty.", param="prompt")
        if n >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"request has {n} input tokens. Please reduce the length of the input.",
                param="prompt" if param == "max_tokens" else "messages",
            )
        if max_tokens is None:
            return self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise OpenAIError(
                f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {n} input tokens "
                f"({max_tokens} > {self.max_model_len} - {n}).",
                param=param,
            )
        return max_tokens

    def check_sampling_params(self, params: SamplingParams) -> None:
        """The token ids the params name (stop_token_ids, logit_bias, allowed_token_ids)
        are checked here, before a stream's 200 goes out, not when generation starts."""
        try:
            params.verify_token_ids(self.engine.model_config.vocab_size)
        except ValueError as e:
            param = next((n for n in ("stop_token_ids", "allowed_token_ids", "logit_bias") if str(e).startswith(n)), None)
            raise OpenAIError(str(e), param=param) from e

    @staticmethod
    def requested_constraint(request: Any) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's response_format / structured_outputs as one constraint."""
        try:
            return request.structured_outputs_params()
        except ValueError as e:
            field = "structured_outputs" if str(e).startswith("structured_outputs") else "response_format"
            raise OpenAIError(str(e), param=field) from e

    async def attach_structured_outputs(
        self, params: SamplingParams, constraint: StructuredOutputsParams | None, field: str | None
    ) -> None:
        """Validates the request's output constraint with the grammar backend (in a thread:
        a large schema, or the backend's first import, must not hold up other streams)
        and attaches it; a bad one is a 400 naming the request field it came from."""
        if constraint is None:
            return
        from pagellm.structured_output import validate_structured_outputs

        try:
            constraint.backend = await asyncio.to_thread(
                validate_structured_outputs, constraint, self.structured_outputs_backend
            )
        except ValueError as e:
            raise OpenAIError(f"Invalid {field}: {e}", param=field) from e
        params.structured_outputs = constraint

    def check_prompt_logprobs(self, request: Any) -> None:
        """prompt_logprobs (vLLM's extra field): not with stream (vLLM refuses it too), and
        at most the engine's max_logprobs (-1, on either side, is the whole vocabulary)."""
        k = request.prompt_logprobs
        if k is None:
            return
        if request.stream:
            raise OpenAIError("prompt_logprobs is not supported with stream: true.", param="prompt_logprobs")
        vocab = self.engine.model_config.vocab_size
        cap = self.engine.model_config.max_logprobs
        cap = vocab if cap == ALL_LOGPROBS else cap
        wanted = vocab if k == ALL_LOGPROBS else k
        if wanted > cap:
            raise OpenAIError(f"Requested prompt logprobs of {wanted}, which is greater than max allowed: "
                              f"{cap} (--max-logprobs).", param="prompt_logprobs")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.model_config.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise OpenAIError(f"Token id {t} is out of vocabulary range [0, {vocab}).", param=param)


async def merge_generators(gens: list[AsyncGenerator[RequestOutput, None]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several generate() streams; closing this closes (and aborts) them all."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, gen: AsyncGenerator) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(drain(i, g)) for i, g in enumerate(gens)]
    remaining = len(gens)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # the drain tasks must be done before their generators can be closed
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


async def final_output(gen: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """The last output of one request's stream (a whole, non-streamed reply); an engine
    error as OpenAIError."""
    final = None
    try:
        async for _, out in merge_generators([gen]):
            final = out
    except Exception as e:
        raise as_openai_error(e) from e
    assert final is not None
    return final


def prompt_logprobs_json(entries: PromptLogprobs | None) -> PromptLogprobsJson | None:
    """RequestOutput.prompt_logprobs in the server's JSON shape (vLLM's)."""
    if entries is None:
        return None
    return [
        None if e is None else {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                                for t, lp in e.items()}
        for e in entries
    ]


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


# Characters that JSON leaves raw in a string but `str.splitlines` (httpx's `aiter_lines`,
# many hand-written SSE readers) takes for line ends. The SSE format ends lines only at
# CR and LF, so a compliant reader is unaffected, but a splitlines reader would get an
# event cut mid-JSON whenever a model emits one of them; their JSON escapes decode to
# the same text.
_SPLITLINES_ONLY = re.compile("[\x85\u2028\u2029]")


def sse_data(body: str) -> str:
    """One JSON text as an SSE `data:` field, safe for splitlines-based readers."""
    return _SPLITLINES_ONLY.sub(lambda m: f"\\u{ord(m.group()):04x}", body)


def sse(payload: Any) -> str:
    body = payload.model_dump_json(exclude_unset=False) if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {sse_data(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def as_openai_error(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineRestartingError):  # this request is lost; a retry soon may work
        return OpenAIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "5"})
    if isinstance(e, EngineDeadError):
        return engine_dead_error()
    if isinstance(e, StreamTooSlowError):  # the client stopped reading; the request is aborted
        return OpenAIError(str(e), HTTPStatus.REQUEST_TIMEOUT)
    if isinstance(e, ValueError):  # the request's fault; a TypeError is ours (500)
        return OpenAIError(str(e))
    return OpenAIError(f"Internal error: {type(e).__name__}: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)
