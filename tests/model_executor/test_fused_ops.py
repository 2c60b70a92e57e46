"""The hand-fused per-layer ops (pagellm/kernels/layer_ops.c) against the torch
compositions they replace, on odd shapes and strided rows, in the SIMD and the portable
build; and a whole model's logits with the fused ops against its all-torch path (the
attention kernels off too) for a prefill, a mixed step and a decode step."""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagellm.attention import get_attn_backend
from pagellm.kernels import load_kernels
from pagellm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from pagellm.model_executor.layers.layernorm import RMSNorm
from pagellm.model_executor.layers.rotary_embedding import RopeParams, RotaryEmbedding
from pagellm.model_executor.loader import get_model
from pagellm.model_executor.models.fused_decode import FusedDecodeStack
from tests.utils import PagedRunner, make_model_config


@pytest.fixture(params=[True, False], ids=["simd", "portable"])
def lib(request: pytest.FixtureRequest) -> Any:
    kernels = load_kernels(simd=request.param)
    if kernels is None:
        pytest.skip("no C compiler")
    return kernels


def _rows(t: int, n: int, pad: int, seed: int) -> torch.Tensor:
    """[t, n] random rows that are `pad` floats further apart than n (a strided view)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, n + pad, generator=g)[:, :n]


@pytest.mark.parametrize("t,n,pad", [(1, 577, 0), (3, 33, 5), (5, 7, 1)])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "plain"])
def test_add_rms_norm_equals_add_then_norm(
    lib: Any, t: int, n: int, pad: int, with_residual: bool
) -> None:
    norm = RMSNorm(n, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(_rows(1, n, 0, seed=1)[0])
    x, residual = _rows(t, n, pad, seed=2), _rows(t, n, pad + 2, seed=3)
    res = residual if with_residual else None
    norm.kernels = None
    want_out, want_res = norm.forward_native(x.clone(), None if res is None else res.clone())
    norm.kernels = lib
    x_c = x.clone() if pad == 0 else _rows(t, n, pad, seed=2)  # keep the stride
    got_out, got_res = norm.forward(x_c, res) if with_residual else (norm.forward_single(x_c), x_c)
    assert got_res is x_c and torch.equal(got_res, want_res)  # the add is exact, in place
    torch.testing.assert_close(got_out, want_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t,heads,d,pad", [(1, 12, 64, 0), (4, 5, 10, 7), (2, 3, 2, 0)])
def test_rope_in_place_equals_rotate_half(lib: Any, t: int, heads: int, d: int, pad: int) -> None:
    """The first `heads` heads of [T, heads + 2, D] rows rotate in place; the last two
    (v heads) stay as they were."""
    rope = RotaryEmbedding(d, max_position=300, rope=RopeParams(10000.0, "default", {}))
    positions = torch.tensor([0, 299, 17, 5][:t])
    x = _rows(t, (heads + 2) * d + pad, 0, seed=4)[:, : (heads + 2) * d].view(t, heads + 2, d)
    tables = rope.tables(positions, torch.float32)
    want = x.clone()
    want[:, :heads] = RotaryEmbedding.rotate_torch(x[:, :heads], tables)
    tables.kernels = lib
    RotaryEmbedding.rotate_(x, heads, tables)
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(x[:, heads:], want[:, heads:])


def test_rope_refuses_positions_past_its_tables() -> None:
    rope = RotaryEmbedding(8, max_position=16, rope=RopeParams(10000.0, "default", {}))
    with pytest.raises(IndexError):
        rope.tables(torch.tensor([3, 16]), torch.float32)


@pytest.mark.parametrize("t,i,pad", [(1, 1537, 0), (3, 7, 3), (2, 1, 0)])
def test_silu_and_mul_equals_silu_times_up(lib: Any, t: int, i: int, pad: int) -> None:
    x = _rows(t, 2 * i + pad, 0, seed=5)[:, : 2 * i] * 8
    x[0, :2] = torch.tensor([-100.0, 95.0])[: min(2, i)]  # the clamped ends of e^x
    act = SiluAndMul()
    act.kernels = lib
    got = act.forward(x)
    torch.testing.assert_close(got, SiluAndMul().forward_native(x), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("t,i,pad", [(1, 1537, 0), (3, 7, 3), (2, 1, 0)])
def test_gelu_tanh_and_mul_equals_torch_gelu_times_up(lib: Any, t: int, i: int, pad: int) -> None:
    """Gemma's gate, 0.5 g (1 + tanh(u)) written as g / (1 + e^-2u): torch's
    gelu(approximate="tanh") to a few ulp, the clamped ends included. Where torch's tanh
    rounds to -1 (g below ~-9) it gives exactly 0; the exponential keeps the ~1e-6 tail."""
    x = _rows(t, 2 * i + pad, 0, seed=6)[:, : 2 * i] * 4
    x[0, :2] = torch.tensor([-60.0, 55.0])[: min(2, i)]
    act = GeluAndMul("tanh")
    act.kernels = lib
    torch.testing.assert_close(act.forward(x), act.forward_native(x), rtol=4e-6, atol=2e-6)


@pytest.mark.parametrize("t,nq,nk,d,pad", [(1, 4, 1, 256, 0), (3, 5, 2, 10, 7)])
def test_head_rms_norm_equals_per_head_norms(lib: Any, t: int, nq: int, nk: int, d: int,
                                             pad: int) -> None:
    """q heads normed by one weight, k heads by another, in place; v heads untouched."""
    width = (nq + 2 * nk) * d
    heads = _rows(t, width + pad, 0, seed=7)[:, :width].view(t, nq + 2 * nk, d)
    qn, kn = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    with torch.no_grad():
        qn.weight.copy_(_rows(1, d, 0, seed=8)[0])
        kn.weight.copy_(_rows(1, d, 0, seed=9)[0])
    want = heads.clone()
    want[:, :nq], want[:, nq : nq + nk] = qn._norm(heads[:, :nq]), kn._norm(heads[:, nq : nq + nk])
    lib.pg_head_rms_norm(heads.data_ptr(), heads.stride(0), t, nq, nk, d, qn.weight.data_ptr(),
                         kn.weight.data_ptr(), 1e-6)
    torch.testing.assert_close(heads, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(heads[:, nq + nk :], want[:, nq + nk :])


class _CountingKernels:
    """The kernel library, noting which entry points were called, and how often."""

    def __init__(self, lib: Any) -> None:
        self.lib, self.called, self.counts = lib, set(), Counter()

    def __getattr__(self, name: str) -> Any:
        self.called.add(name)
        self.counts[name] += 1
        return getattr(self.lib, name)


def _set_kernels(model: torch.nn.Module, lib: Any) -> None:
    """Every layer's C kernels (fused ops and attention) on, or off (None)."""
    for module in model.modules():
        for owner in (module, getattr(module, "impl", None)):
            if owner is not None and hasattr(owner, "kernels"):
                owner.kernels = lib


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {"hidden_size": 72, "intermediate_size": 97}), ("qwen3", {}), ("gemma3", {}),
     ("gemma2", {})],
    ids=["llama-odd", "qwen3", "gemma3", "gemma2"],
)
def test_fused_logits_equal_eager_torch(
    tiny_model: Callable[..., str], family: str, overrides: dict
) -> None:
    lib = load_kernels()
    if lib is None:
        pytest.skip("no C compiler")
    mc = make_model_config(tiny_model(family, **overrides))
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    model.model._fused_checked = True  # the per-op kernels, not the one-region stack
    steps = [
        [("a", 11)],  # prefill
        [("a", 1), ("b", 7)],  # mixed: a decode and a prompt
        [("b", 1), ("a", 1)],  # decodes
    ]
    logits = {}
    counting = _CountingKernels(lib)
    for name, kernels in (("fused", counting), ("eager", None)):
        _set_kernels(model, kernels)
        runner = PagedRunner(model, mc, block_size=4)
        runner.add("a", [(i * 7919 + 13) % 49000 + 100 for i in range(13)])
        runner.add("b", [(i * 104729 + 7) % 49000 + 100 for i in range(8)])
        logits[name] = [runner.step(step) for step in steps]
    _set_kernels(model, lib)
    expected = {"pg_add_rms_norm", "pg_rope", "pg_write_kv", "pg_paged_decode"}  # Gemma 2: capped
    expected |= {"pg_gelu_tanh_and_mul"} if family.startswith("gemma") else {"pg_silu_and_mul"}
    expected |= {"pg_head_rms_norm"} if family in ("qwen3", "gemma3") else set()
    assert expected <= counting.called
    for fused, eager in zip(logits["fused"], logits["eager"]):
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())


def _stack_against_modules(
    model: torch.nn.Module, mc: Any, add: Callable[[PagedRunner], None],
    steps: list[list[tuple[str, int]]], block_size: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
    """Logits of `steps` through the one-region stack and through the module path (each
    on a fresh paged cache filled by `add`), and whether each step took the stack."""
    model.model.fused_decode = FusedDecodeStack.build(model.model)
    model.model._fused_checked = True
    stack = model.model.fused_decode
    assert stack is not None
    counting = _CountingKernels(stack.lib)
    stack.lib = counting
    logits, took = {}, []
    for name in ("fused", "modules"):
        model.model.fused_decode = stack if name == "fused" else None
        runner = PagedRunner(model, mc, block_size=block_size)
        add(runner)
        logits[name] = []
        for step in steps:
            counting.called.clear()
            logits[name].append(runner.step(step))
            if name == "fused":
                took.append("pg_decode_layers" in counting.called)
    stack.lib = counting.lib
    model.model.fused_decode = stack
    return logits["fused"], logits["modules"], took


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("activations", ["float32", "q8", "q8x2"])
def test_fused_decode_stack_equals_module_path(tmp_path: Any, activations: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-region stack (GGUF Q4_K_M mix: q|k and v in different types, so a fused
    linear of two groups) takes every step here, decodes of one and several rows and steps
    with prompt chunks (a first prompt, a chunk beside a decode, a chunk over its own
    cached start), whose rows it attends as decodes over the cache where the module path
    runs SDPA: logits within 1e-5 of the module path's, on the exact path (float32
    activations) and on int8 activations of decode rows (one level, two levels). (On the
    same cache a decode step is bit for bit the module path's:
    test_fused_decode_stack_splits_every_kernel.)"""
    from pagellm.benchmarks.synthetic_gguf import SHAPES, write_llama_gguf

    monkeypatch.setenv("PAGELLM_GGUF_ACTIVATIONS", activations)

    path = str(tmp_path / "tiny-q4_k_m.gguf")
    write_llama_gguf(path, dict(SHAPES["tiny"], layers=2), "q4_k_m", seed=1)
    mc = make_model_config(path, quantization="gguf")
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))

    def add(runner: PagedRunner) -> None:
        runner.add("a", [(i * 31 + 3) % 500 + 1 for i in range(16)])
        runner.add("b", [(i * 17 + 5) % 500 + 1 for i in range(11)])

    steps = [
        [("a", 9)],  # a prompt
        [("a", 1)],  # one decode
        [("a", 1), ("b", 5)],  # mixed: a decode and a prompt
        [("b", 3), ("a", 1)],  # a chunk over b's first 5 tokens, then a decode
        [("b", 1), ("a", 1)],  # two decodes
        [("a", 1), ("b", 1)],
    ]
    fused, modules, took = _stack_against_modules(model, mc, add, steps, block_size=4)
    assert took == [True] * len(steps)
    assert model.model.fused_decode.q8 == (activations != "float32")
    assert model.model.fused_decode._step.int8_levels == (2 if activations == "q8x2" else 1)
    for f, m in zip(fused, modules):
        if activations == "q8x2":  # a second level's quantum is 1/250 of the first's: the
            # attention's summation order moves a value across it more often (2e-5 seen)
            torch.testing.assert_close(f, m, rtol=1e-4, atol=1e-4 * m.abs().max().item())
        else:
            _close(f, m)


def test_fused_stack_on_amx_equals_module_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps past the decode kernels' 16 rows on the q8 path where the CPU has AMX-BF16: the one-region
    stack's products on AMX tiles, its MLP's gate and up products with the activation in
    one pass (gated_amx) and its runs of prompt rows attended together, against the module
    path (the same products through gguf_matmul and GGUFLinearMethod.apply_gated, prompt
    rows through pg_paged_prefill): 35- and 20-decode steps (AMX from 17 decodes,
    AMX_MIN_ROWS), a 70-row step of prompts beside decodes, and short steps of prompt rows
    (which take AMX at any count:
    quantization.gguf.amx_min_rows). Logits within 1e-5."""
    from pagellm.benchmarks.synthetic_gguf import SHAPES, write_llama_gguf

    lib = load_kernels()
    if lib is None or not lib.pg_amx_ready():
        pytest.skip("this CPU has no AMX-BF16 (or no C compiler): the AMX paths do not run here")
    monkeypatch.setenv("PAGELLM_GGUF_ACTIVATIONS", "q8")
    path = str(tmp_path / "tiny-q4_k_m.gguf")
    write_llama_gguf(path, dict(SHAPES["tiny"], layers=2), "q4_k_m", seed=2)
    mc = make_model_config(path, quantization="gguf")
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    names = [f"r{i}" for i in range(35)]

    def add(runner: PagedRunner) -> None:
        for i, name in enumerate(names):
            runner.add(name, [(j * (7 + i) + 3 * i) % 500 + 1 for j in range(6 + i % 5)])

    steps = [
        [(n, 2) for n in names],  # 70 prompt rows: a step of prompt chunks
        [(n, 1) for n in names[:30]] + [(n, 2) for n in names[30:]],  # decodes beside chunks
        [(n, 1) for n in names],  # 35 decodes
        [(n, 1) for n in names[:20]],  # 20 decodes
        [(names[0], 1), (names[1], 2), (names[2], 3)],  # a one-token row beside two chunks: 6 rows
        [(names[3], 4)],  # 4 rows of one
    ]
    fused, modules, took = _stack_against_modules(model, mc, add, steps, block_size=16)
    assert took == [True] * len(steps)
    for f, m in zip(fused, modules):
        _close(f, m)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3", "gemma2"])
def test_fused_stack_attends_prompt_rows_like_sdpa(
    tiny_model: Callable[..., str], family: str
) -> None:
    """Prompt chunks through the one-region stack at split shapes (16-slot blocks, 256 /
    768 wide, 2 threads), with and without a sliding window that cuts into them (Gemma 3:
    two views, sliding and global layers; Gemma 2: capped scores, eager attention per chunk
    on the module path), beside decodes of other lengths: logits equal the module path's
    (SDPA per chunk) within 1e-5, and the decodes after them too."""
    if load_kernels() is None:
        pytest.skip("no C compiler")
    window = {"sliding_window": 24} if family in ("mistral", "gemma3", "gemma2") else {}
    mc = make_model_config(tiny_model(
        family, hidden_size=256, intermediate_size=768, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, **window))  # fmt: skip
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))

    def add(runner: PagedRunner) -> None:
        for i, n in enumerate((70, 45, 20)):
            runner.add(f"s{i}", [(j * (31 + 2 * i) + 3 * i) % 500 + 1 for j in range(n)])

    steps = [
        [("s0", 40)],  # a prompt longer than the window
        [("s0", 1), ("s1", 33)],  # a decode beside a prompt
        [("s1", 1), ("s0", 1), ("s2", 17)],  # two decodes and a prompt
        [("s0", 20), ("s1", 1), ("s2", 1)],  # a chunk over s0's cached 41 tokens
        [("s0", 1), ("s1", 1), ("s2", 1)],
    ]
    fused, modules, took = _stack_against_modules(model, mc, add, steps, block_size=16)
    assert took == [True] * len(steps)
    for f, m in zip(fused, modules):
        _close(f, m)


def test_fused_stack_runs_a_large_step_in_calls_of_max_rows(tiny_model: Callable[..., str]) -> None:
    """A step of more rows than the stack's products take runs as consecutive calls of
    `max_rows` rows (a prompt row reading keys an earlier call cached): on float32 weights,
    whose products give a row the same sums at any row count, the logits equal one call's
    bit for bit. Here max_rows is cut to 4, so the 9-row prompt takes 3 calls."""
    if load_kernels() is None:
        pytest.skip("no C compiler")
    mc = make_model_config(tiny_model("llama", hidden_size=72, intermediate_size=97))
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    stack = FusedDecodeStack.build(model.model)
    if stack is None:
        pytest.skip("oneDNN chose a packed layout dense_f32.c does not read on this CPU")
    model.model.fused_decode, model.model._fused_checked = stack, True
    counting = _CountingKernels(stack.lib)
    stack.lib = counting
    steps = [[("a", 9)], [("a", 1), ("b", 6)], [("b", 1), ("a", 1)]]
    logits, calls = {}, {}
    full = stack.max_rows
    for name, max_rows in (("one call", full), ("calls of 4", 4)):
        stack.max_rows = max_rows
        runner = PagedRunner(model, mc, block_size=4)
        runner.add("a", [(i * 31 + 3) % 500 + 1 for i in range(12)])
        runner.add("b", [(i * 17 + 5) % 500 + 1 for i in range(8)])
        logits[name], calls[name] = [], []
        for step in steps:
            counting.counts.clear()
            logits[name].append(runner.step(step))
            calls[name].append(counting.counts["pg_decode_layers"])
    stack.max_rows, stack.lib = full, counting.lib
    assert calls == {"one call": [1, 1, 1], "calls of 4": [3, 2, 1]}
    for split, whole in zip(logits["calls of 4"], logits["one call"]):
        assert torch.equal(split, whole)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "plain"])
def test_fused_decode_stack_on_float32_weights(
    tiny_model: Callable[..., str], monkeypatch: pytest.MonkeyPatch, packing: bool
) -> None:
    """Float32 weights take the one-call decode stack too, reading the copy each linear
    keeps (oneDNN's packed one in place, or the plain weight where nothing is packed): its
    logits equal the module path's bit for bit on a decode step (the same kernels), within
    1e-5 once a prompt chunk was attended (decodes over the cache there, SDPA on the module
    path), and the all-torch path's within 1e-5."""
    from pagellm.model_executor.layers import linear as linear_module

    if load_kernels() is None:
        pytest.skip("no C compiler")
    if not packing:
        monkeypatch.setattr(linear_module, "pack_weight", lambda weight: None)
    mc = make_model_config(tiny_model("llama", hidden_size=72, intermediate_size=97))
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    head = model.lm_head
    if head.dense_f32 is None:
        pytest.skip("oneDNN chose a packed layout dense_f32.c does not read on this CPU")
    assert (head.dense_f32.block > 0) == packing
    steps = [
        [("a", 1)],
        [("a", 1), ("b", 5)],  # mixed: prompt rows attended as decodes by the stack
        [("b", 1), ("a", 1)],
    ]
    logits, fused_calls = {}, {}
    for name in ("fused", "modules", "torch"):
        runner = PagedRunner(model, mc, block_size=4)
        runner.add("a", [(i * 31 + 3) % 500 + 1 for i in range(14)])
        runner.add("b", [(i * 17 + 5) % 500 + 1 for i in range(8)])
        runner.step([("a", 9)])  # the first forward builds the stack
        stack = model.model.fused_decode
        assert stack is not None
        counting = _CountingKernels(stack.lib)
        stack.lib = counting
        if name != "fused":
            model.model.fused_decode = None
        if name == "torch":  # every layer's linears through torch's products
            for module in model.modules():
                if getattr(module, "dense_f32", None) is not None:
                    module.dense_f32_saved, module.dense_f32 = module.dense_f32, None
        logits[name] = [runner.step(step) for step in steps]
        fused_calls[name] = "pg_decode_layers" in counting.called
        for module in model.modules():
            if hasattr(module, "dense_f32_saved"):
                module.dense_f32 = module.dense_f32_saved
                del module.dense_f32_saved
        stack.lib = counting.lib
        model.model.fused_decode = stack
    assert fused_calls == {"fused": True, "modules": False, "torch": False}
    assert torch.equal(logits["fused"][0], logits["modules"][0])  # a decode: bit for bit
    for fused, modules, eager in zip(logits["fused"], logits["modules"], logits["torch"]):
        _close(fused, modules)
        _close(fused, eager)


@pytest.mark.parametrize("rows", [6, 12])
@pytest.mark.parametrize("weights", ["q4_k_m", "float32", "gemma3", "gemma2", "qwen3-moe"])
def test_fused_decode_stack_splits_every_kernel(
    tmp_path: Any, tiny_model: Callable[..., str], weights: str, rows: int
) -> None:
    """At shapes where the one-region stack splits each kernel's work across the team
    (contexts of 40-80 tokens in 16-slot blocks, 256 / 768 wide), and with more rows than
    pg_gemm takes (12: GGUF products through pg_gemm_batched's part): its logits equal the
    module path's, whose kernels each run in a region of their own, bit for bit."""
    from pagellm.benchmarks.synthetic_gguf import SHAPES, write_llama_gguf, write_qwen3_moe_gguf

    if load_kernels() is None:
        pytest.skip("no C compiler")
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing is split")
    if weights == "q4_k_m":
        path = str(tmp_path / "tiny-q4_k_m.gguf")
        write_llama_gguf(path, dict(SHAPES["tiny"], layers=2), "q4_k_m", seed=2)
        mc = make_model_config(path, quantization="gguf")
    elif weights == "qwen3-moe":  # experts picked per row: each expert over a few rows
        path = str(tmp_path / "tiny-moe.gguf")
        write_qwen3_moe_gguf(path, SHAPES["tiny-moe"], "q4_k_m", seed=2)
        mc = make_model_config(path, quantization="gguf")
    else:  # float32 weights; Gemma: its extra norms, GELU, two windows of 24 and all (2: caps)
        mc = make_model_config(tiny_model(
            "llama" if weights == "float32" else weights, hidden_size=256,
            intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2 if weights == "float32" else 3,
            **({} if weights == "float32" else {"sliding_window": 24})))
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    names = [f"s{i}" for i in range(rows)]
    logits, fused_calls = {}, {}
    for name in ("fused", "modules"):
        runner = PagedRunner(model, mc, block_size=16)
        for i, seq in enumerate(names):
            runner.add(seq, [(j * (31 + 2 * i) + 3 * i) % 500 + 1 for j in range(40 + 4 * i)])
        runner.step([(seq, 38 + 4 * i) for i, seq in enumerate(names)])
        stack = model.model.fused_decode
        assert stack is not None and stack.max_rows >= rows
        counting = _CountingKernels(stack.lib)
        stack.lib = counting
        if name == "modules":
            model.model.fused_decode = None
        logits[name] = [runner.step([(seq, 1) for seq in names]) for _ in range(2)]
        fused_calls[name] = "pg_decode_layers" in counting.called
        stack.lib = counting.lib
        model.model.fused_decode = stack
    assert fused_calls == {"fused": True, "modules": False}
    for fused, modules in zip(logits["fused"], logits["modules"]):
        assert torch.equal(fused, modules)
    if weights == "qwen3-moe":  # the expert layers ran in the stack
        assert all(stack._layers[i].moe_experts == 8 for i in range(stack.n_layers))
    if weights in ("q4_k_m", "qwen3-moe") and stack.q8:  # int8 products claimed in chunks or
        claim = ctypes.c_int.in_dll(stack.lib, "pg_q8_claim")  # statically: the same sums
        runner = PagedRunner(model, mc, block_size=16)
        for i, seq in enumerate(names):
            runner.add(seq, [(j * (31 + 2 * i) + 3 * i) % 500 + 1 for j in range(40 + 4 * i)])
        runner.step([(seq, 38 + 4 * i) for i, seq in enumerate(names)])
        try:
            claim.value = 0
            static = [runner.step([(seq, 1) for seq in names]) for _ in range(2)]
        finally:
            claim.value = 1
        for a, b in zip(static, logits["fused"]):
            assert torch.equal(a, b)


def test_capped_scores_take_the_stack_with_their_cap(tiny_model: Callable[..., str]) -> None:
    """Gemma 2 caps attention scores (1.5 here): the C stack is built and carries the cap."""
    mc = make_model_config(tiny_model("gemma2"))
    model = get_model(mc, torch.device("cpu"), get_attn_backend("torch"))
    assert model.layer_attention[0].logits_soft_cap == 1.5
    stack = FusedDecodeStack.build(model.model)
    assert stack is not None
    assert [stack._layers[i].soft_cap for i in range(stack.n_layers)] == [1.5] * 3


@pytest.mark.parametrize("spin_ns", [0, 100_000], ids=["sleeping", "spinning"])
def test_team_barrier_holds(spin_ns: int) -> None:
    """pg_team_sync: in 20000 rounds no thread reads a slot before every thread has
    written it, whether early threads sleep at once or spin first."""
    lib = load_kernels()
    if lib is None:
        pytest.skip("no C compiler")
    assert lib.pg_team_check(20000, spin_ns) == 0
