"""The int8 GEMM for many input rows (pagellm/kernels/ggml_i8gemm.c): against float64
products of gguf's dequantized weights and the numpy model of llama.cpp's activation
rounding, the AVX-512 VNNI kernel bit for bit equal to the portable loops, and a row's
result independent of the other rows."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from pagellm import kernels
from pagellm.benchmarks.synthetic_gguf import random_blocks
from pagellm.model_executor.layers.quantization import gguf as gguf_method
from tests.model_executor.test_gguf_quantized import (
    K_R16,
    _reference,
    _repack_k,
    _round_activations,
)

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _gemm_i8(lib, qtype: str, data: np.ndarray, n: int, x: np.ndarray, wide: bool) -> np.ndarray:
    m, k = x.shape
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    qx = torch.empty(m, k, dtype=torch.int8)
    dx = torch.empty(m, k // 32, dtype=torch.float32)
    sx = torch.empty(m, k // 16, dtype=torch.int32)
    lib.pg_quantize_q8(xt.data_ptr(), k, m, k, 1, qx.data_ptr(), dx.data_ptr(), sx.data_ptr())
    y = torch.full((m, n + 3), float("nan"))  # a wider output: ldy > n
    flag = ctypes.c_int.in_dll(lib, "pg_i8_wide")
    flag.value = int(wide)
    try:
        w = np.ascontiguousarray(data)
        t = K_R16[qtype[:4]][1] if qtype.endswith("K_R16") else int(gguf.GGMLQuantizationType[qtype])
        rc = lib.pg_gemm_i8(t, w.ctypes.data, w.shape[1], n, k,
                            qx.data_ptr(), dx.data_ptr(), sx.data_ptr(), m, y.data_ptr(), n + 3)
    finally:
        flag.value = 1
    assert rc == 0
    assert torch.isnan(y[:, n:]).all()  # nothing written past the n columns
    return y[:, :n].double().numpy()


@pytest.fixture(scope="module")
def lib():
    lib = kernels.load_kernels()
    if lib is None:
        pytest.skip("no C compiler: the kernels are not built")
    return lib


@pytest.mark.parametrize("qtype", TYPES)
def test_int8_gemm_computes_the_int8_scheme(lib, qtype: str) -> None:
    """Rows counts around the kernel's 4-row passes and weight row counts around its
    16-row tiles: equal (1e-5) to the float64 product with the rounded activations; the
    error against the exact product no larger than llama.cpp's scheme gives (Q8_0-style
    32-value groups; Q8_K's 256 for K-quants)."""
    rng = np.random.default_rng(3)
    k = 512 if qtype.endswith("_K") else 576
    llama_group = 256 if qtype.endswith("_K") else 32
    assert lib.pg_i8gemm_supported(int(gguf.GGMLQuantizationType[qtype]))
    ours, exact, llama = [], [], []
    for n in (16, 37):
        data = random_blocks(qtype, n, k, rng)
        ref = _reference(data, qtype, n, k)
        for m in (1, 3, 4, 9, 33):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + n)).numpy()
            y = _gemm_i8(lib, qtype, data, n, x, wide=True)
            want = _round_activations(x, 32) @ ref.T
            assert np.linalg.norm(y - want) <= 1e-5 * np.linalg.norm(want), (n, m)
            ours.append(y)
            exact.append(x.astype(np.float64) @ ref.T)
            llama.append(_round_activations(x, llama_group) @ ref.T)
    ours, exact, llama = (np.concatenate([a.ravel() for a in v]) for v in (ours, exact, llama))
    err = lambda a: np.linalg.norm(a - exact) / np.linalg.norm(exact)  # noqa: E731
    assert 1e-5 < err(ours) <= err(llama) * 1.001


@pytest.mark.parametrize("qtype", TYPES)
def test_vnni_kernel_equals_the_portable_loops_and_rows_are_independent(lib, qtype: str) -> None:
    if not lib.pg_i8gemm_fast():
        pytest.skip("this CPU has no AVX-512 VNNI (avx512vnni, avx512bw, avx512vl, avx512dq): "
                    "only the portable loops run")
    rng = np.random.default_rng(4)
    k, n = 256 * 3, 21
    data = random_blocks(qtype, n, k, rng)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(8)).numpy()
    fast = _gemm_i8(lib, qtype, data, n, x, wide=True)
    assert np.array_equal(fast, _gemm_i8(lib, qtype, data, n, x, wide=False))
    for i in range(7):  # each row alone, and in a pass of fewer rows, gives the same bits
        assert np.array_equal(_gemm_i8(lib, qtype, data, n, x[i : i + 1], wide=True)[0], fast[i])
    assert np.array_equal(_gemm_i8(lib, qtype, data, n, x[2:5], wide=True), fast[2:5])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_r16_tiles_equal_the_files(lib, qtype: str) -> None:
    """Q4_K / Q5_K / Q6_K repacked sixteen rows at a time (Q4_K_R16 ...) unpack into the same
    tiles as the file's blocks: the int8 GEMM's products are the file type's bit for bit, on
    the path this CPU runs; and the int8 decode kernel (pg_gemm_q8, one level) gives a row
    the GEMM's bits, alone or among up to 16."""
    rng = np.random.default_rng(6)
    k, n = 512, 48
    t = K_R16[qtype][1]
    data = np.ascontiguousarray(random_blocks(qtype, n, k, rng))
    packed = _repack_k(lib, qtype, data, n, k)
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(10)).numpy()
    want = _gemm_i8(lib, qtype, data, n, x, wide=True)
    assert np.array_equal(_gemm_i8(lib, qtype + "_R16", packed, n, x, wide=True), want)
    assert np.array_equal(_gemm_i8(lib, qtype + "_R16", packed, n, x, wide=False),
                          _gemm_i8(lib, qtype, data, n, x, wide=False))
    if lib.pg_q8_isa() != 2:
        return  # the decode kernel's AVX2 path sums in another order
    group = [gguf_method.WeightGroup(t, packed, 0, n)]
    for rows in (x[:1], x[3:12], x[:16]):
        y = gguf_method.gguf_matmul(group, torch.from_numpy(rows), n, slice(0, len(rows)))
        assert np.array_equal(y.double().numpy(), _gemm_i8(lib, qtype + "_R16", packed, n, rows, wide=True))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_claimed_tiles_equal_a_static_split(lib, qtype: str) -> None:
    """The int8 GEMM's threads claim its 16-row tiles as they go (pg_q8_claim = 1, the
    default; two threads from the two ends): every tile computed once, the products bit for
    bit a static split's, with a short last tile (a row count not a multiple of 16)."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing is split")
    rng = np.random.default_rng(11)
    k = 512 if qtype.endswith("_K") else 576
    n = 16 * 45 + 7  # 46 tiles, the last of 7 rows
    data = random_blocks(qtype, n, k, rng)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(12)).numpy()  # large enough to split
    claim = ctypes.c_int.in_dll(lib, "pg_q8_claim")
    assert claim.value == 1
    claimed = _gemm_i8(lib, qtype, data, n, x, wide=True)
    try:
        claim.value = 0
        static = _gemm_i8(lib, qtype, data, n, x, wide=True)
    finally:
        claim.value = 1
    assert not np.isnan(claimed).any()
    assert np.array_equal(claimed, static)


def test_types_without_an_unpacker_are_refused(lib) -> None:
    for qtype in ("Q2_K", "Q3_K", "IQ4_XS", "F32", "F16"):
        assert not lib.pg_i8gemm_supported(int(gguf.GGMLQuantizationType[qtype]))
    dummy = torch.zeros(64, dtype=torch.int8)
    assert lib.pg_gemm_i8(int(gguf.GGMLQuantizationType.Q3_K), dummy.data_ptr(), 110, 1, 256,
                          dummy.data_ptr(), dummy.data_ptr(), dummy.data_ptr(), 1, dummy.data_ptr(), 1) == -1
