"""RMSNorm, optionally fused with the residual add that precedes it.

Computes in float32 and casts back, like Hugging Face, so float32 runs match it exactly
and half-precision runs do not lose the variance to rounding.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same products as below, in fewer tensors
            inv_rms = x.pow(2).mean(-1, keepdim=True).add_(self.variance_epsilon).rsqrt_()
            return (x * inv_rms).mul_(self.weight)
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new_residual); with residual given, normalises x + residual,
        which is computed in place in x (a sub-block's fresh output) and returned as the
        new residual."""
        if residual is not None:
            x = x.add_(residual)
        return self._norm(x), x

    def forward_single(self, x: torch.Tensor) -> torch.Tensor:
        """Plain norm without a residual stream (final norm, per-head q/k norm)."""
        return self._norm(x)
