"""POST /v1/completions: prompts (text or token ids) -> AsyncLLM -> OpenAI completion JSON
or SSE chunks. Choice index = prompt index * n + completion index."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pagellm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from pagellm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    as_openai_error,
    merge_generators,
    sse,
)
from pagellm.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    def _prepare(self, request: CompletionRequest) -> list[tuple[str | None, list[int], Any]]:
        """Returns (prompt text, prompt ids, sampling params) per prompt; raises OpenAIError."""
        self.check_model(request.model)
        self.check_alive()
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        prepared = []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, add_special_tokens=True)
                text: str | None = item
            else:
                ids = list(item)
                self.check_token_ids(ids, "prompt")
                text = None
            max_tokens = self.validate_length(ids, request.max_tokens)
            prepared.append((text, ids, request.to_sampling_params(max_tokens)))
        return prepared

    async def create(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        prepared = self._prepare(request)
        base_id = random_id("cmpl")
        gens = [
            self.engine.generate({"prompt_token_ids": ids, "prompt": text}, params, f"{base_id}-{i}",
                                 priority=request.priority)
            for i, (text, ids, params) in enumerate(prepared)
        ]
        if request.stream:
            return self._stream(request, base_id, prepared, gens)
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge_generators(gens):
                finals[i] = out
        except Exception as e:
            raise as_openai_error(e) from e
        return self._response(request, base_id, prepared, finals)

    def _response(self, request: CompletionRequest, base_id: str, prepared: list, finals: dict[int, RequestOutput]) -> CompletionResponse:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, (text, ids, _) in enumerate(prepared):
            out = finals[i]
            prompt_tokens += len(ids)
            prefix = (text if text is not None else self.tokenizer.decode(ids)) if request.echo else ""
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                choices.append(CompletionChoice(
                    index=i * request.n + c.index,
                    text=prefix + c.text,
                    logprobs=self._logprobs(c, len(prefix)) if request.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                ))
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        return CompletionResponse(id=base_id, model=self._model_name(request), choices=choices, usage=usage)

    def _model_name(self, request: CompletionRequest) -> str:
        return request.model or self.served_model_names[0]

    def _logprobs(self, c: CompletionOutput, offset: int, token_ids: list[int] | None = None,
                  logprobs: list | None = None) -> CompletionLogprobs:
        token_ids = c.token_ids if token_ids is None else token_ids
        logprobs = (c.logprobs or []) if logprobs is None else logprobs
        result = CompletionLogprobs()
        for tok, entry in zip(token_ids, logprobs):
            token_text = self.tokenizer.decode([tok])
            result.tokens.append(token_text)
            result.token_logprobs.append(entry[tok].logprob if tok in entry else None)
            result.top_logprobs.append({
                (lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([t])): lp.logprob
                for t, lp in entry.items()
            })
            result.text_offset.append(offset)
            offset += len(token_text)
        return result

    async def _stream(self, request: CompletionRequest, base_id: str, prepared: list, gens: list) -> AsyncIterator[str]:
        model = self._model_name(request)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        completion_tokens = 0
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        try:
            async for i, out in merge_generators(gens):
                text_p, ids, _ = prepared[i]
                for c in out.outputs:
                    index = i * request.n + c.index
                    text = c.text
                    if request.echo and index not in echoed:
                        echoed.add(index)
                        text = (text_p if text_p is not None else self.tokenizer.decode(ids)) + text
                    completion_tokens += len(c.token_ids)
                    lp = None
                    if request.logprobs is not None:
                        lp = self._logprobs(c, offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp.tokens)
                    chunk = CompletionResponse(id=base_id, model=model, choices=[CompletionChoice(
                        index=index, text=text, logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    )])
                    yield sse(chunk)
            if include_usage:
                prompt_tokens = sum(len(ids) for _, ids, _ in prepared)
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                  total_tokens=prompt_tokens + completion_tokens)
                yield sse(CompletionResponse(id=base_id, model=model, choices=[], usage=usage))
        except Exception as e:
            yield sse(as_openai_error(e).response())
        yield SSE_DONE
