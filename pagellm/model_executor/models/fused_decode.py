"""A Llama-family decoder stack run as one C call (`pg_decode_layers`,
pagellm/kernels/decode_step.c) per `max_rows` rows of a step of up to
ROW_ATTENTION_MAX_ROWS rows: the kernels the module path calls one at a time from Python
(~10 calls and their checks per layer), in the same order. On decode-only steps its numbers equal the module path's bit for bit.
A step with prompt chunks attends each prompt row as a decode of its own over the paged
cache (the step's K/V are written first; `RowAttention`), where the module path runs
SDPA per chunk: the same attention up to summation order (1e-5 relative).

In: the loaded LlamaModel (GGUF linears on the CPU kernels, or float32 weights the
kernels read in place; the torch attention backend with its C kernels, float32) and a
step's embeddings, rope tables and forward context.
Out: (last MLP output, residual stream) for the final norm, or None where the step or the
model does not qualify (more than ROW_ATTENTION_MAX_ROWS rows, other kernels): the module
path then runs. It knows the torch backend's cache layout and decode metadata.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from pagellm.attention.backend import get_forward_context
from pagellm.attention.torch_backend import (
    ROW_ATTENTION_MAX_ROWS,
    TorchAttentionImpl,
    TorchAttentionMetadata,
)
from pagellm.kernels import load_kernels
from pagellm.model_executor.layers.activation import SiluAndMul
from pagellm.model_executor.layers.linear import Linear, UnquantizedLinearMethod
from pagellm.model_executor.layers.quantization.gguf import (
    BATCHED_MAX_ROWS,
    DIRECT_MAX_ROWS,
    GGUFLinearMethod,
    int8_rows,
)
from pagellm.model_executor.layers.rotary_embedding import RopeTables

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _WeightGroup(ctypes.Structure):  # pg_weight_group
    _fields_ = [("type", _i64), ("row_bytes", _i64), ("row_start", _i64), ("rows", _i64),
                ("data", _ptr), ("block", _i64), ("k_pad", _i64)]  # fmt: skip


class _Linear(ctypes.Structure):  # pg_linear
    _fields_ = [("n_groups", _i64), ("n_in", _i64), ("n_out", _i64),
                ("groups", ctypes.POINTER(_WeightGroup)), ("bias", _ptr)]  # fmt: skip


class _Layer(ctypes.Structure):  # pg_layer
    _fields_ = [("norm1", _ptr), ("norm2", _ptr), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_store", _ptr), ("v_store", _ptr)]  # fmt: skip


class _Step(ctypes.Structure):  # pg_step
    _fields_ = [
        *[(n, _i64) for n in ("T", "hidden", "H", "KVH", "D", "inter", "NB", "bs",
                              "table_stride", "max_slots", "direct_rows", "n_q8",
                              "int8_levels")],
        ("eps", _f32), ("scale", _f32),
        *[(n, _ptr) for n in ("positions", "slots", "table", "lo", "hi", "q8_rows", "cos_table",
                              "sin_table", "normed", "qkv", "attn", "gate_up", "act")],
    ]  # fmt: skip


def _weight_groups(layer: Linear) -> list[Any] | None:
    """The weight as the C products take it: GGUF block groups (float32 or int8
    activations), or one float32 weight (`DenseF32Weight`, plain or oneDNN-packed); None
    otherwise."""
    method = layer.quant_method
    if isinstance(method, GGUFLinearMethod):
        return layer.weight_groups or None
    if isinstance(method, UnquantizedLinearMethod) and layer.dense_f32 is not None:
        return [layer.dense_f32]
    return None


def _q8_activations(model: Any) -> tuple[bool, int]:
    """(whether the model's GGUF linears round decode rows to int8, in how many levels):
    one setting for the whole stack (GGUFConfig)."""
    methods = [m.quant_method for layer in model.layers for m in _linears(layer)]
    q8 = {(m.q8_activations, m.int8_levels) for m in methods if isinstance(m, GGUFLinearMethod)}
    assert len(q8) <= 1, "one activation setting per model"
    return q8.pop() if q8 else (False, 1)


def _max_rows(layer: Linear) -> int:
    """Input rows up to which the module path multiplies by `layer` in C: GGUF blocks
    through pg_gemm / pg_gemm_batched, float32 weights through dense_f32.c."""
    if isinstance(layer.quant_method, GGUFLinearMethod):
        return BATCHED_MAX_ROWS
    return layer.dense_f32.max_rows


def _linears(layer: Any) -> tuple[Linear, ...]:
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


def _linear(layer: Linear, keep: list[Any]) -> _Linear:
    weight_groups = _weight_groups(layer)
    assert weight_groups is not None, "checked by _qualifies"
    groups = (_WeightGroup * len(weight_groups))(*[
        _WeightGroup(g.qtype, g.row_bytes, g.row_start, g.rows, g.ptr, g.block, g.k_pad)
        for g in weight_groups
    ])  # fmt: skip
    keep.append(groups)
    bias = None if layer.bias is None else layer.bias.data_ptr()
    return _Linear(len(groups), layer.in_features, layer.out_features, groups, bias)


def _qualifies(model: Any, lib: Any) -> bool:
    """Linears the C products take (GGUF blocks on float32 activations, or float32 weights
    the kernels can read), no per-head q/k norm, SiLU, float32 norms and rope tables, the
    torch backend's C attention."""
    if lib is None or model.rotary_emb.cos_cache.dtype != torch.float32:
        return False
    eps = model.layers[0].input_layernorm.variance_epsilon
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = _linears(layer)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (
            attn.q_norm is not None
            or not isinstance(mlp.act_fn, SiluAndMul)
            or not isinstance(attn.attn.impl, TorchAttentionImpl)
            or attn.attn.impl.kernels is None
            or any(_weight_groups(m) is None for m in linears)
            or any(n.weight.dtype != torch.float32 or n.weight.device.type != "cpu"
                   or not n.weight.is_contiguous() or n.variance_epsilon != eps for n in norms)
        ):  # fmt: skip
            return False
    return True


class FusedDecodeStack:
    """The C descriptions of a LlamaModel's layers, and the scratch rows of a step."""

    def __init__(self, model: Any, lib: Any) -> None:
        self.lib = lib
        self.model = model
        first = model.layers[0]
        attn = first.self_attn
        self.H, self.KVH, self.D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = first.input_layernorm.weight.shape[0]
        self.inter = first.mlp.down_proj.in_features
        self.eps = first.input_layernorm.variance_epsilon
        self.scale = attn.attn.impl.scale
        self.n_layers = len(model.layers)
        self._keep: list[Any] = []
        self._layers = (_Layer * self.n_layers)()
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            self._layers[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                _linear(a.qkv_proj, self._keep), _linear(a.o_proj, self._keep),
                _linear(m.gate_up_proj, self._keep), _linear(m.down_proj, self._keep),
                None, None,
            )  # fmt: skip
        self._caches: Any = None  # the kv_caches list whose pointers _layers holds
        self.max_rows = min(_max_rows(m) for layer in model.layers for m in _linears(layer))
        """Rows a step may have: as many as every linear's C product takes on the module
        path (above, the module path runs torch's products)."""
        rows = self.max_rows
        widths = {"normed": self.hidden, "qkv": (self.H + 2 * self.KVH) * self.D,
                  "attn": self.H * self.D, "gate_up": 2 * self.inter, "act": self.inter}  # fmt: skip
        self._scratch = {n: torch.empty(rows * w, dtype=torch.float32) for n, w in widths.items()}
        self._step = _Step()
        for name, buf in self._scratch.items():
            setattr(self._step, name, buf.data_ptr())
        s = self._step
        s.hidden, s.H, s.KVH, s.D, s.inter = self.hidden, self.H, self.KVH, self.D, self.inter
        self.q8, s.int8_levels = _q8_activations(model)
        """Whether the step's decode rows multiply int8 activations (int8_rows); the float
        rows then take the batched kernel at any count, as on the module path."""
        s.eps, s.scale, s.direct_rows = self.eps, self.scale, 0 if self.q8 else DIRECT_MAX_ROWS
        s.cos_table = model.rotary_emb.cos_cache.data_ptr()
        s.sin_table = model.rotary_emb.sin_cache.data_ptr()
        self._layers_ptr = ctypes.addressof(self._layers)
        self._step_ptr = ctypes.addressof(self._step)

    def _bind_q8_rows(self, rows: slice | torch.Tensor | None, a: int, b: int) -> Any:
        """Point the step at the int8 rows among rows [a, b) (relative to a); returns the
        index tensor the pointer refers to (None: rows 0 .. n-1, or no rows)."""
        s = self._step
        s.n_q8, s.q8_rows = 0, None
        if rows is None:
            return None
        if isinstance(rows, slice):
            lo, hi = max(rows.start, a), min(rows.stop, b)
            if lo >= hi:
                return None
            if lo == a and hi == b:  # every row of the call
                s.n_q8 = b - a
                return None
            index = torch.arange(lo - a, hi - a, dtype=torch.int64)
        else:
            index = rows[(rows >= a) & (rows < b)].to(torch.int64) - a
        index = index.contiguous()
        s.n_q8, s.q8_rows = index.numel(), index.data_ptr() if index.numel() else None
        return index

    @classmethod
    def build(cls, model: Any) -> FusedDecodeStack | None:
        """The stack for `model` (a loaded LlamaModel), or None where it does not apply."""
        lib = load_kernels()
        return cls(model, lib) if _qualifies(model, lib) else None

    def _bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point each layer at its cache storage (once per cache allocation)."""
        for i, layer in enumerate(self.model.layers):
            k_store, v_store = layer.self_attn.attn.impl._storage(kv_caches[i])
            self._layers[i].k_store = k_store.data_ptr()
            self._layers[i].v_store = v_store.data_ptr()
            self.NB, self.bs = k_store.shape[1], k_store.shape[3]
        self._caches = kv_caches

    def run(self, x: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [T, hidden] embeddings (overwritten with the last MLP output) -> (x, residual),
        or None where this step takes the module path. A step of more than `max_rows`
        rows (up to ROW_ATTENTION_MAX_ROWS) runs as consecutive calls of `max_rows` rows: a row's
        linears do not depend on the other rows, and a prompt row's keys from an earlier
        call are in the cache by then, as in a chunked prefill."""
        md = get_forward_context().attn_metadata
        t = x.shape[0]
        if (
            t > ROW_ATTENTION_MAX_ROWS
            or rope.kernels is None
            or not isinstance(md, TorchAttentionMetadata)
            or not (md.decode_only or md.rows is not None)
            or md.num_actual_tokens != t
            or x.dtype != torch.float32
            or not x.is_contiguous()
            or md.slot_mapping.dtype != torch.int64
            or not md.slot_mapping.is_contiguous()
        ):
            return None
        kv_caches = get_forward_context().kv_caches
        if kv_caches is not self._caches:
            self._bind_caches(kv_caches)
        # a step with prompt chunks attends each row as a decode of its own (RowAttention)
        rows = md.decode if md.decode_only else md.rows
        table, lo, hi = rows.block_table, rows.slot_lo, rows.slot_hi
        s, width = self._step, x.shape[1]
        s.NB, s.bs, s.max_slots, s.table_stride = self.NB, self.bs, rows.max_slots, table.stride(0)
        res = torch.empty_like(x)
        q8_rows = int8_rows(t) if self.q8 else None
        for a in range(0, t, self.max_rows):
            b = min(t, a + self.max_rows)
            s.T = b - a
            keep = self._bind_q8_rows(q8_rows, a, b)  # noqa: F841 (alive through the call)
            s.table = table.data_ptr() + a * table.stride(0) * 8  # int64 rows
            s.lo, s.hi = lo.data_ptr() + a * 8, hi.data_ptr() + a * 8
            s.positions = rope.positions.data_ptr() + a * 8
            s.slots = md.slot_mapping.data_ptr() + a * 8
            if self.lib.pg_decode_layers(self._layers_ptr, self.n_layers, self._step_ptr,
                                         x.data_ptr() + a * width * 4, res.data_ptr() + a * width * 4):
                raise RuntimeError("fused decode step: a kernel failed (type or memory)")
        return x, res
