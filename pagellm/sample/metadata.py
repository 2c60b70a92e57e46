"""SamplingMetadata: the batch's sampling parameters as tensors, one row per request.

Built by the model runner's persistent batch (rows follow the batch order of the logits);
consumed by the Sampler. Fields are None / empty when no request in the batch uses them,
so the common case (all greedy, no penalties) costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [B] float32; None when all rows are greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [B] float32; None when no row uses top-p
    top_k: torch.Tensor | None  # [B] int64, 0 = off; None when no row uses top-k
    min_p: torch.Tensor | None  # [B] float32; None when no row uses min-p
    # Per-row generators of seeded requests (row index -> generator).
    generators: dict[int, torch.Generator]
    # Largest number of top logprobs any row asked for; None = no row wants logprobs.
    max_num_logprobs: int | None
    # Penalties: rows are only read when no_penalties is False.
    no_penalties: bool
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] int64, padded with vocab_size
    output_token_ids: list[list[int]]  # per row, the tokens generated so far
    # row -> (min_tokens, token ids to block until then), only rows still below min_tokens.
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    # row -> {token_id: bias}
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    # [B, V] bool, True where a token is NOT allowed; None when no row restricts tokens.
    allowed_token_ids_mask: torch.Tensor | None = None
    # row -> list of banned token sequences
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    # Structured outputs: int32 [R, ceil(V / 32)] allowed-token bits, row j for logits row
    # token_bitmask_rows[j]; other rows are left alone.
    token_bitmask: torch.Tensor | None = None
    token_bitmask_rows: list[int] = field(default_factory=list)
