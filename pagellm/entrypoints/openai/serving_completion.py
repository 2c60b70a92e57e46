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
    random_id,
)
from pagellm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    as_openai_error,
    merge_generators,
    prompt_logprobs_json,
    sse,
    usage,
)
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import ALL_LOGPROBS


class OpenAIServingCompletion(OpenAIServing):
    def _prepare(self, request: CompletionRequest) -> list[tuple[str | None, list[int], Any]]:
        """Returns (prompt text, prompt ids, sampling params) per prompt; raises OpenAIError."""
        self.check_model(request.model)
        self.check_alive()
        self.check_prompt_logprobs(request)
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
            params = request.to_sampling_params(max_tokens)
            self.check_sampling_params(params)
            prepared.append((text, ids, params))
        return prepared

    async def create(self, request: CompletionRequest,
                     request_id: str | None = None) -> CompletionResponse | AsyncIterator[str]:
        prepared = self._prepare(request)
        constraint, field = self.requested_constraint(request)
        for _, _, params in prepared:
            await self.attach_structured_outputs(params, constraint, field)
        base_id = f"cmpl-{request_id}" if request_id else random_id("cmpl")
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
            prompt_lps = prompt_logprobs_json(out.prompt_logprobs) if request.prompt_logprobs is not None else None
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                lp = None
                if request.logprobs is not None:
                    lp = self._logprobs(*self._scored(request, ids, out.prompt_logprobs, c))
                choices.append(CompletionChoice(
                    index=i * request.n + c.index,
                    text=prefix + c.text,
                    logprobs=lp,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_lps,
                ))
        return CompletionResponse(id=base_id, model=self._model_name(request), choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens))

    def _model_name(self, request: CompletionRequest) -> str:
        return request.model or self.served_model_names[0]

    @staticmethod
    def _scored(request: CompletionRequest, prompt_ids: list[int], prompt_logprobs: list | None,
                c: CompletionOutput) -> tuple[list[int], list]:
        """The tokens a choice's logprobs cover and their entries: with echo the prompt's
        tokens come first (the first has no entry: nothing predicts it), as in OpenAI's
        legacy API."""
        if request.echo:
            echoed = [_top(e, request.logprobs) for e in prompt_logprobs or [None] * len(prompt_ids)]
            return [*prompt_ids, *c.token_ids], [*echoed, *(c.logprobs or [])]
        return list(c.token_ids), list(c.logprobs or [])

    def _logprobs(self, token_ids: list[int], logprobs: list, offset: int = 0) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for tok, entry in zip(token_ids, logprobs):
            token_text = self.tokenizer.decode([tok])
            result.tokens.append(token_text)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
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
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        prompt_tokens = sum(len(ids) for _, ids, _ in prepared)
        completion_tokens = 0
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        prompt_lps: dict[int, list] = {}
        try:
            async for i, out in merge_generators(gens):
                text_p, ids, _ = prepared[i]
                if out.prompt_logprobs is not None:
                    prompt_lps.setdefault(i, out.prompt_logprobs)
                for c in out.outputs:
                    index = i * request.n + c.index
                    text = c.text
                    first = request.echo and index not in echoed
                    if first:
                        echoed.add(index)
                        text = (text_p if text_p is not None else self.tokenizer.decode(ids)) + text
                    completion_tokens += len(c.token_ids)
                    lp = None
                    if request.logprobs is not None:
                        token_ids, entries = list(c.token_ids), list(c.logprobs or [])
                        if first:  # the echoed prompt's tokens lead the first chunk
                            token_ids = [*ids, *token_ids]
                            entries = [*prompt_lps.get(i, [None] * len(ids)), *entries]
                        lp = self._logprobs(token_ids, entries, offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp.tokens)
                    yield sse(CompletionResponse(
                        id=base_id, model=model,
                        choices=[CompletionChoice(index=index, text=text, logprobs=lp,
                                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)],
                        usage=usage(prompt_tokens, completion_tokens) if continuous else None,
                    ))
            if include_usage:
                yield sse(CompletionResponse(id=base_id, model=model, choices=[],
                                             usage=usage(prompt_tokens, completion_tokens)))
        except Exception as e:
            yield sse(as_openai_error(e).response())
        yield SSE_DONE


def _top(entry: dict[int, Logprob] | None, k: int | None) -> dict[int, Logprob] | None:
    """A prompt position's entry cut to its token and the top k: prompt_logprobs may have
    made the engine compute more than an echo's logprobs asks for."""
    if entry is None or k is None or k == ALL_LOGPROBS:
        return entry
    first = next(iter(entry), None)
    return {t: lp for t, lp in entry.items() if t == first or (lp.rank is not None and lp.rank <= k)}
