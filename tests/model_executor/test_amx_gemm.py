"""The AMX products in bfloat16 (pagellm/kernels/amx_gemm.c), on CPUs with AMX-BF16 (skipped
elsewhere, with the reason): the weights it multiplies are gguf's dequantized weights rounded
to bfloat16, its products equal float64 products of the bfloat16-rounded inputs and weights,
a row's result does not depend on the other rows, and `pg_amx_on` = 0 turns it off. Which
path runs in an engine step is tested in test_fused_ops.py and test_q8_quality.py (the
int8 GEMM's callers, which take it from AMX_MIN_ROWS rows)."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from pagellm import kernels
from pagellm.benchmarks.synthetic_gguf import random_blocks
from pagellm.model_executor.layers.quantization import gguf as gguf_method
from tests.model_executor.test_gguf_quantized import K_R16, _reference, _repack_k

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_R16", "Q5_K_R16", "Q6_K_R16",
         "Q4_0_R16", "Q4_1_R16", "Q8_0_R16"]


@pytest.fixture(scope="module")
def lib():
    lib = kernels.load_kernels()
    if lib is None:
        pytest.skip("no C compiler: the kernels are not built")
    if not lib.pg_amx_ready():
        pytest.skip("this CPU has no AMX-BF16 (or Linux refused its tile state): the AMX kernels do not run here")
    return lib


def _weights(lib, qtype: str, n: int, k: int, rng: np.random.Generator) -> tuple[int, np.ndarray, np.ndarray]:
    """(pagellm type id, the blocks in that layout, gguf's float64 weights)."""
    base = qtype.split("_R")[0]
    data = np.ascontiguousarray(random_blocks(base, n, k, rng))
    ref = _reference(data, base, n, k)
    file_t = int(gguf.GGMLQuantizationType[base])
    if qtype in ("Q4_K_R16", "Q5_K_R16", "Q6_K_R16"):
        return K_R16[base][1], _repack_k(lib, base, data, n, k), ref
    if qtype.endswith("_R16"):
        t = gguf_method.R16_TYPES[file_t]
        out = np.empty_like(data)
        assert lib.pg_repack_r16(t, data.ctypes.data, data.shape[1], n, k, out.ctypes.data) == 0
        return t, out, ref
    return file_t, data, ref


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), as float64."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16).double().numpy()


def _gemm_amx(lib, t: int, w: np.ndarray, n: int, x: np.ndarray) -> np.ndarray:
    m, k = x.shape
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    y = torch.full((m, n + 3), float("nan"))  # ldy > n
    assert lib.pg_gemm_amx(t, w.ctypes.data, w.shape[1], n, k, xt.data_ptr(), k, m, y.data_ptr(), n + 3) == 0
    assert torch.isnan(y[:, n:]).all()  # nothing written past the n columns
    return y[:, :n].double().numpy()


@pytest.mark.parametrize("qtype", TYPES)
def test_amx_multiplies_the_bfloat16_weights_and_inputs(lib, qtype: str) -> None:
    """The weights the kernel multiplies are gguf's rounded to bfloat16 (within one bfloat16
    step of the float32 value, equal in >= 99% of places); its products for row counts
    around its 32-row blocks, with weight rows around its 32-row panels (16-row layouts:
    multiples of 16), equal the float64 product of the bfloat16 inputs and weights within
    float32 summation (1e-5 of the row's scale)."""
    rng = np.random.default_rng(5)
    k = 512 if "_K" in qtype else 576
    n = 48 if "_R" in qtype else 37
    t, w, ref = _weights(lib, qtype, n, k, rng)
    got = np.zeros((n, k), dtype=np.uint16)
    assert lib.pg_amx_weights_bf16(t, w.ctypes.data, w.shape[1], n, k, got.ctypes.data) == 0
    w_bf16 = (got.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    expected = _bf16(ref)
    assert np.all(np.abs(w_bf16 - ref) <= np.abs(ref) * 2.0**-8)
    assert (w_bf16 == expected).mean() >= 0.99
    for m in (1, 31, 32, 33, 70):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = _gemm_amx(lib, t, w, n, x)
        y_ref = _bf16(x) @ w_bf16.T
        scale = np.abs(_bf16(x)) @ np.abs(w_bf16).T
        assert np.all(np.abs(y - y_ref) <= 1e-5 * scale + 1e-30), (qtype, m)
        # and the bfloat16 rounding keeps it near the exact product (relative error ~2^-9)
        exact = x.astype(np.float64) @ ref.T
        assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 4e-3


def test_a_rows_result_does_not_depend_on_the_other_rows(lib) -> None:
    """Rows computed among 100 or among 40 others, in another position: the same bits."""
    rng = np.random.default_rng(9)
    n, k = 96, 512
    t, w, _ = _weights(lib, "Q4_K_R16", n, k, rng)
    x = rng.standard_normal((100, k)).astype(np.float32)
    full = _gemm_amx(lib, t, w, n, x)
    part = _gemm_amx(lib, t, w, n, x[60:])
    assert np.array_equal(full[60:], part)


def test_amx_switch_and_refusals(lib) -> None:
    """pg_amx_on = 0 (PAGELLM_AMX=0) turns the kernels off; a K that is not a multiple of 32,
    a type with no unpacker and a 16-row layout with a partial tile are refused (-1)."""
    rng = np.random.default_rng(1)
    t, w, _ = _weights(lib, "Q8_0", 32, 64, rng)
    x = torch.randn(40, 64)
    y = torch.empty(40, 32)
    args = (w.ctypes.data, w.shape[1], 32, 64, x.data_ptr(), 64, 40, y.data_ptr(), 32)
    assert lib.pg_amx_supported(t, 64) == 1
    flag = ctypes.c_int.in_dll(lib, "pg_amx_on")
    flag.value = 0
    try:
        assert lib.pg_amx_ready() == 0 and lib.pg_amx_supported(t, 64) == 0
        assert lib.pg_gemm_amx(t, *args) == -1
    finally:
        flag.value = 1
    assert lib.pg_gemm_amx(t, *args) == 0
    assert lib.pg_amx_supported(t, 48) == 0
    assert lib.pg_amx_supported(int(gguf.GGMLQuantizationType.Q2_K), 256) == 0
    r16, w16, _ = _weights(lib, "Q8_0_R16", 32, 64, rng)
    assert lib.pg_gemm_amx(r16, w16.ctypes.data, w16.shape[1], 24, 64, x.data_ptr(), 64, 40, y.data_ptr(), 32) == -1


@pytest.mark.parametrize("qtype,act", [("Q4_1_R16", 0), ("Q4_K_R16", 0), ("Q6_K", 1), ("Q8_0", 0)])
def test_gated_product_is_the_products_then_the_activation(lib, qtype: str, act: int) -> None:
    """pg_gemm_amx_gated (a gated MLP's gate and up products and act(gate) * up in one
    pass) gives the bits of pg_gemm_amx on the gate|up rows followed by the C activation
    pass (pg_silu_and_mul / pg_gelu_tanh_and_mul), for row counts around its 32-row blocks
    and an intermediate size that is not a whole number of 32-column panels."""
    rng = np.random.default_rng(11)
    k, half = (512 if "_K" in qtype else 576), 80
    t, w, _ = _weights(lib, qtype, 2 * half, k, rng)
    gate_ptr, up_ptr = w.ctypes.data, w.ctypes.data + half * w.shape[1]
    pass_fn = lib.pg_silu_and_mul if act == 0 else lib.pg_gelu_tanh_and_mul
    for m in (32, 45, 64, 97):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        both = torch.empty(m, 2 * half)
        assert lib.pg_gemm_amx(t, w.ctypes.data, w.shape[1], 2 * half, k, x.data_ptr(), k, m,
                               both.data_ptr(), 2 * half) == 0
        want = torch.empty(m, half)
        pass_fn(both.data_ptr(), 2 * half, m, half, want.data_ptr(), half)
        got = torch.full((m, half + 5), float("nan"))
        assert lib.pg_gemm_amx_gated(t, gate_ptr, w.shape[1], t, up_ptr, w.shape[1], half, k,
                                     x.data_ptr(), k, m, act, got.data_ptr(), half + 5) == 0
        assert torch.equal(got[:, :half], want), m
        assert torch.isnan(got[:, half:]).all()


def test_gated_layer_matches_the_unfused_layer(lib) -> None:
    """GGUFLinearMethod.apply_gated on a prompt chunk past BATCHED_MAX_ROWS: the bits of the
    layer's product followed by SiluAndMul; a chunk too short for the int8 GEMM's rows
    (float32 products) gets None, and forward_gated falls back to the unfused pair."""
    from pagellm.model_executor.layers.activation import SiluAndMul

    rng = np.random.default_rng(12)
    k, half = 576, 96
    t, w, _ = _weights(lib, "Q4_1_R16", 2 * half, k, rng)
    method = gguf_method.GGUFLinearMethod(q8_activations=True)
    layer = torch.nn.Module()
    layer.weight_groups = [gguf_method.WeightGroup(t, w, 0, 2 * half)]
    layer.out_features = 2 * half
    act = SiluAndMul()
    long_x = torch.from_numpy(rng.standard_normal((gguf_method.BATCHED_MAX_ROWS + 7, k)).astype(np.float32))
    got = method.apply_gated(layer, long_x, act)
    assert got is not None
    assert torch.equal(got, act.forward(method.apply(layer, long_x)))
    assert method.apply_gated(layer, long_x[:40], act) is None
