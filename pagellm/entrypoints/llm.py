"""LLM: the offline API (`LLM(model).generate(prompts, params)`, `.chat(messages)`, and
on a pooling engine `.embed(prompts)` / `.encode(prompts)` / `.score(data_1, data_2)`).

A thin shell over LLMEngine: adds every prompt as a FINAL_ONLY request, steps the engine
until all finish (with a tqdm progress bar) and returns results in input order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.input_processor import POOLING_ON_GENERATE
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints import score_utils
from pagellm.entrypoints.chat_utils import apply_chat_template
from pagellm.inputs import PromptType
from pagellm.outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        kwargs.setdefault("disable_log_stats", True)
        multiprocess_mode = kwargs.pop("multiprocess_mode", None)
        engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args, multiprocess_mode)
        self._request_counter = itertools.count()

    # -- public API ----------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate()/chat() use when given no SamplingParams: vLLM's defaults, with
        the sampling values of the model's generation_config.json (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens) in their place, as vLLM does."""
        gen = self.llm_engine.model_config.generation_config or {}
        names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
        return SamplingParams(**{ours: gen[theirs] for theirs, ours in names.items() if gen.get(theirs) is not None})

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: list[int] | None = None,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """use_tqdm: True for the progress bar, or a tqdm-like factory to make it."""
        _no_lora(lora_request)
        prompt_list = _as_prompt_list(prompts)
        return self._run(prompt_list, sampling_params, use_tqdm, priority, add_special_tokens=True)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """tools: rendered by the chat template when it lists tools, otherwise as a generic
        tool prompt asking for `<tool_call>{...}</tool_call>` replies (see chat_utils).
        Constrain the reply with SamplingParams(structured_outputs=...) if it must parse."""
        _no_lora(lora_request)
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        kwargs = dict(chat_template_kwargs or {})
        prompts = [
            apply_chat_template(
                tokenizer, conv, chat_template, add_generation_prompt, continue_final_message,
                tools=tools, **kwargs,
            )
            for conv in conversations
        ]
        return self._run(prompts, sampling_params, use_tqdm, None, add_special_tokens=False)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """The pooled final hidden state of each prompt (a pooling engine: runner='pooling'
        or convert='embed'); `outputs.data` is a float32 numpy array."""
        _no_lora(lora_request)
        if pooling_task not in (None, "embed", "encode"):
            raise ValueError(f"pooling_task {pooling_task!r} is not supported (embed, encode).")
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(pooling_params, len(prompt_list), PoolingParams)
        return self._run(prompt_list, params_list, use_tqdm, None, add_special_tokens=True)  # type: ignore[return-value]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`, a list of floats), pooled as
        the model's pooler config says and normalised unless PoolingParams says not."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                              pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def score(
        self,
        data_1: str | list[str],
        data_2: str | list[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | None = None,
        lora_request: None = None,
    ) -> list[ScoringRequestOutput]:
        """The similarity of text pairs on an embedding model, as vLLM scores them: the
        cosine of the two embeddings. Pairs are 1:1, 1:N (one data_1 text against each
        of data_2) or N:N; each distinct text is embedded once. truncate_prompt_tokens:
        keep each text's last k tokens (-1: the context length)."""
        _no_lora(lora_request)
        if self.llm_engine.model_config.runner_type != "pooling":
            raise ValueError(POOLING_ON_GENERATE)
        # 1. the pairs, and each distinct text's tokens, checked before anything runs
        pairs = score_utils.score_pairs(score_utils.as_text_list(data_1, "data_1"),
                                        score_utils.as_text_list(data_2, "data_2"), ("data_1", "data_2"))
        keep = score_utils.truncation_size(truncate_prompt_tokens, self.llm_engine.model_config.max_model_len)
        token_ids = score_utils.tokenize_texts(self.get_tokenizer(), [t for pair in pairs for t in pair], keep)
        # 2. one embedding per distinct text
        outputs = self.encode([{"prompt_token_ids": ids} for ids in token_ids.values()], pooling_params,
                              use_tqdm=use_tqdm, pooling_task="embed")
        embedded = dict(zip(token_ids, outputs))
        # 3. a score per pair
        results = []
        for a, b in pairs:
            out_1, out_2 = embedded[a], embedded[b]
            score = score_utils.cosine_similarity(out_1.outputs.data, out_2.outputs.data)
            results.append(ScoringRequestOutput(f"{out_1.request_id}_{out_2.request_id}", ScoringOutput(score),
                                                out_1.prompt_token_ids + out_2.prompt_token_ids, True))
        return results

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    # -- internals -----------------------------------------------------------------------

    def _run(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | Sequence[PoolingParams] | None,
        use_tqdm: bool | Callable[..., Any],
        priority: list[int] | None,
        add_special_tokens: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _as_params_list(sampling_params, len(prompts), (SamplingParams, PoolingParams))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts.")
        added: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                params = params.clone()
                if isinstance(params, SamplingParams):
                    params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(
                    request_id, prompt, params, priority=priority[i] if priority else 0,
                    add_special_tokens=add_special_tokens,
                )
                added.append(request_id)
            return self._run_engine(len(added), use_tqdm)
        except BaseException:
            # A failed add, a failed step or Ctrl-C: the call's requests end here, so they
            # hold no KV blocks and the next call neither waits for them nor returns their
            # outputs.
            self.llm_engine.abort_request(added)
            raise

    def _run_engine(self, num_requests: int, use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        bar = None
        if use_tqdm:
            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            bar = make_bar(total=num_requests, desc="Processed prompts", dynamic_ncols=True,
                       postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        outputs: list[RequestOutput] = []
        in_tokens = out_tokens = 0
        while self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                if not output.finished:
                    continue
                outputs.append(output)
                if bar is not None:
                    in_tokens += len(output.prompt_token_ids or [])
                    if isinstance(output, RequestOutput):
                        out_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.postfix = (f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                   f"output: {out_tokens / elapsed:.2f} toks/s")
                    bar.update(1)
        if bar is not None:
            bar.close()
        return sorted(outputs, key=lambda o: int(o.request_id))


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("LoRA adapters are not supported by pagellm (lora_request must be None).")


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one token-id prompt
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise TypeError(f"prompts must be a string, a prompt dict or a list of them, got {type(prompts).__name__}.")


def _as_params_list(params: Any, n: int, kind: type | tuple[type, ...] = SamplingParams) -> list[Any]:
    if params is None:
        return [(kind if isinstance(kind, type) else kind[0])()] * n
    if isinstance(params, kind):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"Got {len(params)} sampling params for {n} prompts; they must match.")
    return params
