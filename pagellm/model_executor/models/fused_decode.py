"""A decoder stack (Llama's layer, or a family's that describes itself as one with
extras: `fused_layer()`) run as one C call (`pg_decode_layers`,
pagellm/kernels/decode_step.c) per `max_rows` rows of a step of up to
ROW_ATTENTION_MAX_ROWS rows: the kernels the module path calls one at a time from Python
(~10 calls and their checks per layer), in the same order. On decode-only steps its numbers equal the module path's bit for bit.
A step with prompt chunks attends each prompt row as a decode of its own over the paged
cache (the step's K/V are written first; `RowAttention`), where the module path runs
SDPA per chunk: the same attention up to summation order (1e-5 relative).

In: the loaded LlamaModel (GGUF linears on the CPU kernels, or float32 weights the
kernels read in place; the torch attention backend with its C kernels, a float32,
float16 or bfloat16 cache) and a
step's embeddings, rope tables and forward context.
Out: (last MLP output, residual stream) for the final norm, or None where the step or the
model does not qualify (more than ROW_ATTENTION_MAX_ROWS rows, other kernels): the module
path then runs. It knows the torch backend's cache layout and decode metadata.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.attention.backend import get_forward_context
from pagellm.attention.torch_backend import (
    KV_TYPE_CODES,
    ROW_ATTENTION_MAX_ROWS,
    TorchAttentionImpl,
    TorchAttentionMetadata,
)
from pagellm.kernels import load_kernels
from pagellm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from pagellm.model_executor.layers.linear import Linear, UnquantizedLinearMethod
from pagellm.model_executor.layers.quantization.gguf import (
    BATCHED_MAX_ROWS,
    DIRECT_MAX_ROWS,
    GGUFLinearMethod,
    amx_min_rows,
    int8_gemm_rows,
    int8_rows,
)
from pagellm.model_executor.layers.rotary_embedding import RopeTables

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

MAX_VIEWS = 2
"""Distinct sliding windows one stack serves (PG_MAX_VIEWS: Gemma's sliding and global)."""


@dataclass
class FusedLayer:
    """One decoder layer as the C stack runs it, given by its family (`fused_layer()`):
    the norms around its sub-blocks, its four linears, its attention layer and gate."""

    norm1: Any
    """RMSNorm before attention (adds the residual stream first)."""
    norm2: Any
    """RMSNorm before the MLP (adds the attention block's output first)."""
    qkv: Linear
    o: Linear
    gate_up: Linear | None
    down: Linear | None
    """The MLP's linears (None in a layer with experts)."""
    attn: Any
    """The layer's `Attention` (its impl, scale and sliding window)."""
    act: Any
    q_norm: Any = None
    k_norm: Any = None
    """Per-head norms of q and k before rope (Qwen3, Gemma 3), or None."""
    post_attn: Any = None
    post_ffn: Any = None
    """Norms of the attention and MLP outputs (Gemma), or None."""
    rope: bool = True
    """Whether the layer rotates q and k (pg_layer's rope tables NULL when not)."""
    router: Linear | None = None
    moe: Any = None
    """A layer with experts: its router and FusedMoE (GGUF blocks), in place of the MLP."""

    def norms(self) -> list[Any]:
        return [n for n in (self.norm1, self.norm2, self.q_norm, self.k_norm, self.post_attn,
                            self.post_ffn) if n is not None]


def _act_code(act: Any) -> int | None:
    if isinstance(act, SiluAndMul):
        return 0
    if isinstance(act, GeluAndMul) and act.approximate == "tanh":
        return 1
    return None


class _WeightGroup(ctypes.Structure):  # pg_weight_group
    _fields_ = [("type", _i64), ("row_bytes", _i64), ("row_start", _i64), ("rows", _i64),
                ("data", _ptr), ("block", _i64), ("k_pad", _i64)]  # fmt: skip


class _Linear(ctypes.Structure):  # pg_linear
    _fields_ = [("n_groups", _i64), ("n_in", _i64), ("n_out", _i64),
                ("groups", ctypes.POINTER(_WeightGroup)), ("bias", _ptr)]  # fmt: skip


class _Layer(ctypes.Structure):  # pg_layer
    _fields_ = [("norm1", _ptr), ("norm2", _ptr), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_store", _ptr), ("v_store", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr), ("post_attn", _ptr), ("post_ffn", _ptr),
                ("cos_table", _ptr), ("sin_table", _ptr), ("scale", _f32), ("soft_cap", _f32),
                ("view", _i64),
                ("act", _i64), ("router", _Linear), ("moe_experts", _i64), ("moe_top_k", _i64),
                ("moe_inter", _i64), ("moe_renorm", _i64), ("moe_gate", _WeightGroup),
                ("moe_up", _WeightGroup), ("moe_down", _WeightGroup)]  # fmt: skip


class _View(ctypes.Structure):  # pg_attn_view
    _fields_ = [("table", _ptr), ("lo", _ptr), ("hi", _ptr), ("table_stride", _i64),
                ("max_slots", _i64)]  # fmt: skip


class _Step(ctypes.Structure):  # pg_step
    _fields_ = [
        *[(n, _i64) for n in ("T", "hidden", "H", "KVH", "D", "inter", "NB", "bs", "kv_type",
                              "direct_rows", "n_q8", "int8_levels", "i8_batched", "amx_min_rows")],
        ("eps", _f32),
        *[(n, _ptr) for n in ("positions", "slots", "q8_rows")],
        ("views", _View * MAX_VIEWS),
        *[(n, _ptr) for n in ("moe_logits", "moe_probs", "moe_weights", "moe_x", "moe_y",
                              "moe_ids", "moe_rows", "moe_slots", "moe_q8")],
        *[(n, _ptr) for n in ("normed", "qkv", "attn", "gate_up", "act")],
    ]  # fmt: skip


STRUCTS = (("pg_weight_group", _WeightGroup), ("pg_linear", _Linear), ("pg_layer", _Layer),
           ("pg_attn_view", _View), ("pg_step", _Step))
"""The C structs the stack fills and their ctypes mirrors, in pg_struct_layout's order."""


def check_struct_layouts(lib: ctypes.CDLL, structs: tuple[tuple[str, type], ...] = STRUCTS) -> None:
    """Raises RuntimeError naming the first struct whose ctypes mirror differs from what
    the compiler made of decode_step.c's declaration (its fields' names and order, their
    offsets, the size): filled through a stale mirror, the C stack would read fields at
    the wrong places."""
    out = (ctypes.c_int64 * 64)()
    names_p = ctypes.c_char_p()
    for which, (c_name, mirror) in enumerate(structs):
        n = lib.pg_struct_layout(which, out, len(out), ctypes.byref(names_p))
        c_size, c_offsets = out[0], list(out[1:n])
        c_names = names_p.value.decode().split()
        names = [name for name, _ in mirror._fields_]
        where = f"{mirror.__name__} in models/fused_decode.py does not match {c_name} in kernels/decode_step.c"
        if names != c_names:
            diff = next((i for i, (a, b) in enumerate(zip(c_names, names)) if a != b), min(len(names), len(c_names)))
            c_field = c_names[diff] if diff < len(c_names) else "nothing"
            py_field = names[diff] if diff < len(names) else "nothing"
            raise RuntimeError(f"{where}: field {diff} is {c_field!r} in C, {py_field!r} in Python")
        for name, c_offset in zip(names, c_offsets):
            if getattr(mirror, name).offset != c_offset:
                raise RuntimeError(f"{where}: field {name!r} at offset {c_offset} in C, "
                                   f"{getattr(mirror, name).offset} in Python")
        if ctypes.sizeof(mirror) != c_size:
            raise RuntimeError(f"{where}: {c_size} bytes in C, {ctypes.sizeof(mirror)} in Python")


@functools.cache
def _check_layouts_once(lib: ctypes.CDLL) -> None:
    check_struct_layouts(lib)


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


def _q8_activations(parts: list[FusedLayer]) -> tuple[bool, int]:
    """(whether the model's GGUF linears round decode rows to int8, in how many levels):
    one setting for the whole stack (GGUFConfig)."""
    methods = [m.quant_method for p in parts for m in _linears(p)]
    q8 = {(m.q8_activations, m.int8_levels) for m in methods if isinstance(m, GGUFLinearMethod)}
    assert len(q8) <= 1, "one activation setting per model"
    return q8.pop() if q8 else (False, 1)


def _max_rows(layer: Linear) -> int:
    """Input rows up to which the module path multiplies by `layer` in C: GGUF blocks
    through pg_gemm / pg_gemm_batched, float32 weights through dense_f32.c."""
    if isinstance(layer.quant_method, GGUFLinearMethod):
        return BATCHED_MAX_ROWS
    return layer.dense_f32.max_rows


def _linears(part: FusedLayer) -> tuple[Linear, ...]:
    """The layer's linears (an expert layer's router, not its experts)."""
    return tuple(m for m in (part.qkv, part.o, part.gate_up, part.down, part.router)
                 if m is not None)


def _expert_group(group: Any) -> _WeightGroup:
    """Expert 0's rows of one stacked projection; expert e's follow at e x rows."""
    return _WeightGroup(group.qtype, group.row_bytes, 0, group.rows, group.ptr, 0, 0)


def _moe_fields(part: FusedLayer, keep: list[Any]) -> dict[str, Any]:
    """pg_layer's expert fields for a layer with experts (none for a plain layer)."""
    moe = part.moe
    if moe is None:
        return {}
    (gate, up), (down,) = moe.expert_groups[0]
    return dict(router=_linear(part.router, keep), moe_experts=moe.num_experts,
                moe_top_k=moe.top_k, moe_inter=moe.intermediate_size,
                moe_renorm=int(moe.renormalize), moe_gate=_expert_group(gate),
                moe_up=_expert_group(up), moe_down=_expert_group(down))


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


def _ptr_of(norm: Any) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _qualifies(parts: list[FusedLayer] | None, ropes: list[Any], lib: Any) -> bool:
    """Every layer described (`fused_layer()`), linears the C products take (GGUF blocks,
    or float32 weights the kernels can read), a gate the stack computes, float32 norms of
    one epsilon and rope tables, the torch backend's C attention, at most MAX_VIEWS
    distinct windows."""
    if lib is None or parts is None or any(r.cos_cache.dtype != torch.float32
                                           or r.rotary_dim != r.head_dim for r in ropes):
        return False  # (pg_rope turns whole heads: partial rotary keeps the module path)
    eps = parts[0].norm1.variance_epsilon
    if len({p.attn.sliding_window for p in parts}) > MAX_VIEWS:
        return False
    for p in parts:
        impl = p.attn.impl
        moe = p.moe
        if moe is not None and (not moe.gguf or not moe.expert_groups or p.router is None
                                or not isinstance(p.act, SiluAndMul)):
            return False
        if (
            _act_code(p.act) is None
            or not isinstance(impl, TorchAttentionImpl)
            or impl.kernels is None
            or any(_weight_groups(m) is None for m in _linears(p))
            or any(n.weight.dtype != torch.float32 or n.weight.device.type != "cpu"
                   or not n.weight.is_contiguous() or n.variance_epsilon != eps
                   for n in p.norms())
        ):  # fmt: skip
            return False
    return True


class FusedDecodeStack:
    """The C descriptions of a model's layers (each from its `fused_layer()`), and the
    scratch rows of a step."""

    def __init__(self, model: Any, parts: list[FusedLayer], ropes: list[Any], lib: Any) -> None:
        self.lib = lib
        self.parts = parts
        first = parts[0]
        attn = first.attn
        self.H, self.KVH, self.D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = first.norm1.weight.shape[0]
        self.inter = max(p.moe.intermediate_size if p.moe is not None else p.down.in_features
                         for p in parts)
        """The widest MLP (or expert) of the layers, for the scratch rows."""
        moes = [p.moe for p in parts if p.moe is not None]
        n_experts = max((m.num_experts for m in moes), default=0)
        top_k = max((m.top_k for m in moes), default=0)
        self.eps = first.norm1.variance_epsilon
        self.windows = list(dict.fromkeys(p.attn.sliding_window for p in parts))
        """The distinct sliding windows: layer i attends through view windows.index(w)."""
        self.n_layers = len(parts)
        self._keep: list[Any] = []
        self._layers = (_Layer * self.n_layers)()
        for i, (p, rope) in enumerate(zip(parts, ropes)):
            mlp = ({} if p.moe is not None else
                   dict(gate_up=_linear(p.gate_up, self._keep), down=_linear(p.down, self._keep)))
            self._layers[i] = _Layer(
                norm1=p.norm1.weight.data_ptr(), norm2=p.norm2.weight.data_ptr(),
                qkv=_linear(p.qkv, self._keep), o=_linear(p.o, self._keep), **mlp,
                q_norm=_ptr_of(p.q_norm), k_norm=_ptr_of(p.k_norm),
                post_attn=_ptr_of(p.post_attn), post_ffn=_ptr_of(p.post_ffn),
                cos_table=rope.cos_cache.data_ptr() if p.rope else None,
                sin_table=rope.sin_cache.data_ptr() if p.rope else None,
                scale=p.attn.impl.scale, soft_cap=p.attn.impl.logits_soft_cap or 0.0,
                view=self.windows.index(p.attn.sliding_window),
                act=_act_code(p.act), **_moe_fields(p, self._keep),
            )  # fmt: skip
        self._keep.append(ropes)  # the tables the layers point into
        self._caches: Any = None  # the kv_caches list whose pointers _layers holds
        self.kv_type: int | None = None  # the caches' element type, KV_TYPE_CODES
        self.max_rows = min(_max_rows(m) for p in parts for m in _linears(p))
        """Rows a step may have: as many as every linear's C product takes on the module
        path (above, the module path runs torch's products)."""
        rows = self.max_rows
        widths = {"normed": self.hidden, "qkv": (self.H + 2 * self.KVH) * self.D,
                  "attn": self.H * self.D, "gate_up": 2 * self.inter, "act": self.inter,
                  "moe_logits": n_experts, "moe_probs": n_experts, "moe_weights": top_k,
                  "moe_x": self.hidden if moes else 0, "moe_y": self.hidden if moes else 0}  # fmt: skip
        self._scratch = {n: torch.empty(max(rows * w, 1), dtype=torch.float32)
                         for n, w in widths.items()}
        ints = {"moe_ids": rows * top_k, "moe_rows": rows, "moe_slots": rows, "moe_q8": rows + 2}
        self._scratch.update({n: torch.empty(w, dtype=torch.int64) for n, w in ints.items()})
        self._step = _Step()
        for name, buf in self._scratch.items():
            setattr(self._step, name, buf.data_ptr())
        s = self._step
        s.hidden, s.H, s.KVH, s.D, s.inter = self.hidden, self.H, self.KVH, self.D, self.inter
        self.q8, s.int8_levels = _q8_activations(parts)
        """Whether the step's decode rows multiply int8 activations (int8_rows); the float
        rows then take the batched kernel at any count, as on the module path."""
        s.eps, s.direct_rows = self.eps, 0 if self.q8 else DIRECT_MAX_ROWS
        self.i8 = self.q8 and s.int8_levels == 1 and bool(lib.pg_i8gemm_fast())
        """Whether a step of only decodes, more than Q8_MAX_ROWS of them, rounds them to int8
        too and takes the int8 GEMM (pg_step.i8_batched), as `gguf_matmul` does
        (`int8_gemm_rows`), and steps with prompt rows on AMX where the CPU has it."""
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
        """The stack for `model` (a loaded LlamaModel or subclass), or None where it does
        not apply (a layer without `fused_layer`, or whose `fused_layer()` is None, or
        parts the kernels do not take)."""
        lib = load_kernels()
        if lib is not None:
            _check_layouts_once(lib)
        layers = list(model.layers)
        parts = ([layer.fused_layer() for layer in layers]
                 if all(hasattr(layer, "fused_layer") for layer in layers) else None)
        if parts is not None and any(p is None for p in parts):
            parts = None  # a layer that says it has parts the stack does not run
        ropes = model.layer_ropes()
        return cls(model, parts, ropes, lib) if _qualifies(parts, ropes, lib) else None

    def _bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point each layer at its cache storage (once per cache allocation)."""
        for i, p in enumerate(self.parts):
            k_store, v_store = p.attn.impl.cache_storage(kv_caches[p.attn.layer_idx])
            self._layers[i].k_store = k_store.data_ptr()
            self._layers[i].v_store = v_store.data_ptr()
            self.NB, self.bs = k_store.shape[1], k_store.shape[3]
            self.kv_type = KV_TYPE_CODES.get(k_store.dtype)
            if self.kv_type is not None and not self.lib.pg_paged_decode_ready(self.kv_type, p.attn.impl.head_dim,
                                                                               self.bs):
                self.kv_type = None  # a cache this geometry's C attention does not read
        self._caches = kv_caches

    def _views(self, t: int) -> list[Any] | None:
        """Each window's rows (DecodeBatch or RowAttention) for a step of t rows, or None
        where the step is not one the stack takes."""
        ctx = get_forward_context()
        views = []
        for window in self.windows:
            md = ctx.metadata_for(window)
            if (
                not isinstance(md, TorchAttentionMetadata)
                or not (md.decode_only or md.rows is not None)
                or md.num_actual_tokens != t
                or md.slot_mapping.dtype != torch.int64
                or not md.slot_mapping.is_contiguous()
            ):
                return None
            views.append(md.decode if md.decode_only else md.rows)
        return views

    def run(self, x: torch.Tensor, ropes: list[RopeTables]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [T, hidden] embeddings (overwritten with the last MLP output) -> (x, residual),
        or None where this step takes the module path. `ropes`: each layer's tables of
        the step (the positions are shared). A step of more than `max_rows` rows (up to
        ROW_ATTENTION_MAX_ROWS) runs as consecutive calls of `max_rows` rows: a row's
        linears do not depend on the other rows, and a prompt row's keys from an earlier
        call are in the cache by then, as in a chunked prefill."""
        t = x.shape[0]
        if (
            t > ROW_ATTENTION_MAX_ROWS
            or any(r.kernels is None for r in ropes)
            or x.dtype != torch.float32
            or not x.is_contiguous()
        ):
            return None
        views = self._views(t)
        if views is None:
            return None
        ctx = get_forward_context()
        md = ctx.metadata_for(self.windows[0])
        if ctx.kv_caches is not self._caches:
            self._bind_caches(ctx.kv_caches)
        if self.kv_type is None:  # a cache type the C attention does not read
            return None
        s, width = self._step, x.shape[1]
        s.NB, s.bs, s.kv_type = self.NB, self.bs, self.kv_type
        s.i8_batched = int(self.i8 and int8_gemm_rows(t))  # the runner's decodes, not the
        # metadata's one-token rows (a prompt's last token read alone is a prompt row)
        s.amx_min_rows = amx_min_rows(t)
        for i, rows in enumerate(views):
            s.views[i].max_slots, s.views[i].table_stride = rows.max_slots, rows.block_table.stride(0)
        res = torch.empty_like(x)
        q8_rows = int8_rows(t) if self.q8 else None
        positions = ropes[0].positions
        for a in range(0, t, self.max_rows):
            b = min(t, a + self.max_rows)
            s.T = b - a
            keep = self._bind_q8_rows(q8_rows, a, b)  # noqa: F841 (alive through the call)
            for i, rows in enumerate(views):
                table = rows.block_table
                s.views[i].table = table.data_ptr() + a * table.stride(0) * 8  # int64 rows
                s.views[i].lo = rows.slot_lo.data_ptr() + a * 8
                s.views[i].hi = rows.slot_hi.data_ptr() + a * 8
            s.positions = positions.data_ptr() + a * 8
            s.slots = md.slot_mapping.data_ptr() + a * 8
            if self.lib.pg_decode_layers(self._layers_ptr, self.n_layers, self._step_ptr,
                                         x.data_ptr() + a * width * 4, res.data_ptr() + a * width * 4):
                raise RuntimeError("fused decode step: a kernel failed (type or memory)")
        return x, res
