"""InputProcessor: a user prompt + SamplingParams -> a validated EngineCoreRequest.

Tokenizes text prompts, accepts token-id prompts, fills max_tokens and the stop ids the
engine core needs, and rejects what cannot run (a prompt longer than the context is an
error, never a silent truncation). Text work stays here, in the frontend.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from pagellm.config import ModelConfig
from pagellm.core.protocol import EngineCoreRequest
from pagellm.inputs import PromptType
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import ALL_LOGPROBS, RequestOutputKind, SamplingParams

GENERATE_ON_POOLING = ("This engine runs the model as a pooling (embedding) model (--runner pooling / "
                       "--convert embed): it returns embeddings, not generated text. Start it without "
                       "--runner pooling and --convert embed to generate.")
POOLING_ON_GENERATE = ("This engine runs the model for generation; embeddings need a pooling engine: "
                       "start it with --runner pooling (or --convert embed), LLM(model, runner='pooling') "
                       "offline.")


def generate_on_pooling(model_config: ModelConfig) -> str:
    """The error for a generation request on a pooling engine: an encoder can do nothing
    else, a decoder run as an embedding model can generate under another engine."""
    if model_config.is_encoder_only:
        return (f"This engine runs {model_config.architecture}, an encoder (embedding) model: it returns "
                "embeddings and cannot generate text.")
    return GENERATE_ON_POOLING


class InputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        data_parallel_size: int = 1,
        structured_outputs_backend: str = "auto",
    ):
        self.model_config = model_config
        self.structured_outputs_backend = structured_outputs_backend
        self.data_parallel_size = data_parallel_size
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        # generation_config.json may list extra EOS ids that also stop generation.
        self.eos_token_id, self.extra_stop_ids = model_config.eos_token_ids(tokenizer)

    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers.")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"], add_special_tokens=add_special_tokens)
            raise ValueError("A prompt dict needs a 'prompt' (str) or 'prompt_token_ids' (list of int) key.")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"Unsupported prompt type {type(prompt).__name__}: expected str, a token-id list or a dict.")

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
        data_parallel_rank: int | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """A SamplingParams request on a generate engine, a PoolingParams one on a pooling
        engine; the other way round is the caller's error, naming the flag."""
        pooling = isinstance(params, PoolingParams)
        if pooling != (self.model_config.runner_type == "pooling"):
            raise ValueError(POOLING_ON_GENERATE if pooling else generate_on_pooling(self.model_config))
        # Checked here, in the caller: a field of the wrong type would fail only when the
        # engine core decodes the message, far from the request that caused it.
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}.")
        if not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a signed 64-bit integer, got {priority!r}.")
        if data_parallel_rank is not None and not (
            isinstance(data_parallel_rank, int) and 0 <= data_parallel_rank < self.data_parallel_size
        ):
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank!r} is out of range [0, {self.data_parallel_size})."
            )
        prompt_text, prompt_ids = self.tokenize_prompt(prompt, add_special_tokens)
        self._validate_prompt(prompt_ids, pooling)
        pooling_params = None
        if isinstance(params, PoolingParams):
            pooling_params = self.complete_pooling_params(params)
            # The core reads max_tokens and the output kind of every request; a pooling
            # request samples nothing, and finishes when its prompt has run.
            params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        else:
            params = self._complete_params(params, len(prompt_ids))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            pooling_params=pooling_params,
        )
        return request, prompt_text

    def _validate_prompt(self, prompt_ids: list[int], pooling: bool = False) -> None:
        if not prompt_ids:
            raise ValueError("The prompt is empty: it must contain at least one token.")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"Token id {bad} in the prompt is out of vocabulary range [0, {self.vocab_size}).")
        max_len = self.model_config.max_model_len
        if pooling and len(prompt_ids) > max_len:  # vLLM's words
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{len(prompt_ids)} tokens in the input for embedding generation. Please reduce the "
                "length of the input."
            )
        if not pooling and len(prompt_ids) >= max_len:
            raise ValueError(
                f"The prompt (length {len(prompt_ids)}) is longer than the maximum model length "
                f"of {max_len}; it must be shorter so at least one token can be generated."
            )

    def _complete_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        params = params.clone()
        params.verify_token_ids(self.vocab_size)
        self._validate_logprobs(params)
        room = self.model_config.max_model_len - prompt_len
        params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.min_tokens > params.max_tokens:
            params.min_tokens = params.max_tokens
        if params.top_k >= self.vocab_size:  # keeps every token; also fits the wire's int64
            params.top_k = 0
        params.eos_token_id = self.eos_token_id
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [t for t in self.extra_stop_ids if t not in stop_ids]
        params.all_stop_token_ids = stop_ids
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_ids(params.bad_words)
        if params.structured_outputs is not None:
            self._validate_structured_outputs(params)
        _check_wire_types(params)
        return params

    def complete_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """dimensions checked against the model (matryoshka only, as vLLM); normalize
        filled with the model's default."""
        params = params.clone()
        mc = self.model_config
        if params.dimensions is not None:
            if not mc.is_matryoshka:
                raise ValueError(
                    f'Model "{mc.served_model_name}" does not support matryoshka representation, '
                    "changing output dimensions will lead to poor results."
                )
            allowed = mc.matryoshka_dimensions
            if allowed is not None and params.dimensions not in allowed:
                raise ValueError(
                    f'Model "{mc.served_model_name}" only supports {allowed} matryoshka dimensions, '
                    f"using other output dimensions will lead to poor results."
                )
            if params.dimensions > mc.hidden_size:
                raise ValueError(f"dimensions {params.dimensions} is over the model's {mc.hidden_size}.")
        if params.normalize is None:
            assert mc.pooler_config is not None
            params.normalize = mc.pooler_config.normalize
        return params

    def _validate_logprobs(self, params: SamplingParams) -> None:
        """logprobs and prompt_logprobs against the engine's max_logprobs (-1, on either
        side, is the whole vocabulary), in vLLM's words."""
        cap = self.model_config.max_logprobs
        cap = self.vocab_size if cap == ALL_LOGPROBS else cap
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(params, name)
            if value is None:
                continue
            wanted = self.vocab_size if value == ALL_LOGPROBS else value
            if wanted > cap:
                raise ValueError(
                    f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: {cap} "
                    f"({name}={value} is over the engine's max_logprobs={self.model_config.max_logprobs})."
                )

    def _validate_structured_outputs(self, params: SamplingParams) -> None:
        """Checked here with the backend that will compile it, so a bad schema is the
        caller's error now, not a failed request later; the backend that accepted it
        goes with the request."""
        from pagellm.structured_output import validate_structured_outputs

        so = params.structured_outputs
        assert so is not None
        try:
            so.backend = validate_structured_outputs(so, self.structured_outputs_backend)
        except ValueError as e:
            raise ValueError(f"Invalid structured_outputs.{so.kind}: {e}") from None

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word is banned with and without a leading space."""
        seqs: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs


def _check_wire_types(params: SamplingParams) -> None:
    """msgspec checks no types on construction; the engine core's decoder does, and a
    request it cannot decode would fail there, far from its caller. Decoding here first
    turns that into the caller's ValueError, naming the field (`$.stop[0]`)."""
    try:
        msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    except (msgspec.ValidationError, OverflowError, TypeError) as e:
        raise ValueError(f"Invalid sampling parameters: {e}") from None
