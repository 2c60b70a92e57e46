"""GGUF weights kept quantized: the CPU kernels against float64 products of gguf's
reference dequantization, the block matrices the layers keep, a synthetic Q4_K_M model
(memory, greedy tokens through every client), unsupported types, truncated files."""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import gguf
import numpy as np
import psutil
import pytest
import torch

from pagellm import kernels
from pagellm.attention import get_attn_backend
from pagellm.benchmarks.synthetic_gguf import SHAPES, random_blocks, write_llama_gguf
from pagellm.model_executor import weight_utils
from pagellm.model_executor.layers.quantization import gguf as gguf_method
from pagellm.model_executor.layers.quantization import resolve_quantization
from pagellm.model_executor.loader import get_model
from tests.utils import make_model_config

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]  # fmt: skip


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Any:
    """caplog for the 'pagellm' logger (which does not propagate to the root)."""
    root = logging.getLogger("pagellm")
    root.addHandler(caplog.handler)
    yield caplog
    root.removeHandler(caplog.handler)


def _reference(data: np.ndarray, qtype: str, rows: int, cols: int) -> np.ndarray:
    t = gguf.GGMLQuantizationType[qtype]
    return np.asarray(gguf.quants.dequantize(data, t), dtype=np.float64).reshape(rows, cols)


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "portable"])
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_product_matches_float64_reference(qtype: str, simd: bool) -> None:
    """‖y − y_ref‖ / ‖y_ref‖ <= 1e-5 for M = 1, 3, 16, 64, 300 on a 37 x 768 weight (K, N
    not powers of two), and the rows the kernel dequantizes equal gguf's bit for bit."""
    lib = kernels.load_kernels(simd)
    assert lib is not None
    rng = np.random.default_rng(7)
    n, k = 37, 768
    data = random_blocks(qtype, n, k, rng)
    ref = _reference(data, qtype, n, k)
    t = int(gguf.GGMLQuantizationType[qtype])
    rows = np.zeros((n, k), np.float32)
    assert lib.pg_dequant_rows(t, data.ctypes.data, data.shape[1], k, None, 0, n, rows.ctypes.data) == 0
    np.testing.assert_array_equal(rows.astype(np.float64), ref)
    for m in (1, 3, 16, 64, 300):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = np.zeros((m, n), np.float32)
        rc = lib.pg_gemm(t, data.ctypes.data, data.shape[1], n, k, x.ctypes.data, k, m,
                         y.ctypes.data, n)
        assert rc == 0
        y_ref = x.astype(np.float64) @ ref.T
        assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) <= 1e-5, (qtype, m)


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "portable"])
@pytest.mark.parametrize("qtype", TYPES)
def test_batched_kernel_matches_float64_reference_and_is_batch_invariant(
        qtype: str, simd: bool) -> None:
    """pg_gemm_batched (ggml_gemm.c) on a 37 x 768 weight (37: a partial block of weight
    rows for every tile width), M = 9, 16, 17, 33, 64 and 700 (700 rows are packed in
    several chunks), into the middle columns of a wider Y: within 1e-5 of float64, other
    columns untouched, and each row's result bit-identical whatever batch it is in."""
    lib = kernels.load_kernels(simd)
    assert lib is not None
    rng = np.random.default_rng(5)
    n, k, ldy = 37, 768, 41
    data = random_blocks(qtype, n, k, rng)
    ref, t = _reference(data, qtype, n, k), int(gguf.GGMLQuantizationType[qtype])
    x_all = rng.standard_normal((700, k)).astype(np.float32)
    results = {}
    for m in (9, 16, 17, 33, 64, 700):
        x = np.ascontiguousarray(x_all[-m:])  # every batch ends with the same rows
        y = np.full((m, ldy), 7.0, np.float32)
        rc = lib.pg_gemm_batched(t, data.ctypes.data, data.shape[1], n, k, x.ctypes.data, k,
                                 m, y[:, 2:].ctypes.data, ldy)
        assert rc == 0
        y_ref = x.astype(np.float64) @ ref.T
        assert np.linalg.norm(y[:, 2:2 + n] - y_ref) / np.linalg.norm(y_ref) <= 1e-5, (qtype, m)
        assert (y[:, :2] == 7.0).all() and (y[:, 2 + n:] == 7.0).all()
        results[m] = y[:, 2:2 + n]
    for y in results.values():
        np.testing.assert_array_equal(y[-9:], results[9])


@pytest.mark.parametrize("m", [1, 3, 16, 64, 200, 300])
def test_gguf_matmul_groups_and_tiles(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused weight of two types (Q4_K rows then Q6_K rows, as in Q4_K_M's q|k|v) in
    three shape paths: the direct kernel (few rows), the batched kernel (up to
    BATCHED_MAX_ROWS) and dequantized tiles + matmul (the scratch tile forced smaller than
    a group, so a group takes several tiles)."""
    monkeypatch.setattr(gguf_method, "SCRATCH_VALUES", 40 * 512)
    rng = np.random.default_rng(3)
    k = 512
    a, b = random_blocks("Q4_K", 96, k, rng), random_blocks("Q6_K", 65, k, rng)
    groups = [gguf_method.WeightGroup(int(gguf.GGMLQuantizationType.Q4_K), a, 0, 96),
              gguf_method.WeightGroup(int(gguf.GGMLQuantizationType.Q6_K), b, 96, 65)]
    w = np.concatenate([_reference(a, "Q4_K", 96, k), _reference(b, "Q6_K", 65, k)])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = gguf_method.gguf_matmul(groups, x, 161)
    y_ref = x.double().numpy() @ w.T
    assert y.shape == (m, 161)
    assert np.linalg.norm(y.numpy() - y_ref) / np.linalg.norm(y_ref) <= 1e-5


def test_synthetic_file_has_q4_k_m_mix(q4_k_m_file: str) -> None:
    reader = weight_utils.open_gguf(q4_k_m_file)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == "Q6_K" and types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["blk.1.ffn_down.weight"] == "Q4_K" and types["blk.2.ffn_down.weight"] == "Q6_K"


def test_layers_keep_blocks_that_dequantize_to_the_float_weights(q4_k_m_file: str) -> None:
    """The block matrices the quantized model keeps (fused, q/k rows reordered) dequantize
    bit-exactly to the float path's weights (gguf's dequantization, then the same fusion
    and reordering); no float copy of a linear weight exists."""
    backend = get_attn_backend("torch")
    quant = get_model(make_model_config(q4_k_m_file, quantization="gguf"), torch.device("cpu"), backend)
    flat = get_model(make_model_config(q4_k_m_file), torch.device("cpu"), backend)
    attn = quant.model.layers[0].self_attn
    r16 = "_R16" if gguf_method.repack_weights() else ""  # repacked where q8 runs on VNNI
    assert [_type_name(g.qtype) for g in attn.qkv_proj.weight_groups] == ["Q4_K" + r16, "Q6_K" + r16]
    assert not any(p.dim() == 2 for p in quant.parameters())  # only norms are float
    checked: set[str] = set()
    for name, module in quant.named_modules():
        groups = getattr(module, "weight_groups", None)
        if not groups:
            continue
        k = module.embedding_dim if hasattr(module, "embedding_dim") else module.in_features
        got = np.concatenate([
            _k16_reference(g.data, g.rows, k) if g.qtype == gguf_method.Q4_K_R16_TYPE
            else _q6_16_reference(g.data, g.rows, k) if g.qtype == gguf_method.Q6_K_R16_TYPE
            else _reference(g.data, gguf.GGMLQuantizationType(g.qtype).name, g.rows, k) for g in groups
        ]).astype(np.float32)
        np.testing.assert_array_equal(got, _float_weight(q4_k_m_file, name, flat), err_msg=name)
        checked.add(name)
    assert {"model.embed_tokens", "lm_head", "model.layers.2.self_attn.qkv_proj",
            "model.layers.2.mlp.down_proj"} <= checked


def _type_name(qtype: int) -> str:
    return gguf_method.TYPE_NAMES.get(qtype) or gguf.GGMLQuantizationType(qtype).name


def _k16_reference(data: np.ndarray, rows: int, k: int) -> np.ndarray:
    """float32 [rows, k] of a Q4_K_R16 matrix (pagellm/kernels/ggml_common.h), in numpy, by
    the operations of gguf's Q4_K dequantization: (d * scale) * q - dmin * min."""
    nsb, groups = k // 256, rows // 16
    b = np.ascontiguousarray(data).reshape(groups, nsb, 2368)
    d = b[..., 0:32].copy().view(np.float16).astype(np.float32)  # [group, sb, row]
    dmin = b[..., 32:64].copy().view(np.float16).astype(np.float32)
    sc = b[..., 64:192].reshape(groups, nsb, 8, 16).astype(np.float32)  # [group, sb, j, row]
    mn = b[..., 192:320].reshape(groups, nsb, 8, 16).astype(np.float32)
    # values: [group, sb, j, c, row, 4 bytes] -> row r's 16 bytes, byte 4c + i
    qs = b[..., 320:].reshape(groups, nsb, 8, 4, 16, 4).transpose(0, 1, 2, 4, 3, 5).reshape(groups, nsb, 8, 16, 16)
    q = np.concatenate([qs & 0xF, qs >> 4], -1).astype(np.float32)  # [group, sb, j, row, 32]
    w = (d[:, :, None, :] * sc)[..., None] * q - (dmin[:, :, None, :] * mn)[..., None]
    return w.transpose(0, 3, 1, 2, 4).reshape(rows, k)


def _k16_five_reference(data: np.ndarray, rows: int, k: int) -> np.ndarray:
    """float32 [rows, k] of a Q5_K_R16 matrix: Q4_K_R16's decoding of the low 4 bits, plus
    each value's fifth bit (16 d * scale where set), in numpy."""
    nsb, groups = k // 256, rows // 16
    b = np.ascontiguousarray(data).reshape(groups, nsb, 2880)
    low = _k16_reference(np.ascontiguousarray(b[..., :2368]).reshape(rows, -1), rows, k)
    d = b[..., 0:32].copy().view(np.float16).astype(np.float32)  # [group, sb, row]
    sc = b[..., 64:192].reshape(groups, nsb, 8, 16).astype(np.float32)  # [group, sb, j, row]
    h = b[..., 2368:].reshape(groups, nsb, 8, 16, 4)  # [.., j, row, k]: bit u = tile vector u's value
    bits = np.zeros((groups, nsb, 8, 16, 32), dtype=np.float32)
    for i in range(32):
        u = i >> 2 if i < 16 else 4 + ((i - 16) >> 2)
        bits[..., i] = (h[..., i & 3] >> u) & 1
    extra = (d[:, :, None, :] * sc)[..., None] * (16 * bits)
    return low + extra.transpose(0, 3, 1, 2, 4).reshape(rows, k)


def _q6_16_reference(data: np.ndarray, rows: int, k: int) -> np.ndarray:
    """float32 [rows, k] of a Q6_K_R16 matrix (pagellm/kernels/ggml_common.h), in numpy, by
    the operations of gguf's Q6_K dequantization: d * scale * (u - 32)."""
    nsb, groups = k // 256, rows // 16
    b = np.ascontiguousarray(data).reshape(groups, nsb, 3360)
    d = b[..., 0:32].copy().view(np.float16).astype(np.float32)  # [group, sb, row]
    sc = b[..., 32:288].copy().view(np.int8).reshape(groups, nsb, 16, 16).astype(np.float32)  # [.., s, row]
    g = b[..., 288:].reshape(groups, nsb, 8, 384)
    low = g[..., :256].reshape(groups, nsb, 8, 4, 16, 4)  # [.., j, c, row, k]
    top = g[..., 256:].reshape(groups, nsb, 8, 2, 16, 4)  # [.., j, a, row, k]
    u = np.zeros((groups, nsb, 8, 16, 32), dtype=np.int32)  # [.., j, row, value]
    for c in range(4):
        for kk in range(4):
            i = 4 * c + kk
            t = top[:, :, :, c // 2, :, kk] >> (2 * (c % 2))
            u[..., i] = (low[:, :, :, c, :, kk] & 0xF) | ((t & 3) << 4)
            u[..., 16 + i] = (low[:, :, :, c, :, kk] >> 4) | (((t >> 4) & 3) << 4)
    scale = np.repeat(sc.reshape(groups, nsb, 8, 2, 16).transpose(0, 1, 2, 4, 3), 16, axis=-1)  # [.., j, row, 32]
    w = d[:, :, None, :, None] * scale * (u - 32).astype(np.float32)
    return w.transpose(0, 3, 1, 2, 4).reshape(rows, k)


def _float_weight(path: str, name: str, flat: Any) -> np.ndarray:
    """The float path's weight of layer `name`, rebuilt from the same dequantized
    checkpoint tensors (the float model keeps it packed for oneDNN), fused in order."""
    from pagellm.model_executor.models.llama import STACKED_PARAMS

    parts: dict[int, np.ndarray] = {}
    for hf_name, tensor in weight_utils.gguf_weights_iterator(path, flat.config):
        module = hf_name.rsplit(".", 1)[0]
        if hf_name.endswith(".weight") and module == name:
            parts[0] = tensor.numpy()
        for fused, part, shard in STACKED_PARAMS:
            if module.endswith(f".{part}") and module[: -len(part)] + fused == name:
                parts[shard] = tensor.numpy()
    return np.concatenate([parts[i] for i in sorted(parts)])


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_loading_adds_at_most_1_15x_the_file(q4_k_m_file: str, tmp_path: Any) -> None:
    """Resident memory added by building and loading the quantized model (after imports
    and a first load that compiled nothing new) stays within 1.15x the file's size."""
    path = str(tmp_path / "mem-q4_k_m.gguf")
    write_llama_gguf(path, dict(SHAPES["tiny"], hidden=512, inter=1536, layers=6, vocab=8192),
                     "q4_k_m", seed=2)
    size = os.path.getsize(path)
    backend = get_attn_backend("torch")
    get_model(make_model_config(q4_k_m_file, quantization="gguf"), torch.device("cpu"), backend)
    mc = make_model_config(path, quantization="gguf")
    before = _rss()
    model = get_model(mc, torch.device("cpu"), backend)
    added = _rss() - before
    assert model is not None
    assert added <= 1.15 * size, f"loading added {added / 1e6:.1f} MB for a {size / 1e6:.1f} MB file"


def test_synthetic_q4_k_m_same_tokens_in_every_client(q4_k_m_file: str) -> None:
    """In-process, multiprocess and async clients generate the same greedy tokens on the
    quantized path (the default: int8 activations, and a q8_0 KV cache where the C
    attention reads it), and the float path (dequantized at load) agrees with the quantized
    blocks' exact path (float32 activations and cache): the same weights, and no rounding
    of activations or cache between them for a random model's near ties to fall on."""
    import asyncio

    from pagellm import LLM, SamplingParams
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.engine.async_llm import AsyncLLM

    prompts = [[5, 9, 13, 200, 17], [300, 2, 44]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kwargs = dict(model=q4_k_m_file, max_model_len=256, kv_cache_memory_bytes=8 << 20)

    def run_llm(mp: bool, quantization: str | None, **extra) -> list[list[int]]:
        os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = "1" if mp else "0"
        try:
            llm = LLM(quantization=quantization, **kwargs, **extra)
            assert llm.llm_engine.model_config.quantization == {None: "gguf", "gguf": "gguf", "none": None}[quantization]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            llm.shutdown()
            return [list(o.outputs[0].token_ids) for o in outs]
        finally:
            os.environ.pop("PAGELLM_ENABLE_MULTIPROCESSING", None)

    inproc = run_llm(False, None)
    assert run_llm(True, "gguf") == inproc

    async def run_async() -> list[list[int]]:
        engine = AsyncLLM.from_engine_args(EngineArgs(**kwargs))
        try:
            results = []
            for i, p in enumerate(prompts):
                final = None
                async for out in engine.generate({"prompt_token_ids": p}, params, f"r{i}"):
                    final = out
                results.append(list(final.outputs[0].token_ids))
            return results
        finally:
            engine.shutdown()

    assert asyncio.run(run_async()) == inproc
    assert run_llm(False, "none") == run_llm(False, "gguf", gguf_activations="float32")


def test_type_without_kernel_is_dequantized_and_logged(tmp_path: Any, logs: Any) -> None:
    """A tensor in a type no kernel handles (IQ4_NL) still loads, dequantized to float32
    with one log line naming the tensor and type, and multiplies like the reference."""
    path = str(tmp_path / "iq4nl.gguf")
    write_llama_gguf(path, dict(SHAPES["tiny"], layers=1), "IQ4_NL", seed=3)
    mc = make_model_config(path, quantization="gguf")
    with logs.at_level(logging.INFO, logger="pagellm"):
        model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    lines = [r.getMessage() for r in logs.records if "no CPU kernel" in r.getMessage()]
    assert lines == [f"{path}: no CPU kernel for IQ4_NL; its tensors (first: token_embd.weight) "
                     "are dequantized to float32 at load"]
    o_proj = model.model.layers[0].self_attn.o_proj
    assert [g.qtype for g in o_proj.weight_groups] == [gguf_method.F32_TYPE]
    tensor = next(t for t in weight_utils.open_gguf(path).tensors if t.name == "blk.0.attn_output.weight")
    ref = _reference(tensor.data, "IQ4_NL", 256, 256)
    x = torch.randn(2, 256)
    y = o_proj(x)
    np.testing.assert_allclose(y.numpy(), x.double().numpy() @ ref.T, rtol=1e-4, atol=1e-5)


def test_truncated_file_is_named(q4_k_m_file: str, tmp_path: Any) -> None:
    path = str(tmp_path / "cut.gguf")
    with open(q4_k_m_file, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) - 5000])
    with pytest.raises(ValueError, match=rf"^{path}: "):
        get_model(make_model_config(path, quantization="gguf"), torch.device("cpu"),
                  get_attn_backend("torch"))


def test_quantization_resolution(q4_k_m_file: str, tiny_model: Any) -> None:
    model_dir = tiny_model("llama")
    assert resolve_quantization(None, q4_k_m_file, "cpu") == "gguf"
    assert resolve_quantization("none", q4_k_m_file, "cpu") is None
    assert resolve_quantization(None, model_dir, "cpu") is None
    assert resolve_quantization(None, q4_k_m_file, "cuda") is None
    with pytest.raises(ValueError, match=r"quantization='awq' is not supported; choose one of gguf or 'none'"):
        resolve_quantization("awq", q4_k_m_file, "cpu")
    with pytest.raises(ValueError, match=rf"quantization='gguf' needs a .gguf model file; {model_dir} is not one"):
        resolve_quantization("gguf", model_dir, "cpu")


def test_no_compiler_falls_back_to_dequantized(q4_k_m_file: str, monkeypatch: pytest.MonkeyPatch,
                                               logs: Any) -> None:
    """Without a C compiler a GGUF file still runs (dequantized at load) and the log says
    so; asking for 'gguf' explicitly is refused with the reason."""
    monkeypatch.setattr(kernels, "find_compiler", lambda: None)
    monkeypatch.delenv("PAGELLM_GGUF_ACTIVATIONS", raising=False)  # else a second warning
    kernels.load_kernels.cache_clear()
    try:
        with logs.at_level(logging.WARNING, logger="pagellm"):
            assert resolve_quantization(None, q4_k_m_file, "cpu") is None
        assert [r.getMessage() for r in logs.records] == [
            "No C compiler (cc/gcc/clang) found: GGUF weights are dequantized to float32 at "
            "load instead of running quantized, and attention takes its torch path (more "
            "memory, slower single-stream decode)"]
        with pytest.raises(ValueError, match="needs the GGUF CPU kernels, which could not be built"):
            resolve_quantization("gguf", q4_k_m_file, "cpu")
    finally:
        kernels.load_kernels.cache_clear()


Q8_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _round_activations(x: np.ndarray, group: int) -> np.ndarray:
    """x as llama.cpp's activation quantization leaves it (a numpy model): per `group`
    values (32: Q8_0/Q8_1, what pagellm uses for every type; 256: Q8_K, llama.cpp's for the
    K-quants) one scale d = max|x| / 127 and int8 values round(x / d), ties to even."""
    m, k = x.shape
    g = x.reshape(m, k // group, group).astype(np.float32)
    d = np.abs(g).max(-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    return (np.rint(g * inv).astype(np.float64) * d.astype(np.float64)).reshape(m, k)


@pytest.fixture(params=["avx512-vnni", "avx2"])
def q8_isa(request: pytest.FixtureRequest) -> Any:
    """The kernel library with its AVX-512 VNNI kernels on, or forced to the AVX2 ones;
    a path the CPU lacks is skipped, naming what is missing."""
    lib = kernels.load_kernels()
    if lib.pg_q8_isa() == 0:
        pytest.skip("no int8-activation kernels in this build (x86 with AVX2, FMA, F16C needed)")
    wide = ctypes.c_int.in_dll(lib, "pg_q8_wide")
    wide.value = 1
    if request.param == "avx512-vnni" and lib.pg_q8_isa() != 2:
        pytest.skip("this CPU has no AVX-512 VNNI (avx512vnni, avx512bw, avx512vl, avx512dq)")
    wide.value = int(request.param == "avx512-vnni")
    yield lib
    wide.value = 1


@pytest.mark.parametrize("qtype", Q8_TYPES + ["Q3_K"])
def test_q8_kernels_compute_the_int8_scheme(qtype: str, q8_isa: Any) -> None:
    """The int8-activation kernels: equal (1e-5) to float64 products of the weights and the
    numpy model of the rounded activations, for 1-16 input rows (the AVX-512 kernels take 4
    rows per pass over a weight row) and K with a short last chunk of blocks, and for some
    rows of a product while the others stay float32; error against the float64 reference
    no larger than llama.cpp's scheme gives (Q8_0 rounding for 32-blocks, Q8_K for
    K-quants). Q3_K (no int8 kernel) and more than 16 rows stay exact (1e-5)."""
    lib = q8_isa
    rng = np.random.default_rng(11)
    k = 512 if qtype.endswith("_K") else 576  # 576: 18 blocks, 8 + 8 + 2
    n = 45
    data = random_blocks(qtype, n, k, rng)
    t = int(gguf.GGMLQuantizationType[qtype])
    groups = [gguf_method.WeightGroup(t, data, 0, n)]
    ref = _reference(data, qtype, n, k)
    has_q8 = bool(lib.pg_q8_supported(t))
    assert has_q8 == (qtype in Q8_TYPES)
    llama_group = 256 if qtype.endswith("_K") else 32

    def err(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    ours, exact, llama = [], [], []  # decode-sized products, for the error bound below
    for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).numpy()
        rows = gguf_method.int8_rows(m)  # outside a model step: every row, up to 16
        assert rows == (slice(0, m) if m <= gguf_method.Q8_MAX_ROWS else None)
        y = gguf_method.gguf_matmul(groups, torch.from_numpy(x), n, rows).numpy()
        y_ref = x.astype(np.float64) @ ref.T
        if not has_q8 or rows is None:
            assert err(y, y_ref) <= 1e-5, (m, err(y, y_ref))
            continue
        assert err(y, _round_activations(x, 32) @ ref.T) <= 1e-5, m
        ours.append(y)
        exact.append(y_ref)
        llama.append(_round_activations(x, llama_group) @ ref.T)
    # some rows int8 (a step's decodes), the others float32 (its prompt chunks)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(99)).numpy()
    picked = torch.tensor([1, 4, 5, 11])
    y = gguf_method.gguf_matmul(groups, torch.from_numpy(x), n, picked).numpy()
    rest = [i for i in range(12) if i not in picked.tolist()]
    assert err(y[rest], x[rest].astype(np.float64) @ ref.T) <= 1e-5
    if has_q8:
        assert err(y[picked], _round_activations(x[picked], 32) @ ref.T) <= 1e-5
        # two levels (q8x2, and the head): the second rounds what the first left
        y2 = gguf_method.gguf_matmul(groups, torch.from_numpy(x), n, picked, int8_levels=2).numpy()
        first = _round_activations(x[picked], 32)
        second = _round_activations((x[picked] - first).astype(np.float32), 32)
        assert err(y2[picked], (first + second) @ ref.T) <= 1e-5
        assert err(y2[picked], x[picked].astype(np.float64) @ ref.T) < err(y[picked], x[picked].astype(np.float64) @ ref.T) / 50
        assert err(y2[rest], x[rest].astype(np.float64) @ ref.T) <= 1e-5
    if ours:  # over all rows: one row's error is too few terms to compare two schemes
        ours, exact, llama = (np.concatenate(a) for a in (ours, exact, llama))
        assert 1e-5 < err(ours, exact) <= err(llama, exact) * 1.001


def test_head_takes_two_int8_levels_at_any_row_count() -> None:
    """Where the CPU has AVX-512 VNNI and no AMX, the logits head on the int8 path rounds
    every row in two levels (HEAD_INT8_LEVELS), past Q8_MAX_ROWS too (float32 there
    before): each row's logits are the bits it gets alone, and equal (1e-5) the numpy
    model of the two levels."""
    lib = kernels.load_kernels()
    if lib.pg_q8_isa() != 2:
        pytest.skip("this CPU has no AVX-512 VNNI (the head keeps float32 past Q8_MAX_ROWS)")
    if lib.pg_amx_ready():
        pytest.skip("this CPU has AMX-BF16: the head past Q8_MAX_ROWS runs on AMX tiles")
    rng = np.random.default_rng(21)
    n, k = 70, 576
    data = random_blocks("Q8_0", n, k, rng)
    ref = _reference(data, "Q8_0", n, k)
    layer = torch.nn.Module()
    layer.weight_groups = [gguf_method.WeightGroup(int(gguf.GGMLQuantizationType.Q8_0), data, 0, n)]
    layer.out_features = n
    head = gguf_method.GGUFLinearMethod(q8_activations=True, int8_levels=2, head=True)
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    y = head.apply(layer, x)
    alone = torch.cat([head.apply(layer, x[i : i + 1]) for i in range(40)])
    assert torch.equal(y, alone)
    first = _round_activations(x.numpy(), 32)
    second = _round_activations((x.numpy() - first).astype(np.float32), 32)
    want = (first + second) @ ref.T
    assert np.linalg.norm(y.numpy() - want) / np.linalg.norm(want) <= 1e-5


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_head_takes_its_second_level_only_where_it_can_change_the_top_logit(qtype: str) -> None:
    """The logits head with its weights in a 16-row layout (AVX-512 VNNI): pg_head_q8 gives
    each 16-row block of a row's logits either the two-level product's bits (pg_gemm_q8,
    two levels) or the first level's (one level), the first within the block's bound of
    the two-level logits; every row's top logit and its token are the two-level product's,
    also in rows built as near-ties where one level alone picks another token; fewer than
    a quarter of the (row, block) pairs take the second level; a row alone gets the bits
    it gets among the others."""
    lib = kernels.load_kernels()
    if lib.pg_q8_isa() != 2:
        pytest.skip("this CPU has no AVX-512 VNNI (the head's weights keep the file's layout)")
    rng = np.random.default_rng(5)
    n, k = 16 * 160, 512
    plain = np.ascontiguousarray(random_blocks(qtype, n, k, rng))
    if qtype == "Q8_0":
        data, t = np.empty_like(plain), gguf_method.R16_TYPES[8]
        assert lib.pg_repack_r16(t, plain.ctypes.data, plain.shape[1], n, k, data.ctypes.data) == 0
    else:
        data, t = _repack_k(lib, qtype, plain, n, k), K_R16[qtype][1]
    ref = _reference(plain, qtype, n, k)
    layer = torch.nn.Module()
    layer.weight_groups = [gguf_method.WeightGroup(t, data, 0, n)]
    layer.in_features, layer.out_features = k, n
    head = gguf_method.GGUFLinearMethod(q8_activations=True, int8_levels=2, repack=True, head=True)
    head.prepare_head(layer)
    assert [tuple(b.shape) for b in layer.head_bounds] == [(k // 32, n // 16)]
    # near-ties: a + b + g (a - b) with the same product with weight rows a and b, so that
    # one level's rounding decides between them
    a, b = (ref[rng.integers(0, n, size=400)] for _ in range(2))
    d = a - b
    g = -((a * a).sum(1) - (b * b).sum(1)) / (d * d).sum(1)
    ties = a + b + g[:, None] * d
    ties = ties / np.linalg.norm(ties, axis=1, keepdims=True) * 8
    ties = torch.from_numpy((ties + rng.standard_normal(ties.shape) * 1e-4).astype(np.float32))

    def product(x: torch.Tensor, levels: int) -> torch.Tensor:
        return gguf_method.gguf_matmul(layer.weight_groups, x, n, slice(0, x.shape[0]),
                                       float_direct_rows=0, int8_levels=levels)

    flipped = (product(ties, 1).argmax(1) != product(ties, 2).argmax(1)).nonzero().flatten()
    assert len(flipped) >= 2, "no near-tie that one level decides otherwise: the test is void"
    x = torch.cat([torch.from_numpy(rng.standard_normal((38, k)).astype(np.float32)), ties[flipped[:4]]])
    y, one, two = head.apply(layer, x), product(x, 1), product(x, 2)
    blocks = lambda a: a.view(x.shape[0], n // 16, 16)  # noqa: E731
    took = (blocks(y) == blocks(two)).all(-1)
    kept = (blocks(y) == blocks(one)).all(-1)
    assert bool((took | kept).all())
    assert 0 < int(took.sum()) < x.shape[0] * (n // 16) // 4
    assert torch.equal(y.argmax(1), two.argmax(1)) and torch.equal(y.max(1).values, two.max(1).values)
    assert not torch.equal(one.argmax(1), two.argmax(1))  # the near-ties are in
    qx, dx, _ = gguf_method._quantize_q8(lib, x.contiguous(), 2)
    norms = (dx[1::2] * qx[1::2].view(x.shape[0], -1, 32).abs().sum(-1).float())  # [M, K/32]
    bound = norms @ layer.head_bounds[0]
    assert bool(((blocks(one) - blocks(two)).abs().amax(-1) <= bound * 1.001 + 1e-6).all())
    alone = torch.cat([head.apply(layer, x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(y, alone)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_q8_block32_kernels_every_row_length(qtype: str, q8_isa: Any) -> None:
    """The 32-block kernels take whole chunks of 8 blocks, then the rest (unrolled for 2, 4
    and 6 blocks, a general loop otherwise): every rest from 0 to 7 blocks, and rows
    shorter than a chunk, equal (1e-5) the numpy model of the int8 scheme."""
    lib = q8_isa
    rng = np.random.default_rng(5)
    t = int(gguf.GGMLQuantizationType[qtype])
    for blocks in (1, 2, 3, 8, 9, 12, 14, 15, 16, 17, 18, 23):
        k, n = 32 * blocks, 9
        data = random_blocks(qtype, n, k, rng)
        ref = _reference(data, qtype, n, k)
        for m in (1, 2, 5):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(blocks * 10 + m)).numpy()
            y = gguf_method.gguf_matmul([gguf_method.WeightGroup(t, data, 0, n)],
                                        torch.from_numpy(x), n, slice(0, m)).numpy()
            want = _round_activations(x, 32) @ ref.T
            assert np.linalg.norm(y - want) <= 1e-5 * np.linalg.norm(want), (blocks, m)
    assert lib.pg_q8_supported(t)


def _repack_k(lib: Any, qtype: str, data: np.ndarray, n: int, k: int) -> np.ndarray:
    """n rows of a K-quant in their 16-row layout (pg_repack_k_r16)."""
    file_t = int(gguf.GGMLQuantizationType[qtype])
    out = np.empty((n, gguf_method.K_R16_TYPES[file_t][1] * (k // 256)), dtype=np.uint8)
    assert lib.pg_repack_k_r16(file_t, data.ctypes.data, data.shape[1], n, k, out.ctypes.data) == 0
    return out


K_R16 = {"Q4_K": (_k16_reference, gguf_method.Q4_K_R16_TYPE),
         "Q5_K": (_k16_five_reference, gguf_method.Q5_K_R16_TYPE),
         "Q6_K": (_q6_16_reference, gguf_method.Q6_K_R16_TYPE)}
"""A K-quant -> (numpy's reading of its 16-row layout, the layout's type)."""


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_r16_repack_holds_the_same_weights(qtype: str, q8_isa: Any) -> None:
    """Q4_K, Q5_K and Q6_K rows repacked sixteen at a time (Q4_K_R16 ...: what the loader
    does where the int8 kernels run on AVX-512 VNNI): the rows dequantize to the file's bit
    for bit (and read back as the file's blocks in numpy); the int8
    products equal (1e-5) the numpy model for 1-16 input rows and two levels (on the AVX-512
    kernel with the int8 GEMM's tile arithmetic, on the AVX2 path in scalars), and an input
    row's result does not depend on the other rows; its float32 rows equal Q4_K's bit for
    bit; row counts that are not a multiple of 16 and K that is not a multiple of 256 are
    refused (and a product over part of a group), and the loader keeps such groups as the
    file's."""
    lib = q8_isa
    rng = np.random.default_rng(21)
    n, k = 48, 768  # 3 groups of 16 rows; 3 super-blocks
    reference, k16_t = K_R16[qtype]
    data = np.ascontiguousarray(random_blocks(qtype, n, k, rng))
    k16 = _repack_k(lib, qtype, data, n, k)
    np.testing.assert_array_equal(reference(k16, n, k), _reference(data, qtype, n, k))
    q4k_t = int(gguf.GGMLQuantizationType[qtype])
    ids = torch.tensor([0, 5, 43, 6, 17], dtype=torch.int64)
    a, b = torch.empty(5, k), torch.empty(5, k)
    assert lib.pg_dequant_rows(q4k_t, data.ctypes.data, data.shape[1], k, ids.data_ptr(), 0, 5, a.data_ptr()) == 0
    assert lib.pg_dequant_rows(k16_t, k16.ctypes.data, k16.shape[1], k, ids.data_ptr(), 0, 5, b.data_ptr()) == 0
    assert torch.equal(a, b)
    ref = _reference(data, qtype, n, k)
    q4k, packed = [gguf_method.WeightGroup(q4k_t, data, 0, n)], [gguf_method.WeightGroup(k16_t, k16, 0, n)]
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(100))
    alone = {levels: torch.cat([gguf_method.gguf_matmul(packed, x[i : i + 1], n, slice(0, 1), int8_levels=levels)
                                for i in range(16)]) for levels in (1, 2)}
    for m in (1, 2, 3, 4, 5, 9, 16):
        for levels in (1, 2):
            y = gguf_method.gguf_matmul(packed, x[:m], n, slice(0, m), int8_levels=levels)
            assert torch.equal(y, alone[levels][:m]), (m, levels)
            first = _round_activations(x[:m].numpy(), 32)
            want = first if levels == 1 else first + _round_activations((x[:m].numpy() - first).astype(np.float32), 32)
            want = want @ ref.T
            assert np.linalg.norm(y.numpy() - want) <= 1e-5 * np.linalg.norm(want), (m, levels)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(7))  # float32 rows: tiles
    assert torch.equal(gguf_method.gguf_matmul(packed, x, n), gguf_method.gguf_matmul(q4k, x, n))
    assert torch.equal(gguf_method.gguf_matmul(packed, x[:3], n), gguf_method.gguf_matmul(q4k, x[:3], n))
    bad = np.empty((n, 210 * 3), dtype=np.uint8)
    xs, ys = torch.randn(2, k), torch.empty(2, n)  # a product over part of a 16-row group: refused
    assert lib.pg_gemm(k16_t, k16.ctypes.data, k16.shape[1], 40, k, xs.data_ptr(), k, 2, ys.data_ptr(), n) == -1
    for rows, kk in ((44, k), (n, 512)):  # rows not a multiple of 16; row bytes not K's
        assert lib.pg_repack_k_r16(q4k_t, data.ctypes.data, data.shape[1], rows, kk, bad.ctypes.data) == -1
    assert lib.pg_repack_k_r16(int(gguf.GGMLQuantizationType.Q8_0), data.ctypes.data, data.shape[1], n, k,
                               bad.ctypes.data) == -1  # not a K-quant
    odd = gguf_method.WeightGroup(q4k_t, data[:44], 0, 44)
    assert gguf_method._repacked(odd, k) is odd
    assert gguf_method._repacked(q4k[0], k).qtype == k16_t


def test_simd_quantization_gives_the_portable_bytes() -> None:
    """Rounding activations to int8 (pg_quantize_q8, one and two levels): the vector code of
    the SIMD build gives the portable build's bytes, scales and sums exactly, ties (values
    at k + 1/2 steps, rounded to even), an all-zero group and a one-value group included."""
    simd, portable = kernels.load_kernels(), kernels.load_kernels(simd=False)
    if simd is None or portable is None or simd.pg_q8_isa() == 0:
        pytest.skip("no SIMD build of the kernels here (x86 with AVX2, FMA and F16C needed)")
    m, k = 6, 128
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)) * 3
    x[1, :32] = 0.0
    x[2, 32:64] = 0.0
    x[2, 40] = -1.0
    x[3, :32] = torch.arange(32) - 15.5  # max |x| 15.5: steps of 15.5 / 127, ties at halves
    x[4, :32] = (torch.arange(32) % 5 - 2) * 127 / 254  # x / d = k + 1/2 exactly
    x[4, 0] = 127.0
    for levels in (1, 2):
        got = []
        for lib in (simd, portable):
            q = torch.empty(m * levels, k, dtype=torch.int8)
            d = torch.empty(m * levels, k // 32)
            sums = torch.empty(m * levels, k // 16, dtype=torch.int32)
            lib.pg_quantize_q8(x.data_ptr(), k, m, k, levels, q.data_ptr(), d.data_ptr(), sums.data_ptr())
            got.append((q, d, sums))
        for a, b in zip(*got):
            assert torch.equal(a, b), levels


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_r16_repack_holds_the_same_weights(qtype: str, q8_isa: Any) -> None:
    """Q4_0, Q4_1 and Q8_0 rows repacked sixteen at a time (what the loader does where the
    int8 kernels run on AVX-512 VNNI): the rows dequantize to the file's bit for bit; the
    int8 products equal (1e-5) the numpy model for 1-16 input rows and two levels; an input
    row gets the same bits whatever the other rows of the product (a speculative verify run
    is decoded row by row), and on the AVX-512 kernel the bits the int8 GEMM gives it; the
    float32 rows equal the file's bit for bit; 40 rows (not a multiple of 16) and K = 48
    are refused, and the loader keeps such groups as they are."""
    lib = q8_isa
    rng = np.random.default_rng(22)
    n, k = 48, 96  # 3 groups of 16 rows, 3 blocks of 32 values
    data = np.ascontiguousarray(random_blocks(qtype, n, k, rng))
    file_t = int(gguf.GGMLQuantizationType[qtype])
    r16_t = gguf_method.R16_TYPES[file_t]
    r16 = np.empty_like(data)
    assert lib.pg_repack_r16(r16_t, data.ctypes.data, data.shape[1], n, k, r16.ctypes.data) == 0
    assert not np.array_equal(r16, data)
    ids = torch.tensor([0, 5, 47, 16, 31], dtype=torch.int64)
    a, b = torch.empty(5, k), torch.empty(5, k)
    assert lib.pg_dequant_rows(file_t, data.ctypes.data, data.shape[1], k, ids.data_ptr(), 0, 5, a.data_ptr()) == 0
    assert lib.pg_dequant_rows(r16_t, r16.ctypes.data, r16.shape[1], k, ids.data_ptr(), 0, 5, b.data_ptr()) == 0
    assert torch.equal(a, b)
    ref = _reference(data, qtype, n, k)
    plain = [gguf_method.WeightGroup(file_t, data, 0, n)]
    packed = [gguf_method.WeightGroup(r16_t, r16, 0, n)]
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    alone = {levels: torch.cat([gguf_method.gguf_matmul(packed, x[i : i + 1], n, slice(0, 1), int8_levels=levels)
                                for i in range(16)]) for levels in (1, 2)}
    for m in (1, 2, 3, 5, 8, 9, 16):
        for levels in (1, 2):
            y = gguf_method.gguf_matmul(packed, x[:m], n, slice(0, m), int8_levels=levels)
            assert torch.equal(y, alone[levels][:m]), (m, levels)
            first = _round_activations(x[:m].numpy(), 32)
            want = first if levels == 1 else first + _round_activations((x[:m].numpy() - first).astype(np.float32), 32)
            want = want @ ref.T
            assert np.linalg.norm(y.numpy() - want) <= 1e-5 * np.linalg.norm(want), (m, levels)
    if ctypes.c_int.in_dll(lib, "pg_q8_wide").value and lib.pg_i8gemm_fast():
        y = torch.empty(16, n)
        qx, dx, sx = torch.empty(16, k, dtype=torch.int8), torch.empty(16, k // 32), torch.empty(16, k // 16, dtype=torch.int32)
        lib.pg_quantize_q8(x.data_ptr(), k, 16, k, 1, qx.data_ptr(), dx.data_ptr(), sx.data_ptr())
        assert lib.pg_gemm_i8(file_t, data.ctypes.data, data.shape[1], n, k, qx.data_ptr(), dx.data_ptr(),
                              sx.data_ptr(), 16, y.data_ptr(), n) == 0
        assert torch.equal(y, alone[1])
        y.zero_()  # the GEMM on the repacked rows (its tiles unpacked from them directly)
        assert lib.pg_gemm_i8(r16_t, r16.ctypes.data, r16.shape[1], n, k, qx.data_ptr(), dx.data_ptr(),
                              sx.data_ptr(), 16, y.data_ptr(), n) == 0
        assert torch.equal(y, alone[1])
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(7))  # float32 rows: tiles
    assert torch.equal(gguf_method.gguf_matmul(packed, x, n), gguf_method.gguf_matmul(plain, x, n))
    assert torch.equal(gguf_method.gguf_matmul(packed, x[:3], n), gguf_method.gguf_matmul(plain, x[:3], n))
    bad = np.empty_like(data)
    assert lib.pg_repack_r16(r16_t, data.ctypes.data, data.shape[1], 40, k, bad.ctypes.data) == -1
    assert lib.pg_repack_r16(r16_t, data.ctypes.data, data.shape[1], n, 48, bad.ctypes.data) == -1
    assert lib.pg_repack_r16(file_t, data.ctypes.data, data.shape[1], n, k, bad.ctypes.data) == -1
    qx, dx, sx = torch.empty(1, k, dtype=torch.int8), torch.empty(1, k // 32), torch.empty(1, k // 16, dtype=torch.int32)
    assert lib.pg_gemm_q8(r16_t, r16.ctypes.data, r16.shape[1], 40, k, qx.data_ptr(), dx.data_ptr(),
                          sx.data_ptr(), 1, 1, torch.empty(1, 40).data_ptr(), 40) == -1  # 40 rows: no whole groups
    odd = gguf_method.WeightGroup(file_t, data[:40], 0, 40)
    assert gguf_method._repacked(odd, k) is odd
    assert gguf_method._repacked(plain[0], k).qtype == r16_t


def test_repack_switch(q4_k_m_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K linears become Q4_K_R16 at load where q8 runs on AVX-512 VNNI (the load line says
    so); PAGELLM_GGUF_REPACK=0 and the exact path keep the file's Q4_K."""
    from pagellm.model_executor.loader import weights_summary

    def types(**kw: Any) -> tuple[list[str], str]:
        model = get_model(make_model_config(q4_k_m_file, quantization="gguf", **kw),
                          torch.device("cpu"), get_attn_backend("torch"))
        groups = model.model.layers[1].mlp.gate_up_proj.weight_groups
        return [_type_name(g.qtype) for g in groups], weights_summary(model)

    monkeypatch.setenv("PAGELLM_GGUF_REPACK", "0")
    assert not gguf_method.repack_weights()
    assert types(gguf_activations="q8")[0] == ["Q4_K", "Q4_K"]
    monkeypatch.delenv("PAGELLM_GGUF_REPACK")
    assert types(gguf_activations="float32")[0] == ["Q4_K", "Q4_K"]
    if kernels.load_kernels().pg_q8_isa() != 2:
        assert not gguf_method.repack_weights()
        pytest.skip("this CPU has no AVX-512 VNNI (avx512vnni, avx512bw, avx512vl, avx512dq): "
                    "nothing is repacked")
    names, summary = types(gguf_activations="q8")
    assert names == ["Q4_K_R16", "Q4_K_R16"] and "Q4_K_R16 x" in summary


def test_default_model_repacks_its_linears_and_tied_head_in_place(default_model_path: str) -> None:
    """The default model (Q4_1 linears, a Q8_0 token table tied to the head) on the int8
    path where it runs on AVX-512 VNNI: its linears load as Q4_1_R16, the head and the
    embedding share one Q8_0_R16 group (no second copy of the table), and a lookup gives
    the file's rows bit for bit; the exact path keeps the file's layouts."""
    def load(activations: str) -> Any:
        return get_model(make_model_config(default_model_path, quantization="gguf",
                                           gguf_activations=activations),
                         torch.device("cpu"), get_attn_backend("torch"))

    exact = load("float32")
    assert [_type_name(g.qtype) for g in exact.model.layers[0].mlp.down_proj.weight_groups] == ["Q4_1"]
    assert exact.lm_head.weight_groups[0] is exact.model.embed_tokens.weight_groups[0]
    if kernels.load_kernels().pg_q8_isa() != 2:
        pytest.skip("this CPU has no AVX-512 VNNI (avx512vnni, avx512bw, avx512vl, avx512dq): "
                    "nothing is repacked")
    model = load("q8")
    assert [_type_name(g.qtype) for g in model.model.layers[0].mlp.down_proj.weight_groups] == ["Q4_1_R16"]
    (head,) = model.lm_head.weight_groups
    assert _type_name(head.qtype) == "Q8_0_R16" and head is model.model.embed_tokens.weight_groups[0]
    ids = torch.tensor([0, 1, 17, 4242, 49151])
    assert torch.equal(model.model.embed_tokens(ids), exact.model.embed_tokens(ids))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K", "Q4_K_R16", "Q5_K_R16", "Q6_K_R16", "Q8_0_R16"])
def test_q8_products_claimed_in_chunks_equal_static_shares(qtype: str) -> None:
    """pg_gemm_q8 hands its rows out in chunks of ~64 KB that the team claims as it goes
    (pg_q8_claim = 1, the default): bit for bit the products of a static split, for a
    product large enough to be split and of many chunks, with a short last chunk."""
    lib = kernels.load_kernels()
    if lib.pg_q8_isa() == 0:
        pytest.skip("no int8-activation kernels in this build (x86 with AVX2, FMA, F16C needed)")
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing is split")
    rng = np.random.default_rng(3)
    k, n = 1024, 4100
    if qtype in ("Q4_K_R16", "Q5_K_R16", "Q6_K_R16"):  # repacked: chunks of whole groups of 16 rows
        n = 4112
        t = K_R16[qtype[:4]][1]
        data = _repack_k(lib, qtype[:4], np.ascontiguousarray(random_blocks(qtype[:4], n, k, rng)), n, k)
    elif qtype == "Q8_0_R16":  # Q8_0 repacked: chunks of whole groups of 16 rows
        n = 4112
        plain = np.ascontiguousarray(random_blocks("Q8_0", n, k, rng))
        data, t = np.empty_like(plain), gguf_method.R16_TYPES[8]
        assert lib.pg_repack_r16(t, plain.ctypes.data, plain.shape[1], n, k, data.ctypes.data) == 0
    else:
        data = random_blocks(qtype, n, k, rng)
        t = int(gguf.GGMLQuantizationType[qtype])
    groups = [gguf_method.WeightGroup(t, data, 0, n)]
    assert n * data.shape[1] > 8 * 65536  # several chunks
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    claim = ctypes.c_int.in_dll(lib, "pg_q8_claim")
    assert claim.value == 1
    try:
        claimed = gguf_method.gguf_matmul(groups, x, n, slice(0, 3))
        claim.value = 0
        static = gguf_method.gguf_matmul(groups, x, n, slice(0, 3))
    finally:
        claim.value = 1
    assert torch.equal(claimed, static)


def test_q8_activations_switch(q4_k_m_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gguf_activations: 'auto' (no PAGELLM_GGUF_ACTIVATIONS) is q8 exactly where the CPU has
    the int8 kernels; the variable and the engine argument choose a path; bad values are
    refused by name."""
    from pagellm.model_executor.layers.quantization import (
        get_quantization_config,
        q8_kernels_available,
    )

    monkeypatch.delenv("PAGELLM_GGUF_ACTIVATIONS", raising=False)
    mc = make_model_config(q4_k_m_file, quantization="gguf")
    assert get_quantization_config(mc).activations == ("q8" if q8_kernels_available() else "float32")
    assert q8_kernels_available() == (kernels.load_kernels().pg_q8_isa() > 0)
    exact = make_model_config(q4_k_m_file, quantization="gguf", gguf_activations="float32")
    assert get_quantization_config(exact).activations == "float32"
    monkeypatch.setenv("PAGELLM_GGUF_ACTIVATIONS", "q8")
    assert get_quantization_config(exact).activations == "float32"  # the argument wins
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    assert model.model.layers[0].mlp.down_proj.quant_method.q8_activations
    monkeypatch.setenv("PAGELLM_GGUF_ACTIVATIONS", "float32")
    assert get_quantization_config(mc).activations == "float32"
    monkeypatch.setenv("PAGELLM_GGUF_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match=r"PAGELLM_GGUF_ACTIVATIONS='int4': choose one of auto, float32, q8, q8x2"):
        get_quantization_config(mc)
    with pytest.raises(ValueError, match=r"gguf_activations='int8': choose one of auto, float32, q8, q8x2"):
        get_quantization_config(make_model_config(q4_k_m_file, quantization="gguf", gguf_activations="int8"))


def test_gguf_activations_engine_argument(q4_k_m_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineArgs.gguf_activations is checked before loading and stored resolved in the
    config the engine core gets; PAGELLM_GGUF_ACTIVATIONS replaces only 'auto'."""
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.model_executor.layers.quantization import q8_kernels_available

    monkeypatch.delenv("PAGELLM_GGUF_ACTIVATIONS", raising=False)
    with pytest.raises(ValueError, match=r"^gguf_activations='int8': choose one of auto, float32, q8, q8x2$"):
        EngineArgs(model=q4_k_m_file, gguf_activations="int8").verify_args()
    auto = EngineArgs(model=q4_k_m_file).create_engine_config().model_config
    assert auto.gguf_activations == ("q8" if q8_kernels_available() else "float32")
    for value in ("float32", "q8", "q8x2"):
        mc = EngineArgs(model=q4_k_m_file, gguf_activations=value).create_engine_config().model_config
        assert mc.gguf_activations == value
    monkeypatch.setenv("PAGELLM_GGUF_ACTIVATIONS", "q8x2")
    assert EngineArgs(model=q4_k_m_file).create_engine_config().model_config.gguf_activations == "q8x2"
    exact = EngineArgs(model=q4_k_m_file, gguf_activations="float32").create_engine_config()
    assert exact.model_config.gguf_activations == "float32"


def test_unwritable_kernel_cache_still_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                              logs: Any) -> None:
    """A cache directory that cannot be created (a file stands in its way) costs a
    warning and a private build, not a crash."""
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(blocker))
    kernels.load_kernels.cache_clear()
    try:
        with logs.at_level(logging.WARNING, logger="pagellm"):
            lib = kernels.load_kernels()
        assert lib is not None and lib.pg_type_supported(2) == 1
        assert any(r.getMessage().startswith("Cannot write the kernel cache") for r in logs.records)
    finally:
        kernels.load_kernels.cache_clear()


def test_quantized_embedding_checks_token_ids(q4_k_m_file: str) -> None:
    model = get_model(make_model_config(q4_k_m_file, quantization="gguf"), torch.device("cpu"),
                      get_attn_backend("torch"))
    embed = model.model.embed_tokens
    rows = embed(torch.tensor([0, 511]))
    ref = _reference(embed.weight_groups[0].data, "Q4_K", 512, 256)
    np.testing.assert_array_equal(rows.numpy(), ref[[0, 511]].astype(np.float32))
    with pytest.raises(IndexError, match=r"token ids must be < 512"):
        embed(torch.tensor([3, 512]))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_kernels_share_torchs_openmp_runtime() -> None:
    """One OpenMP runtime in a process that imported torch and loaded the kernels: their
    parallel regions use torch's thread pool and thread count, not a second pool
    competing for the same cores. (A fresh process: other packages in the test process,
    sentencepiece for one, bring runtimes of their own.)"""
    import ast
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from pagellm import kernels\n"
        "assert kernels.load_kernels() is not None\n"
        "maps = open('/proc/self/maps').read().splitlines()\n"
        "print(sorted({l.split()[-1] for l in maps if 'libgomp' in l or 'libiomp' in l}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    runtimes = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1 and runtimes[0].endswith(os.path.join("torch", "lib", "libgomp.so.1")), runtimes


def test_q8_switch_is_checked_before_loading_and_said_ignored_off_gguf(
        q4_k_m_file: str, tiny_model: Any, monkeypatch: pytest.MonkeyPatch, logs: Any) -> None:
    monkeypatch.setenv("PAGELLM_GGUF_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match=r"PAGELLM_GGUF_ACTIVATIONS='int4': choose one of auto, float32, q8, q8x2"):
        resolve_quantization(None, q4_k_m_file, "cpu")
    monkeypatch.setenv("PAGELLM_GGUF_ACTIVATIONS", "q8")
    with logs.at_level(logging.WARNING, logger="pagellm"):
        assert resolve_quantization("none", q4_k_m_file, "cpu") is None
        assert resolve_quantization(None, q4_k_m_file, "cpu") == "gguf"
    assert [r.getMessage() for r in logs.records] == [
        f"PAGELLM_GGUF_ACTIVATIONS=q8 is ignored: {q4_k_m_file} does not run on GGUF blocks"]


def test_prompt_rows_take_amx_at_any_count_where_the_cpu_has_it() -> None:
    """The q8 path's choice for the rows of a step that are not int8 decode rows: a step
    with prompt rows takes the int8 GEMM entry at any row count where the CPU has AMX-BF16,
    and AMX from its first row (amx_min_rows 1); without AMX only prompt chunks over
    BATCHED_MAX_ROWS do (float32 below); a step of decodes takes it past Q8_MAX_ROWS rows
    and AMX from AMX_MIN_ROWS; outside a step (the logits head) neither."""
    from pagellm.attention.backend import set_forward_context
    from pagellm.model_executor.layers.quantization.gguf import (
        AMX_MIN_ROWS,
        BATCHED_MAX_ROWS,
        Q8_MAX_ROWS,
        amx_min_rows,
        int8_gemm_rows,
    )

    lib = kernels.load_kernels()
    if lib is None:
        pytest.skip("no C compiler")
    amx = bool(lib.pg_amx_ready())

    def rule(m: int, decodes: slice | None) -> tuple[bool, int]:
        with set_forward_context(None, [], decodes):
            return int8_gemm_rows(m), amx_min_rows(m)

    for m in (1, 5, 17, 40, BATCHED_MAX_ROWS):
        assert rule(m, slice(0, 0)) == (amx, 1), m  # prompt rows only
        if m > 1:
            assert rule(m, slice(0, 1)) == (amx, 1), m  # a decode beside a prompt chunk
    assert rule(BATCHED_MAX_ROWS + 1, slice(0, 0)) == (True, 1)
    assert rule(Q8_MAX_ROWS, slice(0, Q8_MAX_ROWS)) == (False, AMX_MIN_ROWS)
    assert rule(Q8_MAX_ROWS + 1, slice(0, Q8_MAX_ROWS + 1)) == (True, AMX_MIN_ROWS)
    assert (int8_gemm_rows(8), amx_min_rows(8)) == (False, AMX_MIN_ROWS)  # no step


@pytest.mark.parametrize("tied", [False, True])
def test_repacked_groups_are_cached_and_mapped_on_the_next_load(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, tied: bool) -> None:
    """The first load of a GGUF file writes its repacked groups to the repack cache
    (<cache>/gguf/<key>/repacked.json and the file it names; here through a writer
    process, then through the load itself); the next load maps them
    read-only instead of repacking (no repack call), with the same bytes and types. A
    changed file gets a new key, an index of another kernel build is ignored and
    rewritten, and PAGELLM_GGUF_CACHE=0 writes nothing. `tied`: the head's rows are the
    embedding's, repacked once for both (tie_head) and cached with the rest."""
    import json

    from pagellm.model_executor.loader import _gguf_cache_dir

    if not gguf_method.repack_weights():
        pytest.skip("no repacked layouts here (the int8 kernels need AVX-512 VNNI)")
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGELLM_GGUF_ACTIVATIONS", "q8")
    path = str(tmp_path / "tiny-q4_k_m.gguf")
    write_llama_gguf(path, dict(SHAPES["tiny"], layers=2), "q4_k_m", seed=3, tied=tied)
    backend = get_attn_backend("torch")
    lib = kernels.load_kernels()

    def load() -> tuple[list[Any], int]:
        """The model's weight groups, and how many groups the load repacked."""
        counted = _CountingRepacks(lib)
        monkeypatch.setattr(gguf_method, "_kernels", lambda: counted)
        model = get_model(make_model_config(path, quantization="gguf"), torch.device("cpu"), backend)
        gguf_method.RepackCache.wait()  # the cache is written on a thread
        monkeypatch.setattr(gguf_method, "_kernels", lambda: lib)
        groups = [g for m in model.modules() for g in getattr(m, "weight_groups", None) or []]
        return groups, counted.repacks

    monkeypatch.setattr(gguf_method.RepackCache, "WRITER_MIN_BYTES", 0)  # a writer process
    first, repacks = load()
    monkeypatch.setattr(gguf_method.RepackCache, "WRITER_MIN_BYTES", 1 << 40)  # the load itself
    directory = _gguf_cache_dir(path)
    with open(os.path.join(directory, "repacked.json")) as f:
        index = json.load(f)
    repacked = [g for g in first if g.qtype in gguf_method.TYPE_NAMES]
    assert repacks == len(index["entries"]) > 0 and len(repacked) >= repacks
    assert index["build"] == kernels.build_key()
    second, repacks = load()
    assert repacks == 0
    assert [g.qtype for g in second] == [g.qtype for g in first]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    cached = [g for g in second if g.qtype in gguf_method.TYPE_NAMES]
    assert all(not g.data.flags.writeable for g in cached)  # views of the cache file
    index["build"] = "another build"
    with open(os.path.join(directory, "repacked.json"), "w") as f:
        json.dump(index, f)
    _, repacks = load()
    assert repacks == len(index["entries"])
    with open(os.path.join(directory, "repacked.json")) as f:
        assert json.load(f)["build"] == kernels.build_key()
    assert len([n for n in os.listdir(directory) if n.endswith(".bin")]) == 1  # the old one removed
    os.utime(path, ns=(1, 1))
    assert _gguf_cache_dir(path) != directory
    monkeypatch.setenv("PAGELLM_GGUF_CACHE", "0")
    _, repacks = load()  # the changed file, with the cache off: repacked, nothing written
    assert repacks == len(index["entries"])
    assert sorted(os.listdir(tmp_path / "cache" / "gguf")) == [os.path.basename(directory)]


class _CountingRepacks:
    """The kernel library, counting the repack calls made through it."""

    def __init__(self, lib: Any):
        self.lib, self.repacks = lib, 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.lib, name)
        if name not in ("pg_repack_k_r16", "pg_repack_r16"):
            return fn

        def counted(*args: Any) -> Any:
            self.repacks += 1
            return fn(*args)

        return counted
