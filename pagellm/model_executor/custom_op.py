"""An op with one reference implementation and per-platform ones (vLLM's `CustomOp`).

`forward_native` is the op in torch's ops, which runs anywhere and is what the others
must match; `forward_cpu` and `forward_cuda` may replace it with a kernel of that
platform. `forward` picks one by the device of the first tensor argument, so model code
calls the op without checking devices. A platform version takes the inputs its kernel
fits (dtype, layout) and hands the rest to `forward_native` itself: that check belongs
to the kernel, not to the dispatch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.platforms import platform_of


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernels = platform_of("cpu").kernels() if self.has_cpu_kernel() else None
        """pagellm's C kernels for the CPU version, or None (no compiler, or this op has
        no kernel): forward_cpu then runs forward_native."""

    def has_cpu_kernel(self) -> bool:
        """Whether forward_cpu has a kernel to load (subclasses without one skip it)."""
        return True

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        kind = x.device.type
        if kind == "cpu":
            return self.forward_cpu(x, *args, **kwargs)
        if kind == "cuda":
            return self.forward_cuda(x, *args, **kwargs)
        return self.forward_native(x, *args, **kwargs)

    def forward_native(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(x, *args, **kwargs)

    def forward_cuda(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(x, *args, **kwargs)
