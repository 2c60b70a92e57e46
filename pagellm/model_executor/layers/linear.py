"""Fused linear layers: several projections of the same input stored as one weight so a
step runs one matmul (q|k|v, gate|up). Checkpoints keep the parts separate; `load_shard`
copies one part into its row range of the fused weight.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """y = x @ W.T (+ b) where W stacks the shards' weights along the output rows:

    rows [0, s0)            shard 0 (e.g. q_proj)
    rows [s0, s0 + s1)      shard 1 (e.g. k_proj)
    ...
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, param_name: str, shard: int, loaded: torch.Tensor) -> None:
        param: torch.Tensor = getattr(self, param_name)
        start, size = self.offsets[shard], self.output_sizes[shard]
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shard {shard} of {param_name}: expected rows {size} x {tuple(param.shape[1:])}, "
                f"got {tuple(loaded.shape)}"
            )
        with torch.no_grad():
            param[start : start + size].copy_(loaded)
