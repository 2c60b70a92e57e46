"""The scheduler -> model runner contract for one step: SchedulerOutput.

The runner knows no policy: this dataclass is all that goes to it. New requests arrive
in full; running ones as diffs; structured outputs add the step's token bitmask. It lives
outside `core` and `worker` (vLLM: v1/core/sched/output.py) so that neither imports the
other; the reply, ModelRunnerOutput, is in pagellm/outputs.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no row for: first scheduling, or resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (empty on first scheduling). The runner
    # recomputes KV for prompt + these.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # The request's whole block table (prefix-cache hits included).
    block_ids: list[int]
    # Tokens whose KV is already in the cache (prefix-cache hits); this step starts here.
    num_computed_tokens: int
    # Set for a pooling request: the runner pools its prompt's hidden states, no sampling.
    pooling_params: PoolingParams | None = None


@dataclass
class CachedRequestData:
    """Requests the runner already holds a row for, as diffs (parallel lists)."""

    req_ids: list[str] = field(default_factory=list)
    # Block ids appended to each request's block table this step.
    new_block_ids: list[list[int]] = field(default_factory=list)
    # Tokens computed before this step; the runner checks it against its own count.
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens to run this step (prompt chunk, or 1 for a decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests finished (or aborted) since the last step: the runner drops their rows.
    finished_req_ids: set[str]
    # Requests preempted this step: the runner drops their rows; they come back as new.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: int32 [rows, ceil(vocab / 32)], bit t set where token t may
    # come next, for the requests that sample this step under a grammar (req_id -> row).
    grammar_bitmask: torch.Tensor | None = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: the proposed tokens scheduled after a request's last token
    # (counted in num_scheduled_tokens); the runner keeps those the model agrees with.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
