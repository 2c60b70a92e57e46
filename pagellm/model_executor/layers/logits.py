"""Final projection from hidden states to vocabulary logits, always returned in float32
so the sampler sees the same numbers whatever the model dtype."""

from __future__ import annotations

import torch


def compute_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """[N, hidden] x [vocab, hidden] -> [N, vocab] float32."""
    return torch.nn.functional.linear(hidden, lm_head_weight).float()
