"""POST /v1/chat/completions: messages -> chat template -> AsyncLLM -> OpenAI chat JSON
or SSE chunks (first chunk carries the role, the last one the finish reason)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagellm.entrypoints.chat_utils import apply_chat_template
from pagellm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobContent,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTopLogprob,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from pagellm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    as_openai_error,
    merge_generators,
    sse,
)
from pagellm.outputs import CompletionOutput


class OpenAIServingChat(OpenAIServing):
    def _prepare(self, request: ChatCompletionRequest) -> tuple[str, list[int], object]:
        self.check_model(request.model)
        self.check_alive()
        if request.tools:
            raise OpenAIError("tools are not supported by this server", param="tools")
        try:
            prompt = apply_chat_template(
                self.tokenizer, request.messages, request.chat_template or self.chat_template,
                request.add_generation_prompt, request.continue_final_message,
                **(request.chat_template_kwargs or {}),
            )
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from e
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.validate_length(ids, request.requested_max_tokens, param)
        return prompt, ids, request.to_sampling_params(max_tokens)

    async def create(self, request: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        prompt, ids, params = self._prepare(request)
        request_id = random_id("chatcmpl")
        gen = self.engine.generate({"prompt_token_ids": ids, "prompt": prompt}, params, request_id,
                                   priority=request.priority)
        if request.stream:
            return self._stream(request, request_id, ids, gen)
        final = None
        try:
            async for _, out in merge_generators([gen]):
                final = out
        except Exception as e:
            raise as_openai_error(e) from e
        assert final is not None
        choices = []
        completion_tokens = 0
        for c in sorted(final.outputs, key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            choices.append(ChatChoice(
                index=c.index,
                message=ChatMessage(role="assistant", content=c.text),
                logprobs=self._logprobs(c) if request.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            ))
        usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                          total_tokens=len(ids) + completion_tokens)
        return ChatCompletionResponse(id=request_id, model=request.model or self.served_model_names[0],
                                      choices=choices, usage=usage)

    def _logprobs(self, c: CompletionOutput) -> ChatLogprobs:
        content = []
        for tok, entry in zip(c.token_ids, c.logprobs or []):
            token = self.tokenizer.decode([tok])
            tops = [
                ChatTopLogprob(token=(lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([t])),
                               logprob=lp.logprob, bytes=list(self.tokenizer.decode([t]).encode()))
                for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
                if t != tok or (lp.rank or 0) > 0
            ]
            sampled = entry.get(tok)
            content.append(ChatLogprobContent(
                token=token, logprob=sampled.logprob if sampled else float("-inf"),
                bytes=list(token.encode()), top_logprobs=tops,
            ))
        return ChatLogprobs(content=content)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, ids: list[int], gen) -> AsyncIterator[str]:
        model = request.model or self.served_model_names[0]
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        completion_tokens = 0
        started: set[int] = set()
        try:
            async for _, out in merge_generators([gen]):
                for c in out.outputs:
                    if c.index not in started:
                        started.add(c.index)
                        yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[ChatStreamChoice(
                            index=c.index, delta=DeltaMessage(role="assistant", content=""))]))
                    completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None:
                        continue
                    delta = DeltaMessage(content=c.text) if c.text else DeltaMessage()
                    yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[ChatStreamChoice(
                        index=c.index, delta=delta,
                        logprobs=self._logprobs(c) if request.logprobs else None,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    )]))
            if include_usage:
                usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                                  total_tokens=len(ids) + completion_tokens)
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage))
        except Exception as e:
            yield sse(as_openai_error(e).response())
        yield SSE_DONE
