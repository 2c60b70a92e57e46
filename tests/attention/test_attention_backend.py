"""The attention backend contract: abstract classes that refuse incomplete subclasses, one
registry that names its backends when asked for an unknown one, and the engine options
that check the name before any model is loaded."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from pagellm import attention
from pagellm.attention import available_attn_backends, get_attn_backend
from pagellm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagellm.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionImpl,
    TorchAttentionMetadataBuilder,
)
from pagellm.engine.arg_utils import EngineArgs


def abstract_class_error(cls_name: str, methods: list[str]) -> str:
    """CPython's message for instantiating an abstract class (its wording changed in 3.12)."""
    plural = "s" if len(methods) > 1 else ""
    if sys.version_info >= (3, 12):
        names = ", ".join(repr(m) for m in methods)
        return (
            f"Can't instantiate abstract class {cls_name} without an implementation "
            f"for abstract method{plural} {names}"
        )
    return f"Can't instantiate abstract class {cls_name} with abstract method{plural} {', '.join(methods)}"


class NoBuild(AttentionMetadataBuilder):
    def __init__(self, block_size: int, device: torch.device, sliding_window: int | None = None):
        pass


class NoForward(AttentionImpl):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        pass


class HalfBackend(AttentionBackend):
    """Names its builder and impl but has no name and allocates no cache."""

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchAttentionImpl


class PlainBackend:
    """Every method of a backend, but not an AttentionBackend."""

    get_name = staticmethod(TorchAttentionBackend.get_name)
    get_builder_cls = staticmethod(TorchAttentionBackend.get_builder_cls)
    get_impl_cls = staticmethod(TorchAttentionBackend.get_impl_cls)
    allocate_kv_cache = staticmethod(TorchAttentionBackend.allocate_kv_cache)


def test_builder_without_build_cannot_be_made() -> None:
    with pytest.raises(TypeError) as e:
        NoBuild(16, torch.device("cpu"))
    assert str(e.value) == abstract_class_error("NoBuild", ["build"])


def test_impl_without_forward_cannot_be_made() -> None:
    with pytest.raises(TypeError) as e:
        NoForward(4, 8, 1.0, 2)
    assert str(e.value) == abstract_class_error("NoForward", ["forward"])


def test_backend_missing_methods_cannot_be_made() -> None:
    with pytest.raises(TypeError) as e:
        HalfBackend()
    assert str(e.value) == abstract_class_error("HalfBackend", ["allocate_kv_cache", "get_name"])


def test_selecting_an_incomplete_backend_names_what_it_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # backends are never instantiated, so the registry checks them when one is selected
    monkeypatch.setitem(attention._BACKENDS, "half", (__name__, "HalfBackend"))
    with pytest.raises(TypeError) as e:
        get_attn_backend("half")
    assert (
        str(e.value)
        == "attention backend 'half' (HalfBackend) does not implement allocate_kv_cache, get_name"
    )


def test_selecting_a_class_that_is_no_backend_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(attention._BACKENDS, "plain", (__name__, "PlainBackend"))
    with pytest.raises(TypeError) as e:
        get_attn_backend("plain")
    assert (
        str(e.value)
        == "attention backend 'plain' (PlainBackend) does not subclass AttentionBackend"
    )


def test_unknown_backend_names_the_available_ones() -> None:
    with pytest.raises(ValueError) as e:
        get_attn_backend("nope")
    assert str(e.value) == "unknown attention backend 'nope'; available: torch"


def test_engine_args_refuse_an_unknown_backend_before_loading_a_model() -> None:
    # the model path does not exist: reaching the loader would fail with another message
    args = EngineArgs(model="/nonexistent/model", attention_backend="nope")
    with pytest.raises(ValueError) as e:
        args.create_engine_config()
    assert str(e.value) == "attention_backend must be one of torch; got 'nope'."


def test_torch_backend_is_registered_under_its_name() -> None:
    assert available_attn_backends() == ["torch"]
    backend = get_attn_backend("torch")
    assert backend is TorchAttentionBackend
    assert backend.get_name() == "torch"
    assert issubclass(backend.get_builder_cls(), AttentionMetadataBuilder)
    assert issubclass(backend.get_impl_cls(), AttentionImpl)


def test_every_backend_is_registered_under_its_own_name() -> None:
    for name in available_attn_backends():
        assert get_attn_backend(name).get_name() == name


def test_torch_backend_pieces_fit_together() -> None:
    """The ABC-typed pieces of one backend, used as the runner and a layer use them:
    allocate a cache, build one step's metadata, run a forward."""
    backend: type[AttentionBackend] = get_attn_backend("torch")
    kv_cache = tuple(
        c.zero_() for c in backend.allocate_kv_cache(4, 4, 1, 2, torch.float32, torch.device("cpu"))
    )
    assert [tuple(c.shape) for c in kv_cache] == [(4, 4, 1, 2), (4, 4, 1, 2)]
    common = CommonAttentionMetadata(
        num_reqs=1,
        num_actual_tokens=3,
        query_start_loc=torch.tensor([0, 3]),
        seq_lens=torch.tensor([3]),
        block_table=torch.tensor([[1]]),
        slot_mapping=torch.tensor([4, 5, 6]),
        query_start_loc_cpu=[0, 3],
        seq_lens_cpu=[3],
        max_query_len=3,
        max_seq_len=3,
        block_size=4,
    )
    metadata: Any = backend.get_builder_cls()(4, torch.device("cpu")).build(common)
    impl = backend.get_impl_cls()(2, 2, 1.0, 1)
    q = torch.zeros(3, 2, 2)
    k = torch.zeros(3, 1, 2)
    v = torch.arange(6.0).reshape(3, 1, 2)
    out = impl.forward(q, k, v, kv_cache, metadata)
    # equal scores: token t attends evenly to tokens 0..t, the running mean of v
    mean = torch.cumsum(v, 0) / torch.arange(1, 4)[:, None, None]
    torch.testing.assert_close(out, mean.expand(3, 2, 2))
    assert torch.equal(kv_cache[1][1, :3], v)


@pytest.mark.parametrize("window", [None, 6], ids=["whole", "window6"])
def test_row_attention_gives_each_row_the_keys_its_position_sees(window: int | None) -> None:
    """A step with a decode (request 0: its 10th token) and a prompt chunk over a cached
    prefix (request 1: positions 5-7 of 8) becomes one decode per row: the padded row
    starts at the block holding the first key the position sees, and [lo, hi) are those
    keys' slots in it (block size 4)."""
    from pagellm.attention.torch_backend import TorchAttentionMetadataBuilder

    common = CommonAttentionMetadata(
        num_reqs=2,
        num_actual_tokens=4,
        query_start_loc=torch.tensor([0, 1, 4]),
        seq_lens=torch.tensor([10, 8]),
        block_table=torch.tensor([[7, 3, 9], [2, 5, 0]]),
        slot_mapping=torch.tensor([9 * 4 + 1, 5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3]),
        query_start_loc_cpu=[0, 1, 4],
        seq_lens_cpu=[10, 8],
        max_query_len=3,
        max_seq_len=10,
        block_size=4,
    )
    builder = TorchAttentionMetadataBuilder(4, torch.device("cpu"), sliding_window=window)
    rows = builder.build(common).rows
    assert rows is not None
    if window is None:  # keys 0..p: the whole table row, slots [0, p + 1)
        assert rows.block_table.tolist() == [[7, 3, 9], [2, 5, 0], [2, 5, 0], [2, 5, 0]]
        assert rows.slot_lo.tolist() == [0, 0, 0, 0]
        assert rows.slot_hi.tolist() == [10, 6, 7, 8]
        assert rows.max_slots == 10
    else:  # keys p - 5..p: position 9 starts in block 1 (positions 4-7) at slot 0
        # positions 5, 6, 7 see 0-5, 1-6, 2-7, all starting in block 0
        assert rows.block_table.tolist() == [[3, 9], [2, 5], [2, 5], [2, 5]]
        assert rows.slot_lo.tolist() == [0, 0, 1, 2]
        assert rows.slot_hi.tolist() == [6, 6, 7, 8]
        assert rows.max_slots == 6
    # the decode row is the decode batch's own row
    dec = builder.build(common).decode
    assert dec is not None
    assert rows.block_table[0, : dec.block_table.shape[1]].tolist() == dec.block_table[0].tolist()
    assert (rows.slot_lo[0].item(), rows.slot_hi[0].item()) == (dec.slot_lo[0].item(), dec.slot_hi[0].item())
