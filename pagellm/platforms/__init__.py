"""The device a model runs on, behind one interface (vLLM's `platforms/`).

A platform answers what the rest of the engine would otherwise decide with its own
device checks: what `device='auto'` resolves to, the default compute dtype, how much
memory the KV cache may take, whether that cache lives in host memory (huge pages),
the engine core's thread count, and whether pagellm's C kernels exist for tensors on
the device. Ops pick their implementation through `CustomOp`
(pagellm/model_executor/custom_op.py), which asks `platform_of`.

Which instruction set a C kernel uses on this CPU stays inside the kernel library
(`pg_isa_level`, the `simd` build): the platform knows only whether the library built.

Imports torch lazily: the frontend resolves the device without loading it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from pagellm.config import CacheConfig

CPU_KV_CAP_BYTES = 4 << 30
"""The most host memory the KV cache takes by default (an explicit
kv_cache_memory_bytes is not capped)."""


class Platform:
    """One device type. Subclasses fill in what differs; the defaults are a device
    with no pagellm kernels."""

    device_type: ClassVar[str]

    def kernels(self) -> Any | None:
        """pagellm's C kernel library for tensors on this device, or None (ops then run
        their torch implementation)."""
        return None

    def kv_cache_budget(self, device: torch.device, cache_config: CacheConfig) -> int:
        """Bytes the KV cache may take when no kv_cache_memory_bytes is given."""
        raise NotImplementedError

    @property
    def kv_in_host_memory(self) -> bool:
        """Whether the KV cache is host memory (where huge pages apply)."""
        return False

    @property
    def runs_gguf_blocks(self) -> bool:
        """Whether GGUF weights can stay in their blocks (quantized kernels exist here,
        given the kernel library builds); elsewhere they are dequantized at load."""
        return False

    def default_dtype(self, checkpoint_dtype: Any) -> str:
        """The compute dtype's name for dtype 'auto', given the checkpoint's torch dtype
        (or None)."""
        raise NotImplementedError

    def set_num_threads(self, data_parallel_size: int, requested: int) -> None:
        """Sets the engine core's intra-op threads: `requested` when > 0 (from
        PAGELLM_NUM_THREADS), else the platform's choice."""
        if requested > 0:
            import torch

            torch.set_num_threads(requested)


class CpuPlatform(Platform):
    device_type = "cpu"

    def kernels(self) -> Any | None:
        from pagellm.kernels import load_kernels

        return load_kernels()

    def kv_cache_budget(self, device: torch.device, cache_config: CacheConfig) -> int:
        import psutil

        # Half of what is free times the utilisation: the weights, activations and the
        # other processes of the machine share the same memory.
        available = psutil.virtual_memory().available
        return min(int(available * cache_config.gpu_memory_utilization * 0.5), CPU_KV_CAP_BYTES)

    @property
    def kv_in_host_memory(self) -> bool:
        return True

    @property
    def runs_gguf_blocks(self) -> bool:
        return True

    def default_dtype(self, checkpoint_dtype: Any) -> str:
        return "float32"  # the CPU kernels and torch's fast CPU paths are float32

    def set_num_threads(self, data_parallel_size: int, requested: int) -> None:
        # Data-parallel engines on one CPU share its cores instead of oversubscribing them.
        if requested <= 0 and data_parallel_size > 1:
            requested = max(1, (os.cpu_count() or 1) // data_parallel_size)
        super().set_num_threads(data_parallel_size, requested)


class CudaPlatform(Platform):
    device_type = "cuda"

    def kv_cache_budget(self, device: torch.device, cache_config: CacheConfig) -> int:
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return int(total * cache_config.gpu_memory_utilization) - (total - free)

    def default_dtype(self, checkpoint_dtype: Any) -> str:
        import torch

        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return str(checkpoint_dtype).removeprefix("torch.")
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


_PLATFORMS: dict[str, Platform] = {p.device_type: p for p in (CpuPlatform(), CudaPlatform())}


def platform_of(device: torch.device | str) -> Platform:
    """The platform of a device ('cpu', 'cuda', 'cuda:1', a torch.device); a device
    pagellm has no platform for gets a bare one (torch ops, no kernels)."""
    kind = device if isinstance(device, str) else device.type
    kind = kind.split(":", 1)[0]
    platform = _PLATFORMS.get(kind)
    if platform is None:
        platform = _PLATFORMS[kind] = type(f"{kind.title()}Platform", (Platform,), {"device_type": kind})()
    return platform


def kernels_for(t: torch.Tensor) -> Any | None:
    """pagellm's C kernels where they exist for `t`'s device, else None."""
    return platform_of(t.device).kernels()


def resolve_device(requested: str) -> str:
    """'cpu' or 'cuda' for an EngineArgs.device value ('auto', 'cpu' or 'cuda'); imports
    torch only where the installed build could have a GPU."""
    if requested == "cpu" or (requested == "auto" and not torch_build_has_gpu()):
        return "cpu"
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"device={requested!r} was requested but CUDA is not available.")
    return requested


def torch_build_has_gpu() -> bool:
    """Whether the installed torch was built with CUDA or ROCm, read from its version.py
    without importing torch (seconds): a CPU-only build answers `cuda.is_available()`
    False, so the frontend resolves device 'auto' to 'cpu' without torch. True when
    unsure (torch then answers)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.version.cuda is not None or torch.version.hip is not None
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    try:
        with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as f:
            text = f.read()
    except OSError:
        return True
    builds = dict(re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(.+?)\s*$", text, re.M))
    return builds != {"cuda": "None", "hip": "None"}


__all__ = [
    "CPU_KV_CAP_BYTES",
    "CpuPlatform",
    "CudaPlatform",
    "Platform",
    "kernels_for",
    "platform_of",
    "resolve_device",
    "torch_build_has_gpu",
]
