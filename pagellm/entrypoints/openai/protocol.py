"""OpenAI-compatible request and response bodies (pydantic), with vLLM's extra fields.

Validation here names the offending parameter; the server turns a failure into OpenAI's
error JSON with status 400. `to_sampling_params` maps a request onto SamplingParams.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_serializer, model_validator

from pagellm.entrypoints.chat_utils import CHAT_ROLES
from pagellm.logger import init_logger
from pagellm.sampling_params import (
    ALL_LOGPROBS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

logger = init_logger(__name__)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI's API does.
    model_config = ConfigDict(extra="allow")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1)  # at most --max-n (serving_limits.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: the logprobs of each prompt token and its top-k (-1: the whole vocabulary);
    # at most --max-logprobs, not with stream
    prompt_logprobs: int | None = Field(None, ge=ALL_LOGPROBS)

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> SamplingFields:
        # OpenAI's API ignores unknown fields; say which, so a misspelt option is visible.
        if self.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(self.model_extra))
        return self

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint the request asks for and the field it came from."""
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.type != "text":
                raise ValueError("give either response_format or structured_outputs, not both")
            try:
                return StructuredOutputsParams(**self.structured_outputs), "structured_outputs"
            except TypeError as e:  # an unknown key
                raise ValueError(f"structured_outputs: {e}") from None
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None, None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        assert fmt.json_schema is not None
        schema = fmt.json_schema.json_schema
        return StructuredOutputsParams(json=schema if schema is not None else {}), "response_format"

    @model_validator(mode="after")
    def _check_logit_bias(self) -> SamplingFields:
        for key, value in (self.logit_bias or {}).items():
            try:
                int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def _sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be unset or equal to n)")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        return self

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        # echo with logprobs scores the echoed prompt too; with prompt_logprobs as well,
        # the engine computes the wider of the two
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            wider = ALL_LOGPROBS in (prompt_logprobs, self.logprobs)
            prompt_logprobs = ALL_LOGPROBS if wider else max(prompt_logprobs or 0, self.logprobs)
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        for i, msg in enumerate(self.messages):
            role = msg.get("role")
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        k = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, k, self.prompt_logprobs)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """One token's entry in `prompt_logprobs` (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsJson = list[dict[int, PromptLogprob] | None]
"""Per prompt token: {token id: entry} for the prompt's token and the top-k; the first
token's is None (nothing predicts it)."""


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsJson | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsJson | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        # A stream delta carries only what changed: {"content": "..."} or {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagellm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages must be given")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# -- /v1/embeddings --------------------------------------------------------------------


class EmbeddingRequest(OpenAIBaseModel):
    """OpenAI's embeddings request; `normalize` and `priority` are vLLM's extras."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    normalize: bool | None = None
    priority: int = Field(0, ge=-(2**63), lt=2**63)

    # What the server's per-request caps and admission read from any request: one
    # sequence per input, the inputs counted as completions' prompts are.
    @property
    def n(self) -> int:
        return 1

    @property
    def prompt(self) -> str | list[str] | list[int] | list[list[int]]:
        return self.input

    @property
    def stop(self) -> None:
        return None


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 little-endian bytes, as OpenAI's


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


# -- /score and /rerank ----------------------------------------------------------------


class PoolingTexts(OpenAIBaseModel):
    """What the server's per-request caps and admission read from a request that embeds
    texts: one sequence per distinct text (the texts counted as completions' prompts are)."""

    @property
    def n(self) -> int:
        return 1

    @property
    def prompt(self) -> list[str]:
        return list(dict.fromkeys(self.texts()))

    @property
    def stop(self) -> None:
        return None

    def texts(self) -> list[str]:
        raise NotImplementedError


class ScoreRequest(PoolingTexts):
    """vLLM's score request: text_1 against text_2, 1:1, 1:N or N:N. vLLM's newer names
    `queries` and `documents` are accepted for them."""

    model: str | None = None
    text_1: str | list[str] = Field(validation_alias=AliasChoices("text_1", "queries"))
    text_2: str | list[str] = Field(validation_alias=AliasChoices("text_2", "documents"))
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = Field(0, ge=-(2**63), lt=2**63)

    def texts(self) -> list[str]:
        return [*_as_list(self.text_1), *_as_list(self.text_2)]


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankRequest(PoolingTexts):
    """vLLM's rerank request (Jina's and Cohere's shape); top_n <= 0 means every document.
    `return_documents` is Cohere's: false leaves each result's document out."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = 0
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = Field(0, ge=-(2**63), lt=2**63)

    def texts(self) -> list[str]:
        return [self.query, *self.documents]


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _as_list(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else texts
