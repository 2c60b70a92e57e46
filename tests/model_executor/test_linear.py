"""Linear layers: after loading, CPU float32 weights are packed once for oneDNN and the
plain copy is dropped; the packed product equals F.linear's; other dtypes keep the
plain path. Products of a few rows read the kept copy through the C kernels
(dense_f32.c): exact against float64 on odd shapes, the layout check, the routing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels import load_kernels
from pagellm.model_executor.layers import linear as linear_module
from pagellm.model_executor.layers.linear import (
    KERNEL_MAX_ROWS,
    PACKED_KERNEL_MAX_ROWS,
    DenseF32Weight,
    Linear,
    MergedLinear,
    dense_f32_matmul,
)


def _loaded(layer: Linear, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    weight = layer.weight.detach().clone()
    return weight, None if layer.bias is None else layer.bias.detach().clone()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 600])
def test_packed_linear_equals_f_linear(bias: bool, rows: int) -> None:
    layer = MergedLinear(48, [40, 24], bias=bias)
    weight, b = _loaded(layer)
    layer.process_weights_after_loading()
    assert layer.weight is None and layer.packed_weight is not None  # one copy, packed
    assert "weight" not in dict(layer.named_parameters())
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    assert y.shape == (rows, 64) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    layer.process_weights_after_loading()  # a second call leaves the packed weight alone
    torch.testing.assert_close(layer(x), y, rtol=0, atol=0)


def test_non_float32_keeps_the_plain_weight() -> None:
    layer = Linear(16, 8, bias=False).to(torch.bfloat16)
    weight, _ = _loaded(layer)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None and layer.weight is not None
    x = torch.randn(5, 16).to(torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, weight))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
# inductor's imports use torch.jit.script_method, which torch itself now deprecates
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_packed_linear_under_torch_compile() -> None:
    """compilation_config >= 1 compiles the forward: inductor must take the packed weight
    (as an opaque op) and give the eager result, for more than one row count."""
    layer = Linear(32, 24, bias=True)
    weight, b = _loaded(layer)
    layer.process_weights_after_loading()
    compiled = torch.compile(lambda x: torch.relu(layer(x)) * 2, dynamic=True)
    for rows in (5, 9):
        x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():  # as the model runner runs its forward
            y = compiled(x)
        torch.testing.assert_close(y, torch.relu(F.linear(x, weight, b)) * 2, rtol=1e-5, atol=1e-5)


# ---- the C kernels' float32 products (pagellm/kernels/dense_f32.c, pg_gemm type 0)


def _blocked(w: torch.Tensor, block: int, k_pad: int, fill: float) -> torch.Tensor:
    """w [N, K] in dense_f32.c's layout: column blocks of `block` outputs x k_pad values,
    `fill` where the layout pads (past N, past K)."""
    n, k = w.shape
    blocks = -(-n // block)
    out = torch.full((blocks * block, k_pad), fill)
    out[:n, :k] = w
    return out.view(blocks, block, k_pad).transpose(1, 2).contiguous()


@pytest.mark.parametrize("block,n,k", [(64, 130, 72), (64, 64, 37), (64, 1088, 300),
                                       (16, 70, 33), (8, 5, 3), (24, 49, 100)])  # fmt: skip
def test_blocked_f32_kernel_equals_matmul(block: int, n: int, k: int) -> None:
    lib = load_kernels()
    if lib is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    k_pad = -(-k // 16) * 16 + 16
    packed = _blocked(w, block, k_pad, float("nan"))  # padding is never read
    assert lib.pg_f32_blocked_matches(packed.data_ptr(), block, k_pad, n, k, w.data_ptr()) == 1
    dense = DenseF32Weight(packed, packed.data_ptr(), n, k, block=block, k_pad=k_pad)
    x = torch.randn(37, k, generator=g)
    full = dense_f32_matmul(dense, x)
    torch.testing.assert_close(full, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-4)
    # a row's result does not depend on the batch around it: few rows stream the weight,
    # more walk it in L1-sized chunks of k (k = 300 spans three), the numbers are the same
    for rows in (*range(1, 14), 36):
        assert torch.equal(dense_f32_matmul(dense, x[:rows].contiguous()), full[:rows])
        assert torch.equal(dense_f32_matmul(dense, x[-rows:].contiguous()), full[-rows:])
    # the row-major form (pg_gemm's float32 type) gives the same products
    plain = DenseF32Weight(w, w.data_ptr(), n, k, row_bytes=4 * k)
    torch.testing.assert_close(dense_f32_matmul(plain, x), full, rtol=1e-5, atol=1e-4)


def test_blocked_layout_check_refuses_a_mismatch() -> None:
    lib = load_kernels()
    if lib is None:
        pytest.skip("no C compiler")
    w = torch.randn(70, 40, generator=torch.Generator().manual_seed(3))
    packed = _blocked(w, 16, 48, 0.0)
    matches = lib.pg_f32_blocked_matches
    assert matches(packed.data_ptr(), 16, 48, 70, 40, w.data_ptr()) == 1
    assert matches(packed.data_ptr(), 32, 24, 70, 40, w.data_ptr()) == 0  # another width
    assert matches(packed.data_ptr(), 16, 32, 70, 40, w.data_ptr()) == 0  # k_pad < K
    packed[4, 39, 5] += 1.0  # W[4*16 + 5, 39]: the last value of row 69
    assert matches(packed.data_ptr(), 16, 48, 70, 40, w.data_ptr()) == 0
    packed[4, 39, 5] -= 1.0
    wrong = w.clone()
    wrong[0, 0] = -0.0 if w[0, 0] == 0 else -w[0, 0]
    assert matches(packed.data_ptr(), 16, 48, 70, 40, wrong.data_ptr()) == 0


class _Counting:
    def __init__(self, lib: Any) -> None:
        self.lib, self.called = lib, []

    def __getattr__(self, name: str) -> Any:
        self.called.append(name)
        return getattr(self.lib, name)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "plain"])
def test_few_rows_take_the_c_kernel(monkeypatch: pytest.MonkeyPatch, packing: bool) -> None:
    """Up to the view's max_rows rows multiply through the C kernel on the copy the layer
    keeps (oneDNN's packed one, read in place where its layout is recognised: up to
    PACKED_KERNEL_MAX_ROWS where dense_f32.c has its tiles; else the plain weight, up to
    KERNEL_MAX_ROWS), more rows through torch; both equal F.linear."""
    lib = load_kernels()
    if lib is None:
        pytest.skip("no C compiler")
    if packing and not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    if not packing:
        monkeypatch.setattr(linear_module, "pack_weight", lambda weight: None)
    layer = MergedLinear(576, [130, 70], bias=True)
    weight, b = _loaded(layer)
    layer.process_weights_after_loading()
    dense = layer.dense_f32
    if packing:
        assert layer.weight is None  # still one copy
        if dense is None:
            pytest.skip("oneDNN chose a packed layout dense_f32.c does not read on this CPU")
        assert dense.owner is layer.packed_weight and dense.block > 0
        tiles = lib.pg_f32_blocked_tiles(dense.block)
        assert dense.max_rows == (PACKED_KERNEL_MAX_ROWS if tiles else KERNEL_MAX_ROWS)
    else:
        assert dense is not None and dense.block == 0 and dense.ptr == layer.weight.data_ptr()
        assert dense.max_rows == KERNEL_MAX_ROWS
    counting = _Counting(lib)
    monkeypatch.setattr(linear_module, "load_kernels", lambda: counting)
    g = torch.Generator().manual_seed(5)
    for rows in (1, 8, 9, dense.max_rows, dense.max_rows + 1):
        counting.called.clear()
        x = torch.randn(rows, 576, generator=g)
        want = F.linear(x.double(), weight.double(), b.double()).float()  # values ~ 24
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
        kernel = "pg_gemm_f32_blocked" if packing else "pg_gemm"
        assert counting.called == ([kernel] if rows <= dense.max_rows else [])
    with pytest.raises(ValueError, match="input has 575 features, the weight takes 576"):
        layer(torch.randn(2, 575))  # refused before the kernel would read past a row
