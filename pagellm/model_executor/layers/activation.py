"""Gated activation: the fused gate_up projection output [T, 2*I] becomes act(gate) * up
[T, I]. SiLU (Llama, Qwen, Mistral) or GELU (Gemma: tanh-approximated). float32 rows on
the CPU take one C pass (`pg_silu_and_mul`, `pg_gelu_tanh_and_mul`,
pagellm/kernels/layer_ops.c: `forward_cpu`); `forward_native` is the reference (torch's
ops, which Hugging Face's activations call). The erf GELU always runs torch's op."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.model_executor.custom_op import CustomOp


class _GatedActivation(CustomOp):
    """act(gate) * up; float32 CPU rows through the C pass named `c_kernel` (where the
    kernels built and the subclass has one), else the subclass's `forward_native`."""

    c_kernel = ""
    c_act: int | None = None
    """The C kernels' code for this activation (0 SiLU, 1 GELU's tanh form; None: none),
    for products that apply it themselves (GGUFLinearMethod.apply_gated)."""

    def has_cpu_kernel(self) -> bool:
        return bool(self.c_kernel)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        lib = self.kernels
        if lib is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
            return self.forward_native(x)
        t, d = x.shape[0], x.shape[1] // 2
        out = torch.empty(t, d, dtype=torch.float32)
        getattr(lib, self.c_kernel)(x.data_ptr(), x.stride(0), t, d, out.data_ptr(), d)
        return out


class SiluAndMul(_GatedActivation):
    c_kernel = "pg_silu_and_mul"
    c_act = 0

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])


class GeluAndMul(_GatedActivation):
    def __init__(self, approximate: str = "none") -> None:
        self.approximate = approximate
        """torch's `approximate`: "tanh" (gelu_pytorch_tanh, with a C pass) or "none" (erf)."""
        self.c_kernel = "pg_gelu_tanh_and_mul" if approximate == "tanh" else ""
        self.c_act = 1 if approximate == "tanh" else None
        super().__init__()

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate).mul_(x[..., d:])


# transformers' activation names -> the gated module (ACT2FN's functions)
_ACTIVATIONS = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_tanh": lambda: GeluAndMul("tanh"),
    "gelu": lambda: GeluAndMul("none"),
}


def get_act_and_mul(hidden_act: str) -> nn.Module:
    if hidden_act not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: "
                         f"{', '.join(repr(a) for a in _ACTIVATIONS)}")
    return _ACTIVATIONS[hidden_act]()
