"""The C decode attention and cache write (pagellm/kernels/paged_attention.c) against the
torch backend's own ops on the same cache: mixed context lengths, grouped-query heads,
sliding windows, K/V rows that are strided views (as the model hands them over)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.attention.backend import Q8_KV_DTYPE, CommonAttentionMetadata
from pagellm.attention.torch_backend import (
    KV_TYPE_CODES,
    TorchAttentionBackend,
    TorchAttentionImpl,
    TorchAttentionMetadataBuilder,
)
from pagellm.kernels import load_kernels

BS, H, KVH, D = 4, 6, 2, 8


def _decode_step(seq_lens: list[int], window: int | None, use_c: bool, seed: int = 0,
                 geometry: tuple[int, int, int, int] = (BS, H, KVH, D),
                 kv_dtype: torch.dtype = torch.float32, lib: object = None,
                 soft_cap: float | None = None, q8_values: bool = False,
                 q8_query: bool = True) -> tuple[torch.Tensor, ...]:
    """Fill a cache with random K/V for every request's context through prefill-sized
    writes, then run one decode step; returns (output, K cache, V cache). geometry:
    (block size, query heads, KV heads, head dim); kv_dtype: the cache's storage; lib:
    the kernel library to use (default: the SIMD build); q8_values: K/V rounded to q8_0
    first (`_q8_0_round`), so that a q8_0 cache holds them exactly, and the queries too with
    a softmax scale of 1/8, a power of two (the C scores over a q8_0 cache quantize the
    query times the scale as q8_0: on the grid already, it stays as it is); q8_query=False
    leaves the queries off the grid (K/V still on it)."""
    BS, H, KVH, D = geometry  # noqa: N806
    gen = torch.Generator().manual_seed(seed)
    nb = 64
    k_cache, v_cache = TorchAttentionBackend.allocate_kv_cache(nb, BS, KVH, D, kv_dtype, torch.device("cpu"))
    k_cache.zero_()
    v_cache.zero_()
    impl = TorchAttentionImpl(H, D, 0.125 if q8_values else D**-0.5, KVH, logits_soft_cap=soft_cap)
    if lib is not None:  # another build of the kernels
        impl.kernels = lib
    if not use_c:
        impl.kernels = None
    assert (impl.kernels is not None) == use_c
    # request b owns blocks [b * 16, b * 16 + 16) in a shuffled order
    perm = torch.randperm(16, generator=gen)
    tables = torch.stack([perm + 16 * b for b in range(len(seq_lens))])
    builder = TorchAttentionMetadataBuilder(BS, torch.device("cpu"), sliding_window=window)
    # the decode token of request b is its position seq_len - 1; earlier ones are context
    slots = []
    for b, n in enumerate(seq_lens):
        for p in range(n):
            slots.append(int(tables[b, p // BS]) * BS + p % BS)
    # strided K/V views, as split out of a fused qkv projection
    fused = torch.randn(len(slots), (H + 2 * KVH) * D, generator=gen)
    if q8_values:
        fused[:, H * D :] = _q8_0_round(fused[:, H * D :])
    key = fused[:, H * D : (H + KVH) * D].view(-1, KVH, D)
    value = fused[:, (H + KVH) * D :].view(-1, KVH, D)
    ctx_slots = list(slots)
    common = CommonAttentionMetadata(
        num_reqs=1, num_actual_tokens=len(ctx_slots), query_start_loc=torch.tensor([0, len(ctx_slots)]),
        seq_lens=torch.tensor([len(ctx_slots)]), block_table=torch.zeros(1, 1, dtype=torch.long),
        slot_mapping=torch.tensor(ctx_slots), query_start_loc_cpu=[0, len(ctx_slots)],
        seq_lens_cpu=[len(ctx_slots)], max_query_len=len(ctx_slots), max_seq_len=len(ctx_slots),
        block_size=BS,
    )
    meta = builder.build(common)
    meta.prefills, meta.prompt = [], None  # only the cache write of this "step" is wanted
    impl.forward(torch.zeros(len(ctx_slots), H, D), key, value, (k_cache, v_cache), meta)
    # the decode step: one query per request, its key/value already written above
    b = len(seq_lens)
    last = torch.tensor([sum(seq_lens[: i + 1]) - 1 for i in range(b)])
    q_fused = torch.randn(b, (H + KVH) * D, generator=gen)
    if q8_values and q8_query:
        q_fused[:, : H * D] = _q8_0_round(q_fused[:, : H * D] * 0.125) * 8
    query = q_fused[:, : H * D].view(b, H, D)
    dec_common = CommonAttentionMetadata(
        num_reqs=b, num_actual_tokens=b, query_start_loc=torch.arange(b + 1),
        seq_lens=torch.tensor(seq_lens), block_table=tables, slot_mapping=torch.tensor(slots)[last],
        query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=list(seq_lens), max_query_len=1,
        max_seq_len=max(seq_lens), block_size=BS,
    )
    dec_meta = builder.build(dec_common)
    out = impl.forward(query, key[last], value[last], (k_cache, v_cache), dec_meta)
    return out, k_cache, v_cache


def _q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's q8_0 of x's last axis (a model for the C write, as its AVX2 quantizer
    rounds): per 32 values the scale max |x| / 127 as float16, and the values times 127 /
    max |x| rounded to nearest even as int8; scale 0 for a block of zeros."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv).astype(np.int8).reshape(x.shape)
    return q, d[..., 0].astype(np.float16)


def _q8_0_round(x: torch.Tensor) -> torch.Tensor:
    """x through q8_0 and back: int8 values times their float16 scales (float32 holds them
    exactly; writing them to a q8_0 cache again gives the same blocks)."""
    q, d = _q8_0(x.numpy())
    return torch.from_numpy(q.astype(np.float32).reshape(*q.shape[:-1], -1, 32)
                            * d.astype(np.float32)[..., None]).reshape(x.shape)


def _q8_0_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, d: int) -> tuple[np.ndarray, ...]:
    """A q8_0 cache's blocks read back: K values [KVH, nb, D, bs], K scales [KVH, nb, D/32,
    bs], V values [KVH, nb, bs, D], V scales [KVH, nb, bs, D/32] (paged_attention.c's
    layout: a block's keys four dims of a slot together, dim d of slot s at byte
    (d // 4 * bs + s) * 4 + d % 4)."""
    k_store, v_store = (t.contiguous().numpy() for t in (k_cache.permute(2, 0, 3, 1), v_cache.permute(2, 0, 1, 3)))
    kvh, nb, _, bs = k_store.shape
    k_scales = np.ascontiguousarray(k_store[:, :, d:, :]).reshape(kvh, nb, d // 32, 2 * bs).view(np.float16)
    v_scales = np.ascontiguousarray(v_store[..., d:]).view(np.float16)
    k_values = (np.ascontiguousarray(k_store[:, :, :d, :]).reshape(kvh, nb, d // 4, bs, 4)
                .transpose(0, 1, 2, 4, 3).reshape(kvh, nb, d, bs))
    return k_values, k_scales, v_store[..., :d], v_scales


GEOMETRIES = {
    "portable": (BS, H, KVH, D),  # block size 4, head dim 8: the plain C loops
    # block size 16 and head dims of 32s: the AVX2 path, in runs of 3, 4 + 4 and 1 heads
    "simd-gqa3": (16, 9, 3, 64),
    "simd-gqa8": (16, 8, 1, 32),
    "simd-mha": (16, 4, 4, 96),
}


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize("window", [None, 5, 13])
@pytest.mark.parametrize("seq_lens", [[1], [7, 1, 30], [16, 17, 3, 64], [200, 9]])
def test_c_decode_equals_torch_decode(seq_lens: list[int], window: int | None,
                                      geometry: tuple[int, int, int, int]) -> None:
    if geometry[0] * 16 < max(seq_lens):  # 16 blocks per request
        pytest.skip("longer than the blocks this cache gives a request")
    c_out, c_k, c_v = _decode_step(seq_lens, window, use_c=True, geometry=geometry)
    t_out, t_k, t_v = _decode_step(seq_lens, window, use_c=False, geometry=geometry)
    assert torch.equal(c_k, t_k) and torch.equal(c_v, t_v)  # the write is a copy
    torch.testing.assert_close(c_out, t_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("seq_lens", [[1], [7, 1, 30], [200, 9]])
def test_c_decode_over_a_half_width_cache(seq_lens: list[int], window: int | None,
                                          geometry: tuple[int, int, int, int], kv_dtype: torch.dtype) -> None:
    """--kv-cache-dtype float16 / bfloat16: the C write rounds as torch's conversion does
    (bit for bit, ties to even), and the C decode widening the values as it reads them
    equals the torch path's gathered float32 products; against a float32 cache of the same
    K/V it differs by the storage's rounding only."""
    if geometry[0] * 16 < max(seq_lens):
        pytest.skip("longer than the blocks this cache gives a request")
    c_out, c_k, c_v = _decode_step(seq_lens, window, use_c=True, geometry=geometry, kv_dtype=kv_dtype)
    p_out, p_k, _ = _decode_step(seq_lens, window, use_c=True, geometry=geometry, kv_dtype=kv_dtype,
                                 lib=load_kernels(simd=False))  # the portable loops and rounding
    assert torch.equal(p_k, c_k)
    torch.testing.assert_close(p_out, c_out, rtol=1e-5, atol=1e-6)
    t_out, t_k, t_v = _decode_step(seq_lens, window, use_c=False, geometry=geometry, kv_dtype=kv_dtype)
    assert c_k.dtype == kv_dtype and torch.equal(c_k, t_k) and torch.equal(c_v, t_v)
    torch.testing.assert_close(c_out, t_out, rtol=1e-5, atol=1e-6)
    f32_out, f32_k, _ = _decode_step(seq_lens, window, use_c=True, geometry=geometry)
    assert torch.equal(f32_k.to(kv_dtype), c_k)  # the same values, rounded once
    rounding = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[kv_dtype]
    torch.testing.assert_close(c_out, f32_out, rtol=rounding, atol=rounding)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, Q8_KV_DTYPE],
                         ids=["float32", "float16", "bfloat16", "q8_0"])
@pytest.mark.parametrize("geometry", [g for n, g in GEOMETRIES.items() if n != "portable"],
                         ids=[n for n in GEOMETRIES if n != "portable"])
def test_avx512_decode_gives_the_avx2_bits(geometry: tuple[int, int, int, int], kv_dtype: torch.dtype) -> None:
    """Where the CPU has AVX-512 the decode attention runs twice as wide with the same
    chains of operations: its output equals the AVX2 path's bit for bit (heads in runs of
    1-4, every cache type, a window, Gemma 2's score cap)."""
    import ctypes

    lib = load_kernels()
    if not lib.pg_attn_isa512():
        pytest.skip("this CPU has no AVX-512 F/BW/VL/DQ/VNNI: only the AVX2 path runs here")
    wide = ctypes.c_int.in_dll(lib, "pg_attn_wide")
    outs = []
    try:
        for value in (1, 0):
            wide.value = value
            outs.append([_decode_step(lens, window, use_c=True, geometry=geometry, kv_dtype=kv_dtype,
                                      soft_cap=cap)[0]
                         for lens, window, cap in (([7, 1, 30], None, None), ([200, 9], None, None),
                                                   ([200, 9], 13, None), ([200, 9], None, 0.5))])
    finally:
        wide.value = 1
    for a, b in zip(*outs):
        assert torch.equal(a, b)


SIMD_GEOMETRIES = {n: g for n, g in GEOMETRIES.items() if n != "portable"}


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
def test_q8_0_write_gives_llama_cpp_blocks(simd: bool) -> None:
    """--kv-cache-dtype q8_0: the C write stores each 32 dims of a key or value as
    llama.cpp's q8_0 block (the numpy model `_q8_0`), byte for byte, in both builds: random
    rows across magnitudes, a row of zeros (scale 0) and rows where one value dwarfs the
    rest."""
    lib = load_kernels(simd)
    if lib is None:
        pytest.skip("no C compiler: the kernels are not built")
    gen = torch.Generator().manual_seed(7)
    kvh, d, n = 2, 64, 40
    rows = torch.randn(n, kvh, d, generator=gen) * 10.0 ** torch.randint(-3, 3, (n, kvh, 1), generator=gen)
    rows[3] = 0.0
    rows[5, 0, 7] = 1e4
    k_cache, v_cache = TorchAttentionBackend.allocate_kv_cache(4, 16, kvh, d, Q8_KV_DTYPE, torch.device("cpu"))
    impl = TorchAttentionImpl(kvh, d, 1.0, kvh)
    k_store, v_store = impl.cache_storage((k_cache, v_cache))
    assert k_store.shape == (kvh, 4, d + d // 16, 16) and v_store.shape == (kvh, 4, 16, d + d // 16)
    slots = torch.randperm(64, generator=gen)[:n]
    values = rows.flip(-1).contiguous()  # V rows differ from K rows
    lib.pg_write_kv(rows.data_ptr(), kvh * d, values.data_ptr(), kvh * d, n, kvh, d, KV_TYPE_CODES[Q8_KV_DTYPE],
                    k_store.data_ptr(), v_store.data_ptr(), 4, 16, slots.data_ptr())
    k_q, k_s, v_q, v_s = _q8_0_cache(k_cache, v_cache, d)
    want_kq, want_ks = _q8_0(rows.numpy())
    want_vq, want_vs = _q8_0(values.numpy())
    for t, slot in enumerate(slots.tolist()):
        blk, off = divmod(slot, 16)
        assert np.array_equal(k_q[:, blk, :, off], want_kq[t]) and np.array_equal(v_q[:, blk, off], want_vq[t])
        assert np.array_equal(k_s[:, blk, :, off], want_ks[t]) and np.array_equal(v_s[:, blk, off], want_vs[t])
    assert (want_ks[3] == 0).all() and (want_kq[3] == 0).all()


@pytest.mark.parametrize("geometry", SIMD_GEOMETRIES.values(), ids=SIMD_GEOMETRIES.keys())
@pytest.mark.parametrize("window,cap", [(None, None), (13, None), (None, 0.5)])
@pytest.mark.parametrize("seq_lens", [[1], [7, 1, 30], [200, 9]])
def test_c_decode_over_a_q8_0_cache(seq_lens: list[int], window: int | None, cap: float | None,
                                    geometry: tuple[int, int, int, int]) -> None:
    """The decode attention over a q8_0 cache equals the torch path's float32 attention
    over the values the cache holds and the query its scores quantize (K/V and the query
    times the scale already on q8_0's grid, so the write and the query's quantization keep
    them exactly: the integer sums then differ from float32 sums by float32's rounding),
    and differs from float32 K/V and queries by q8_0's rounding only."""
    if geometry[0] * 16 < max(seq_lens):
        pytest.skip("longer than the blocks this cache gives a request")
    q8_out, k_cache, _ = _decode_step(seq_lens, window, use_c=True, geometry=geometry, kv_dtype=Q8_KV_DTYPE,
                                      soft_cap=cap, q8_values=True)
    assert k_cache.dtype == torch.int8 and k_cache.shape[-1] == geometry[3] + geometry[3] // 16
    ref, _, _ = _decode_step(seq_lens, window, use_c=False, geometry=geometry, soft_cap=cap, q8_values=True)
    torch.testing.assert_close(q8_out, ref, rtol=1e-5, atol=2e-6)
    # a query off the grid: its two int8 levels leave ~1/250 of one level's rounding (here
    # at most 6e-5 from the float query; one level alone: 1.1e-2)
    off_grid, _, _ = _decode_step(seq_lens, window, use_c=True, geometry=geometry, kv_dtype=Q8_KV_DTYPE,
                                  soft_cap=cap, q8_values=True, q8_query=False)
    ref, _, _ = _decode_step(seq_lens, window, use_c=False, geometry=geometry, soft_cap=cap, q8_values=True,
                             q8_query=False)
    assert (off_grid - ref).abs().max() < 2e-4, (off_grid - ref).abs().max()
    plain, _, _ = _decode_step(seq_lens, window, use_c=True, geometry=geometry, kv_dtype=Q8_KV_DTYPE,
                               soft_cap=cap)
    f32, _, _ = _decode_step(seq_lens, window, use_c=True, geometry=geometry, soft_cap=cap)
    assert 1e-4 < (plain - f32).abs().max() < 0.05  # q8_0's rounding of K and V N(0, 1)


def test_q8_0_cache_needs_the_c_kernels() -> None:
    """Only the C kernels' AVX2 attention reads a q8_0 cache: the torch ops refuse it with
    the reason rather than reading its bytes as numbers, a geometry the kernels do not read
    is refused when the cache is made, and the C decode says so (-2) rather than reading
    it as float32 where its plain loops would run."""
    with pytest.raises(RuntimeError, match="q8_0 KV cache is read and written by pagellm's C kernels only"):
        _decode_step([5], None, use_c=False, geometry=(16, 9, 3, 64), kv_dtype=Q8_KV_DTYPE)
    for bs, d in ((8, 64), (16, 48), (16, 512)):
        with pytest.raises(ValueError, match=f"a q8_0 KV cache takes blocks of 16 and heads of 32-256 dims in "
                                             f"steps of 32 \\(got blocks of {bs}, {d} dims\\)"):
            TorchAttentionBackend.allocate_kv_cache(4, bs, 1, d, Q8_KV_DTYPE, torch.device("cpu"))
    for simd in (True, False):
        lib = load_kernels(simd)
        if lib is None:
            continue
        ready = bool(lib.pg_paged_prefill_ready(64))  # the AVX2 build
        assert [lib.pg_paged_decode_ready(3, d, bs) for d, bs in ((64, 16), (64, 8), (48, 16), (288, 16))] \
            == [ready, False, False, False]
        assert lib.pg_paged_decode_ready(1, 48, 8) == 1  # a float cache: anywhere
        out = torch.empty(1, 1, 48)
        cache = torch.zeros(2, 48 + 3, 16, dtype=torch.int8)
        zero = torch.zeros(1, dtype=torch.long)
        assert lib.pg_paged_decode(out.data_ptr(), 48, 1, 1, 1, 48, 3, cache.data_ptr(), cache.data_ptr(), 2, 16,
                                   zero.data_ptr(), 1, zero.data_ptr(), (zero + 1).data_ptr(), 1, 1.0, 0.0,
                                   out.data_ptr()) == -2


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
def test_half_width_write_rounds_edge_values_as_torch_does(simd: bool) -> None:
    """The C cache write's float16 / bfloat16 rounding on the values where rounding is
    hard (ties, subnormals, overflow to infinity, NaN, signed zeros), in the SIMD build
    (F16C's conversion) and the portable one (by the bits), and the portable decode reading
    them back."""
    specials = torch.tensor([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 2.0**-24,
                             2.0**-25, 1.5 * 2.0**-25, 3 * 2.0**-26, 2.0**-14, 2.0**-15 * 1.0009765625,
                             1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8,
                             float("inf"), -float("inf"), float("nan")])
    gen = torch.Generator().manual_seed(5)
    values = torch.cat([specials, torch.randn(4096 - len(specials), generator=gen) * 10.0 ** torch.randint(-8, 6, (4096 - len(specials),), generator=gen)])
    impl = TorchAttentionImpl(1, 32, 1.0, 1)
    impl.kernels = load_kernels(simd)
    if impl.kernels is None:
        pytest.skip("no C compiler: the kernels are not built")
    rows = values.view(128, 1, 32)
    for dtype in (torch.float16, torch.bfloat16):
        k_cache, v_cache = TorchAttentionBackend.allocate_kv_cache(8, 16, 1, 32, dtype, torch.device("cpu"))
        k_store, v_store = impl.cache_storage((k_cache, v_cache))
        slots = torch.arange(128)
        impl.kernels.pg_write_kv(rows.data_ptr(), 32, rows.data_ptr(), 32, 128, 1, 32, KV_TYPE_CODES[dtype],
                                 k_store.data_ptr(), v_store.data_ptr(), 8, 16, slots.data_ptr())
        expected = rows.to(dtype)
        for got in (k_cache.reshape(128, 1, 32), v_cache.reshape(128, 1, 32)):
            assert torch.equal(got.view(torch.int16)[~expected.isnan()], expected.view(torch.int16)[~expected.isnan()])
            assert torch.equal(got.isnan(), expected.isnan())


@pytest.mark.parametrize("bs,d", [(4, 2), (16, 32)], ids=["portable", "simd"])
def test_c_decode_attends_over_the_window_only(bs: int, d: int) -> None:
    """Independent of the torch path: with equal scores (zero queries) the output is the
    mean of the V rows of the last `window` positions. Every slot the request does not
    own holds NaN, so a kernel that lets one into the softmax or the V sum fails."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = TorchAttentionBackend.allocate_kv_cache(8, bs, 1, d, torch.float32, torch.device("cpu"))
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    n, window = 2 * bs + 2, bs + 2  # the window starts inside the request's first block read
    v_rows = torch.randn(n, d, generator=gen)
    for p in range(n):  # one request in blocks 3, 5, 7
        blk = [3, 5, 7][p // bs]
        v_cache[blk, p % bs, 0] = v_rows[p]
        k_cache[blk, p % bs, 0] = torch.randn(d, generator=gen)
    impl = TorchAttentionImpl(1, d, 1.0, 1)
    assert impl.kernels is not None
    builder = TorchAttentionMetadataBuilder(bs, torch.device("cpu"), sliding_window=window)
    common = CommonAttentionMetadata(
        num_reqs=1, num_actual_tokens=1, query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([n]),
        block_table=torch.tensor([[3, 5, 7]]), slot_mapping=torch.tensor([7 * bs + 1]),
        query_start_loc_cpu=[0, 1], seq_lens_cpu=[n], max_query_len=1, max_seq_len=n, block_size=bs,
    )
    meta = builder.build(common)
    key = k_cache[7, 1:2].clone()  # contiguous heads, as the C kernels take them
    out = impl.forward(torch.zeros(1, 1, d), key, v_rows[n - 1 :, None], (k_cache, v_cache), meta)
    torch.testing.assert_close(out[0, 0], v_rows[n - window :].mean(0))


def test_decode_rows_of_a_mixed_step_equal_a_decode_only_step() -> None:
    """Two decodes split around a 5-token prompt chunk (rows 0 and 6 of 7) get bit for bit
    the output a decode-only step of the same two requests gives them: mixed steps take
    the same C kernel, not a second decode path."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = TorchAttentionBackend.allocate_kv_cache(48, BS, KVH, D, torch.float32, torch.device("cpu"))
    impl = TorchAttentionImpl(H, D, D**-0.5, KVH)
    assert impl.kernels is not None
    builder = TorchAttentionMetadataBuilder(BS, torch.device("cpu"))
    tables = torch.stack([torch.randperm(16, generator=gen) + 16 * b for b in range(3)])
    lens = {0: 7, 2: 30}  # requests 0 and 2 decode; request 1 is the prompt chunk

    def slot(b: int, p: int) -> int:
        return int(tables[b, p // BS]) * BS + p % BS

    for b, n in lens.items():  # their contexts, written straight into the blocks
        for p in range(n):
            k_cache[tables[b, p // BS], p % BS] = torch.randn(KVH, D, generator=gen)
            v_cache[tables[b, p // BS], p % BS] = torch.randn(KVH, D, generator=gen)
    q_dec = torch.randn(2, H, D, generator=gen)
    k_dec = torch.stack([k_cache[tables[b, (n - 1) // BS], (n - 1) % BS] for b, n in lens.items()])
    v_dec = torch.stack([v_cache[tables[b, (n - 1) // BS], (n - 1) % BS] for b, n in lens.items()])

    def step(reqs: list[int], q_lens: list[int], seq_lens: list[int], slots: list[int],
             q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        common = CommonAttentionMetadata(
            num_reqs=len(reqs), num_actual_tokens=qsl[-1], query_start_loc=torch.tensor(qsl),
            seq_lens=torch.tensor(seq_lens), block_table=tables[reqs], slot_mapping=torch.tensor(slots),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, max_query_len=max(q_lens),
            max_seq_len=max(seq_lens), block_size=BS,
        )
        return impl.forward(q, k, v, (k_cache, v_cache), builder.build(common))

    decode_only = step([0, 2], [1, 1], [7, 30], [slot(0, 6), slot(2, 29)], q_dec, k_dec, v_dec)
    chunk = [torch.randn(5, *shape, generator=gen) for shape in ((H, D), (KVH, D), (KVH, D))]
    mixed = step(
        [0, 1, 2], [1, 5, 1], [7, 5, 30], [slot(0, 6), *(slot(1, p) for p in range(5)), slot(2, 29)],
        *(torch.cat([a[:1], c, a[1:]]) for a, c in zip((q_dec, k_dec, v_dec), chunk)),
    )
    assert torch.equal(mixed[[0, 6]], decode_only)
