"""Outputs: what the model runner hands the scheduler each step (ModelRunnerOutput,
LogprobsLists) and what the user gets (RequestOutput, one CompletionOutput per sample;
the pooling, embedding and scoring outputs).

The runner's outputs live here, in no package that `core` or `worker` owns, so neither
imports the other. vLLM splits them into vllm/v1/outputs.py (runner) and vllm/outputs.py
(user); pagellm has no v1 layer, so one `outputs` module holds both. LogprobsLists also
rides to the frontend inside EngineCoreOutput (core/protocol.py) and becomes Logprob
dicts there. Plain data: imports msgspec, never torch or another pagellm module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

# -- model runner -> scheduler ---------------------------------------------------------


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of some positions: for each position, the token ids and logprobs of the
    sampled (or prompt) token first, then the top-k, and the rank of the first one."""

    logprob_token_ids: list[list[int]]  # [num_positions][1 + k]
    logprobs: list[list[float]]  # [num_positions][1 + k]
    ranks: list[int]  # [num_positions] rank of the sampled/prompt token (1 = best)

    def first(self, n: int) -> LogprobsLists:
        """The first n positions (tokens after a stop were sampled but are not kept)."""
        return LogprobsLists(self.logprob_token_ids[:n], self.logprobs[:n], self.ranks[:n])


@dataclass
class ModelRunnerOutput:
    """What the runner hands back after a step, keyed by request id."""

    req_ids: list[str]
    # One list per request in req_ids: the sampled token (empty while a prompt is
    # still being prefilled in chunks and no token is due).
    sampled_token_ids: list[list[int]]
    # Logprobs of the sampled tokens for requests that asked for them.
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Prompt logprobs computed this step (for the chunk just run), by request.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Pooling requests whose prompt finished this step: the pooled hidden state as
    # float32 bytes (not yet normalised; the frontend applies PoolingParams).
    pooler_output: dict[str, bytes] = field(default_factory=dict)
    # Requests whose constraints left no token to sample (grammar, allowed_token_ids,
    # bad_words and min_tokens that exclude each other): their list in
    # sampled_token_ids holds only the tokens before that point, and they cannot go on.
    no_token_req_ids: set[str] = field(default_factory=set)


# -- user-facing -----------------------------------------------------------------------


@dataclass
class Logprob:
    """The log probability of one token, its rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sampled sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestMetrics:
    """Timestamps of a request's life, in seconds of time.time()."""

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None  # engine-core clock: scheduled - queued
    finished_time: float | None = None
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    """The output of one request: its prompt and its n completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Folds a newer output of the same request into this one.

        aggregate=True (DELTA outputs): text, token ids and logprobs are appended.
        aggregate=False: a completion with the same index is replaced by the newer one.
        Completions with an index not seen yet are appended either way.
        """
        self.finished |= next_output.finished
        if next_output.prompt_logprobs is not None:
            # DELTA outputs carry the positions scored since the last one; the others
            # carry every position so far
            if aggregate and self.prompt_logprobs is not None:
                self.prompt_logprobs = self.prompt_logprobs + next_output.prompt_logprobs
            else:
                self.prompt_logprobs = next_output.prompt_logprobs
        self.metrics = next_output.metrics or self.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for completion in next_output.outputs:
            i = by_index.get(completion.index)
            if i is None:
                by_index[completion.index] = len(self.outputs)
                self.outputs.append(completion)
            elif aggregate:
                _append_completion(self.outputs[i], completion)
            else:
                self.outputs[i] = completion

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


def _append_completion(into: CompletionOutput, delta: CompletionOutput) -> None:
    into.text += delta.text
    into.token_ids = [*into.token_ids, *delta.token_ids]
    if delta.logprobs is not None:
        into.logprobs = [*(into.logprobs or []), *delta.logprobs]
    into.cumulative_logprob = delta.cumulative_logprob
    into.finish_reason = delta.finish_reason
    into.stop_reason = delta.stop_reason


# -- pooling (embeddings) --------------------------------------------------------------


@dataclass
class PoolingOutput:
    """A pooling request's vector. vLLM's field name; the value is a numpy float32
    array here (vLLM: a torch tensor; `torch.from_numpy(data)` makes one), so the
    frontend needs no torch."""

    data: Any

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data!r})"


@dataclass
class PoolingRequestOutput:
    """The output of one pooling request (LLM.encode)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    """One embedding as a list of floats (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The output of one embedding request (LLM.embed), vLLM's shape."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()),
                   output.prompt_token_ids, output.finished, output.prompt)


@dataclass
class ScoringOutput:
    """The score of one text pair (vLLM's ScoringOutput): on an embedding model, the
    cosine similarity of the two texts' embeddings."""

    score: float

    def __repr__(self) -> str:
        return f"ScoringOutput(score={self.score})"


@dataclass
class ScoringRequestOutput:
    """The output of one pair of LLM.score, vLLM's shape: request_id joins the two
    embedding requests' ids with '_', prompt_token_ids are the first text's then the
    second's."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool
