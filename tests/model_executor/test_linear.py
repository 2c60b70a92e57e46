"""Linear layers: after loading, CPU float32 weights are packed once for oneDNN and the
plain copy is dropped; the packed product equals F.linear's; other dtypes keep the
plain path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.model_executor.layers.linear import Linear, MergedLinear


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
