"""Linear layers. `Linear` is nn.Linear whose weight, once loaded, is re-laid out for
the CPU matmul kernel (`process_weights_after_loading`); `MergedLinear` fuses several
projections of the same input into one weight so a step runs one matmul (q|k|v,
gate|up). Checkpoints keep the parts separate; `load_shard` copies one part into its
row range of the fused weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 512
"""Below this many rows (tokens), CPU linears compute (W @ x.T).T instead of x @ W.T."""


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's blocked layout for its float32 CPU matmul, or None
    where that kernel does not apply (other devices and dtypes, torch without oneDNN).

    MKL's sgemm behind F.linear re-packs the weight on every call, which costs as much as
    the product itself when only a few rows go through (decode steps), and its speed
    jumps with the row count (T not a multiple of 8 or 16 ran up to 2x slower). Packed
    once at load, all linears of the default model together took, measured on 2 AVX2
    cores: 30 vs 32-40 ms at T=1, 69 vs 71-129 ms at T=31..32, 4.3 vs 5.3 s at T=2048;
    the 49152-row vocabulary head 38 vs 49 ms at T=64. Results equal F.linear's to
    ~1e-6 relative.
    """
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ W.T + bias with W from `pack_weight`; x [T, in] -> y [T, out] contiguous."""
    if torch.compiler.is_compiling():
        return _packed_linear_op(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@torch.library.custom_op("pagellm::packed_linear", mutates_args=())
def _packed_linear_op(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`packed_linear` as an opaque op for torch.compile: inductor lowers the mkldnn op
    only for weights its own freezing pass packed, and fails on ours."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias for x [T, in] and weight [out, in].

    On CPU with few rows (decode steps), MKL runs the same product 1.3-1.6x faster with
    the weight as the left operand (measured on AVX2 for T = 16..256 and the shapes of
    small Llama models). The result is then a transposed view ([T, out] with strides
    (1, T)); element-wise ops keep that layout and the next linear takes it as a
    contiguous right operand, so nothing is copied.
    """
    if x.dim() == 2 and x.shape[0] < SMALL_BATCH_ROWS and x.device.type == "cpu":
        y = torch.mm(weight, x.t()).t()
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed_weight: torch.Tensor | None
        self.register_buffer("packed_weight", None, persistent=False)

    def reset_parameters(self) -> None:
        """No random init: every weight comes from a checkpoint (the loader refuses a
        model with parameters left unfilled)."""

    def process_weights_after_loading(self) -> None:
        """Swap the loaded weight for its packed form where the CPU kernel applies; the
        plain weight is then dropped (`weight` becomes None), not kept twice."""
        packed = None if self.weight is None else pack_weight(self.weight)
        if packed is None:
            return
        self.packed_weight = packed
        self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """No random init (seconds for a vocabulary-sized table); filled by the loader."""


class MergedLinear(Linear):
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
