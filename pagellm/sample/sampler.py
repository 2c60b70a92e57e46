"""Sampler: turns a batch of next-token logits into sampled token ids (and logprobs).

In: float32 logits [B, V] and the batch's SamplingMetadata. Out: SamplerOutput. It knows
nothing of requests, the scheduler or text; rows are whatever order the runner chose.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.outputs import LogprobsLists
from pagellm.sample import ops
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sampling_params import SAMPLING_EPS
from pagellm.structured_output.backend_types import apply_token_bitmask


@dataclass
class LogprobsTensors:
    """Logprobs of one token per row (sampled or prompt token) followed by the top-k."""

    token_ids: torch.Tensor  # [B, 1 + k] int64: the chosen token, then the top-k
    logprobs: torch.Tensor  # [B, 1 + k] float32, same layout
    ranks: torch.Tensor  # [B] int64: rank of the chosen token (1 = most likely)

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs
    # [B] bool, or None when no row could be left without a token: rows whose hard
    # constraints (grammar, allowed_token_ids, bad_words, min_tokens) together forbid
    # every token. Their sampled id is arbitrary and must not be used.
    no_token: torch.Tensor | None = None


def gather_logprobs(logprobs: torch.Tensor, num_top: int, chosen: torch.Tensor) -> LogprobsTensors:
    """Picks the chosen token's logprob and rank plus the top `num_top` (-1 = all) per row."""
    vocab_size = logprobs.shape[1]
    num_top = vocab_size if num_top < 0 else min(num_top, vocab_size)
    chosen = chosen.to(torch.int64).unsqueeze(1)
    chosen_logprob = logprobs.gather(1, chosen)
    # Rank = 1 + number of tokens strictly more likely than the chosen one.
    ranks = (logprobs > chosen_logprob).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([chosen, top_ids], dim=1),
        logprobs=torch.cat([chosen_logprob, top_logprobs], dim=1),
        ranks=ranks,
    )


def compute_logprobs(logits: torch.Tensor, num_top: int, chosen: torch.Tensor) -> LogprobsTensors:
    """`gather_logprobs` of log_softmax(logits): through the C kernel where it applies
    (float32 CPU rows, up to 64 top logprobs), else torch's ops."""
    vocab_size = logits.shape[1]
    logits = logits.to(torch.float32)
    got = ops.logprobs_rows(logits, vocab_size if num_top < 0 else min(num_top, vocab_size), chosen)
    if got is not None:
        return LogprobsTensors(*got)
    return gather_logprobs(torch.log_softmax(logits, dim=-1), num_top, chosen)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> LogprobsTensors:
    """Logprobs of prompt tokens: row i of `logits` predicts `target_ids[i]`."""
    return compute_logprobs(logits, num_top, target_ids)


class Sampler:
    """Fixed pipeline: masks and biases, penalties, then greedy or temperature/min-p/
    top-k/top-p sampling. Logprobs come from the raw (unprocessed) model distribution."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # 1. Raw logprobs come from the logits before any processing (vLLM's
        #    "raw_logprobs"): the caller's, which step 2 leaves untouched.
        raw = logits
        # 2. Work on a private float32 copy; the caller's logits stay untouched. Plain
        #    greedy rows only read them (a 51 x 49152 copy is ~10 MB of fresh pages).
        logits = logits.to(torch.float32, copy=self.changes_logits(metadata))
        self.apply_constraints(logits, metadata)
        no_token = None
        if self.masks_tokens(metadata):
            # Penalties, temperature and top-k/top-p never take a row's last token away.
            no_token = logits.amax(dim=-1) == float("-inf")
            if not bool(no_token.any()):
                no_token = None
        if not metadata.no_penalties:
            self.apply_penalties(logits, metadata)
        # 3. Pick tokens.
        sampled = self.sample(logits, metadata)
        # 4. Logprobs of the sampled token and the batch's top-k.
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw, metadata.max_num_logprobs or 0, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, no_token=no_token)

    __call__ = forward

    @staticmethod
    def changes_logits(metadata: SamplingMetadata) -> bool:
        """Whether picking tokens writes to the logits (masks, biases, penalties,
        temperature): the steps below that run in place."""
        return not (metadata.all_greedy and metadata.no_penalties
                    and metadata.token_bitmask is None
                    and metadata.allowed_token_ids_mask is None
                    and not metadata.bad_words_token_ids and not metadata.logit_bias
                    and not metadata.min_tokens)

    @staticmethod
    def masks_tokens(metadata: SamplingMetadata) -> bool:
        """Whether a hard constraint may forbid tokens outright (set them to -inf)."""
        return (metadata.token_bitmask is not None or metadata.allowed_token_ids_mask is not None
                or bool(metadata.bad_words_token_ids) or bool(metadata.min_tokens)
                or bool(metadata.logit_bias))  # a bias past float32's range is -inf

    @staticmethod
    def apply_constraints(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        """Hard constraints and biases that change which token is the argmax."""
        if metadata.token_bitmask is not None:
            apply_token_bitmask(logits, metadata.token_bitmask, metadata.token_bitmask_rows)
        if metadata.allowed_token_ids_mask is not None:
            ops.apply_allowed_token_ids(logits, metadata.allowed_token_ids_mask)
        if metadata.bad_words_token_ids:
            ops.apply_bad_words(logits, metadata.bad_words_token_ids, metadata.output_token_ids)
        if metadata.logit_bias:
            ops.apply_logit_bias(logits, metadata.logit_bias)
        if metadata.min_tokens:
            ops.apply_min_tokens(logits, metadata.min_tokens, metadata.output_token_ids)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        batch_size = logits.shape[0]

        def or_default(t: torch.Tensor | None, value: float) -> torch.Tensor:
            return t if t is not None else torch.full((batch_size,), value, device=logits.device)

        ops.apply_penalties(
            logits,
            metadata.prompt_token_ids,
            metadata.output_token_ids,
            presence_penalties=or_default(metadata.presence_penalties, 0.0),
            frequency_penalties=or_default(metadata.frequency_penalties, 0.0),
            repetition_penalties=or_default(metadata.repetition_penalties, 1.0),
        )

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = ops.argmax(logits) if not metadata.all_random else None
        if metadata.all_greedy or metadata.temperature is None:
            assert greedy is not None
            return greedy
        temperature = metadata.temperature.to(logits.device)
        is_greedy_row = temperature < SAMPLING_EPS
        # Greedy rows take the argmax below; give them a harmless divisor meanwhile.
        logits.div_(torch.where(is_greedy_row, 1.0, temperature).unsqueeze(1))
        if metadata.min_p is not None:
            ops.apply_min_p(logits, metadata.min_p.to(logits.device))
        sampled = ops.sample_rows(logits, metadata.top_k, metadata.top_p, metadata.generators,
                                  skip=is_greedy_row if greedy is not None else None)
        if sampled is None:  # no C kernel for these logits: the same choice in torch ops
            logits = ops.apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
            probs = torch.softmax(logits, dim=-1)
            sampled = ops.random_sample(probs, metadata.generators)
        if greedy is None:
            return sampled
        return torch.where(is_greedy_row, greedy, sampled)
