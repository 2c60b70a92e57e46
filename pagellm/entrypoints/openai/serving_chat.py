"""POST /v1/chat/completions: messages -> chat template -> AsyncLLM -> OpenAI chat JSON
or SSE chunks (first chunk carries the role, the last one the finish reason)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagellm.entrypoints.chat_utils import apply_chat_template, validate_messages
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
    random_id,
)
from pagellm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    as_openai_error,
    merge_generators,
    sse,
    usage,
)
from pagellm.outputs import CompletionOutput
from pagellm.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    def _prepare(self, request: ChatCompletionRequest) -> tuple[str, list[int], SamplingParams]:
        self.check_model(request.model)
        self.check_alive()
        if request.tools:
            raise OpenAIError("tools are not supported by this server", param="tools")
        kwargs = dict(request.chat_template_kwargs or {})
        sent_template = request.chat_template or kwargs.pop("chat_template", None)
        if sent_template is not None and not self.trust_request_chat_template:
            # A template is code run by the server: only the operator's are trusted.
            raise OpenAIError(
                "chat_template in the request is refused: this server runs only its own chat "
                "template unless it is started with --trust-request-chat-template.",
                param="chat_template",
            )
        try:
            prompt = apply_chat_template(
                self.tokenizer, request.messages, sent_template or self.chat_template,
                request.add_generation_prompt, request.continue_final_message, **kwargs,
            )
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from e
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.validate_length(ids, request.requested_max_tokens, param)
        params = request.to_sampling_params(max_tokens)
        self.check_sampling_params(params)
        return prompt, ids, params

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
        echo = _echoed(request)
        choices = []
        completion_tokens = 0
        for c in sorted(final.outputs, key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            choices.append(ChatChoice(
                index=c.index,
                message=ChatMessage(role="assistant", content=echo + c.text),
                logprobs=self._logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            ))
        return ChatCompletionResponse(id=request_id, model=request.model or self.served_model_names[0],
                                      choices=choices, usage=usage(len(ids), completion_tokens))

    def _logprobs(self, c: CompletionOutput, top: int) -> ChatLogprobs:
        """Per token: the sampled token's logprob and exactly `top` alternatives, the most
        likely first (the engine's entry may hold one more: the sampled token itself)."""
        content = []
        for tok, entry in zip(c.token_ids, c.logprobs or []):
            token = self.tokenizer.decode([tok])
            ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top),
                            key=lambda kv: kv[1].rank or 0)
            tops = [
                ChatTopLogprob(token=(lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([t])),
                               logprob=lp.logprob, bytes=list(self.tokenizer.decode([t]).encode()))
                for t, lp in ranked
            ]
            sampled = entry.get(tok)
            content.append(ChatLogprobContent(
                token=token, logprob=sampled.logprob if sampled else float("-inf"),
                bytes=list(token.encode()), top_logprobs=tops,
            ))
        return ChatLogprobs(content=content)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, ids: list[int], gen) -> AsyncIterator[str]:
        model = request.model or self.served_model_names[0]
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        echo = _echoed(request)
        completion_tokens = 0
        started: set[int] = set()

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice],
                                           usage=usage(len(ids), completion_tokens) if continuous else None))

        try:
            async for _, out in merge_generators([gen]):
                for c in out.outputs:
                    if c.index not in started:
                        started.add(c.index)
                        yield chunk(ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=echo)))
                    completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None:
                        continue
                    delta = DeltaMessage(content=c.text) if c.text else DeltaMessage()
                    yield chunk(ChatStreamChoice(
                        index=c.index, delta=delta,
                        logprobs=self._logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    ))
            if include_usage:
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[],
                                              usage=usage(len(ids), completion_tokens)))
        except Exception as e:
            yield sse(as_openai_error(e).response())
        yield SSE_DONE


def _echoed(request: ChatCompletionRequest) -> str:
    """With echo, the reply starts with the last message when that is the assistant's own
    (a reply being continued); otherwise nothing is echoed."""
    if not request.echo:
        return ""
    last = validate_messages(request.messages[-1:])[0]
    return last["content"] if last.get("role") == "assistant" else ""
