"""The prompt attention kernel (pg_paged_prefill, kernels/paged_attention.c): several rows
of a prompt chunk per task, sharing each K and V load; and the decode kernel's runs of such
rows in a batch (RowAttention's prompt chunks and verify runs). Every row must give the bits
the decode kernel gives it as a one-token decode of its own, for every cache type (q8_0 too), head
grouping (up to and past one task's 12 query vectors, 6 on AVX2), sliding window, score
cap, a chunk with a cached prefix and chunks side by side, on AVX-512 and on AVX2."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pagellm.attention.backend import Q8_KV_DTYPE
from pagellm.attention.torch_backend import KV_TYPE_CODES
from pagellm.kernels import load_kernels

BS = 16


@pytest.fixture(scope="module")
def kernels():
    lib = load_kernels()
    if lib is None:
        pytest.skip("no C compiler: pagellm's kernels are not built")
    if not lib.pg_paged_prefill_ready(64):
        pytest.skip("pg_paged_prefill needs the AVX2 build of the kernels, which this machine lacks")
    return lib


@pytest.fixture(params=["avx512", "avx2"])
def lib(kernels, request):
    """The kernels on each of their widths: AVX-512 where the CPU has it, and AVX2 (forced
    through pg_attn_wide = 0, as the decode kernel's tests do)."""
    wide = ctypes.c_int.in_dll(kernels, "pg_attn_wide")
    if request.param == "avx512" and not kernels.pg_attn_isa512():
        pytest.skip("this CPU lacks AVX-512 F/BW/VL/DQ/VNNI: the 16-lane attention does not run here")
    saved = wide.value
    wide.value = 1 if request.param == "avx512" else 0
    yield kernels
    wide.value = saved


def _case(lib, chunks: list[tuple[int, int]], h: int, kvh: int, d: int, dtype: torch.dtype,
          window: int = 0, cap: float = 0.0, seed: int = 0) -> None:
    """chunks: (cached prefix, rows) per chunk; rows of all chunks side by side, with one
    unrelated row between chunks (a decode of the same step)."""
    gen = torch.Generator().manual_seed(seed)
    nb = 64
    if dtype == Q8_KV_DTYPE:  # q8_0 blocks: int8 values, then float16 scales in the same rows
        k_store = torch.randint(-127, 128, (kvh, nb, d + d // 16, BS), generator=gen, dtype=torch.int8)
        v_store = torch.randint(-127, 128, (kvh, nb, BS, d + d // 16), generator=gen, dtype=torch.int8)
        scales = lambda *shape: (torch.rand(*shape, generator=gen) / 64).half().view(torch.int8)  # noqa: E731
        k_store[:, :, d:] = scales(kvh, nb, d // 32, BS).reshape(kvh, nb, d // 16, BS)
        v_store[..., d:] = scales(kvh, nb, BS, d // 32)
    else:
        k_store = torch.randn(kvh, nb, d, BS, generator=gen).to(dtype)
        v_store = torch.randn(kvh, nb, BS, d, generator=gen).to(dtype)
    ncols = max((p + r + BS - 1) // BS for p, r in chunks)
    tables = torch.stack([torch.randperm(nb, generator=gen)[:ncols] for _ in chunks]).contiguous()
    row0, row1, first_hi, t = [], [], [], 0
    for prefix, rows in chunks:
        t += 1  # a row of something else between chunks
        row0.append(t)
        row1.append(t + rows)
        first_hi.append(prefix + 1)
        t += rows
    T = t + 1  # noqa: N806
    q = torch.randn(T, h + 2 * kvh, d, generator=gen)[:, :h]  # strided, as split from qkv
    out = torch.full((T, h, d), 7.0)
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    r0, r1, fh = i64(row0), i64(row1), i64(first_hi)
    rc = lib.pg_paged_prefill(q.data_ptr(), q.stride(0), len(chunks), r0.data_ptr(), r1.data_ptr(),
                              fh.data_ptr(), h, kvh, d, KV_TYPE_CODES[dtype], k_store.data_ptr(),
                              v_store.data_ptr(), nb, tables.data_ptr(), tables.stride(0), window,
                              d**-0.5, cap, out.data_ptr())
    assert rc == 0
    # each row alone through the decode kernel (a batch of one: no run of rows to share)
    rows = [(c, t) for c in range(len(chunks)) for t in range(row0[c], row1[c])]
    table = torch.stack([tables[c] for c, _ in rows]).contiguous()
    hi = i64([first_hi[c] + t - row0[c] for c, t in rows])
    lo = (hi - window).clamp_(min=0) if window else torch.zeros_like(hi)
    qr = torch.stack([q[t] for _, t in rows]).contiguous()
    ref = torch.empty(len(rows), h, d)
    for r in range(len(rows)):
        assert lib.pg_paged_decode(qr[r].data_ptr(), qr.stride(0), 1, h, kvh, d, KV_TYPE_CODES[dtype],
                                   k_store.data_ptr(), v_store.data_ptr(), nb, BS, table[r].data_ptr(),
                                   table.stride(0), lo[r:].data_ptr(), hi[r:].data_ptr(),
                                   int(hi[r] - lo[r]), d**-0.5, cap, ref[r].data_ptr()) == 0
    got = torch.stack([out[t] for _, t in rows])
    assert torch.equal(got, ref), (got - ref).abs().max()
    # the same rows as one decode batch (RowAttention's layout, with a row of another
    # request between chunks): runs of rows share their tasks there too, with the same bits
    other = torch.randperm(nb, generator=gen)[:ncols]
    batch_rows = [None] + rows  # a decode of another request first
    table_b = torch.stack([other if x is None else tables[x[0]] for x in batch_rows]).contiguous()
    hi_b = torch.cat([i64([9]), hi])
    lo_b = torch.cat([i64([0]), lo])
    q_b = torch.cat([torch.randn(1, h, d, generator=gen), qr])
    out_b = torch.empty(len(batch_rows), h, d)
    assert lib.pg_paged_decode(q_b.data_ptr(), q_b.stride(0), len(batch_rows), h, kvh, d,
                               KV_TYPE_CODES[dtype], k_store.data_ptr(), v_store.data_ptr(), nb, BS,
                               table_b.data_ptr(), table_b.stride(0), lo_b.data_ptr(), hi_b.data_ptr(),
                               int((hi_b - lo_b).max()), d**-0.5, cap, out_b.data_ptr()) == 0
    assert torch.equal(out_b[1:], ref)
    # rows outside the chunks are left alone
    outside = [t for t in range(T) if not any(a <= t < b for a, b in zip(row0, row1))]
    assert torch.equal(out[outside], torch.full((len(outside), h, d), 7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, Q8_KV_DTYPE],
                         ids=["float32", "float16", "bfloat16", "q8_0"])
def test_rows_match_the_decode_kernel_bit_for_bit(lib, dtype):
    _case(lib, [(0, 37), (21, 50), (0, 1)], h=9, kvh=3, d=64, dtype=dtype)


@pytest.mark.parametrize("h,kvh", [(4, 4), (8, 2), (32, 8), (16, 1), (28, 2), (14, 2)])
def test_head_groupings(lib, h, kvh):
    """1, 4, 4, 16 (two runs of 8 heads, one row a task), 14 (runs of 7), 7 query heads a KV head."""
    _case(lib, [(5, 29), (0, 40)], h=h, kvh=kvh, d=32, dtype=torch.float16, seed=1)


@pytest.mark.parametrize("dtype", [torch.float16, Q8_KV_DTYPE], ids=["float16", "q8_0"])
def test_window_and_cap(lib, dtype):
    _case(lib, [(30, 45), (0, 70)], h=6, kvh=2, d=64, dtype=dtype, window=24, cap=30.0, seed=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, Q8_KV_DTYPE], ids=["bfloat16", "q8_0"])
def test_head_dim_128(lib, dtype):
    _case(lib, [(100, 33)], h=8, kvh=2, d=128, dtype=dtype, seed=3)
