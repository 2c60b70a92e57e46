"""The platform seam: one object per device type answers what device checks used to
answer in each op, and CustomOp picks an op's implementation by its input's device."""

from __future__ import annotations

import os

import pytest
import torch

from pagellm.config import CacheConfig
from pagellm.model_executor.custom_op import CustomOp
from pagellm.model_executor.layers.activation import SiluAndMul
from pagellm.model_executor.layers.layernorm import RMSNorm
from pagellm.platforms import (
    CPU_KV_CAP_BYTES,
    CpuPlatform,
    CudaPlatform,
    kernels_for,
    platform_of,
    resolve_device,
)


def test_platform_of_each_device_kind() -> None:
    assert type(platform_of("cpu")) is CpuPlatform
    assert type(platform_of(torch.device("cpu"))) is CpuPlatform
    assert type(platform_of("cuda:1")) is CudaPlatform
    meta = platform_of("meta")  # a device pagellm has no platform for: torch ops only
    assert meta.device_type == "meta" and meta.kernels() is None and not meta.runs_gguf_blocks
    assert platform_of("meta") is meta
    assert kernels_for(torch.empty(1, device="meta")) is None
    assert platform_of("cpu").runs_gguf_blocks and platform_of("cpu").kv_in_host_memory
    assert not platform_of("cuda").runs_gguf_blocks and not platform_of("cuda").kv_in_host_memory


def test_resolve_device() -> None:
    assert resolve_device("cpu") == "cpu"
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal below cannot happen")
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match=r"^device='cuda' was requested but CUDA is not available\.$"):
        resolve_device("cuda")


def test_cpu_defaults() -> None:
    cpu = platform_of("cpu")
    assert cpu.default_dtype(torch.bfloat16) == "float32"
    budget = cpu.kv_cache_budget(torch.device("cpu"), CacheConfig(gpu_memory_utilization=0.5))
    assert 0 < budget <= CPU_KV_CAP_BYTES


def test_cpu_threads_split_between_data_parallel_engines() -> None:
    before = torch.get_num_threads()
    try:
        platform_of("cpu").set_num_threads(data_parallel_size=2, requested=0)
        assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2)
        platform_of("cpu").set_num_threads(data_parallel_size=2, requested=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


class _Probe(CustomOp):
    def forward_native(self, x: torch.Tensor) -> str:
        return "native"

    def forward_cpu(self, x: torch.Tensor) -> str:
        return "cpu"


def test_custom_op_dispatches_on_the_input_device() -> None:
    op = _Probe()
    assert op(torch.zeros(2)) == "cpu"
    assert op(torch.zeros(2, device="meta")) == "native"


def test_ops_off_the_cpu_take_their_torch_version() -> None:
    """A device with no pagellm kernels runs forward_native (shapes on 'meta')."""
    norm = RMSNorm(8).to("meta")
    out, residual = norm(torch.empty(3, 8, device="meta"), torch.empty(3, 8, device="meta"))
    assert out.device.type == residual.device.type == "meta" and out.shape == (3, 8)
    assert SiluAndMul()(torch.empty(3, 8, device="meta")).shape == (3, 4)


def test_cpu_versions_equal_the_native_ones() -> None:
    torch.manual_seed(0)
    norm, act = RMSNorm(64), SiluAndMul()
    norm.weight.data.uniform_(0.5, 1.5)
    x, r = torch.randn(5, 64), torch.randn(5, 64)
    want, want_res = norm.forward_native(x.clone(), r.clone())
    got, got_res = norm(x.clone(), r.clone())
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    h = torch.randn(5, 128)
    torch.testing.assert_close(act(h), act.forward_native(h), rtol=4e-6, atol=2e-6)
