"""Gated activation: the fused gate_up projection output [T, 2*I] becomes act(gate) * up
[T, I]. Only SiLU is used by the supported families."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])


def get_act_and_mul(hidden_act: str) -> nn.Module:
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: 'silu'")
    return SiluAndMul()
