"""Linear layers and the vocabulary embedding, each computing through a quantization
method (`pagellm.model_executor.layers.quantization`): the layer owns the shapes, its
`quant_method` owns the weights (create, load, process after loading, apply).

`UnquantizedLinearMethod` keeps a weight in the model dtype and, on CPU in float32,
re-lays it out once for oneDNN's matmul; products of a few rows read that same copy
through the C kernels (`DenseF32Weight`). `MergedLinear` fuses several projections of the
same input into one layer so a step runs one product (q|k|v, gate|up); most checkpoints
keep the parts separate and the loader hands each part to `weight_loader` with its shard
index; a tensor stored fused already (Phi-3's qkv_proj, gate_up_proj) comes whole (shard
None) and is cut into the parts' rows here (`split_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import load_kernels
from pagellm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from pagellm.model_executor.parallel_state import SINGLE, current_group
from pagellm.platforms import kernels_for

KERNEL_MAX_ROWS = 8
"""Input rows up to which a CPU float32 linear runs the C kernel on a plain
`DenseF32Weight` (decode steps: the weight is read once, from memory, for all rows)."""

PACKED_KERNEL_MAX_ROWS = 128
"""The same for oneDNN's packed copy, read in place by dense_f32.c where it has L1-chunked
tiles for that layout (`pg_f32_blocked_tiles`; else KERNEL_MAX_ROWS). Up to 4 rows it
streams the weight once; from 5 rows it walks each 64-output block in L1-sized chunks of
k for every 6-row group. All linears of the default model at 64 rows, weights streamed
from memory, 2 AVX-512 cores: 0.41/0.32/1.25/0.62 ms against oneDNN's 0.62/0.43/1.64/0.91
ms (qkv/o/gate_up/down); level at 128 rows, oneDNN ahead from 256."""

SMALL_BATCH_ROWS = 512
"""Below this many rows (tokens), CPU linears compute (W @ x.T).T instead of x @ W.T."""


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's blocked layout for its float32 CPU matmul, or None
    where that kernel does not apply (other devices and dtypes, torch without oneDNN).

    MKL's sgemm behind F.linear re-packs the weight on every call, which costs as much as
    the product itself when only a few rows go through (decode steps), and its speed
    jumps with the row count (T not a multiple of 8 or 16 ran up to 2x slower). Packed
    once at load, all linears of the default model together took, measured on 2 AVX2
    cores: 30 vs 32-40 ms at T=1, 69 vs 71-129 ms at T=31..32, 4.3 vs 5.3 s at T=2048;
    the 49152-row vocabulary head 38 vs 49 ms at T=64. Results equal F.linear's to
    ~1e-6 relative.
    """
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


@dataclass
class DenseF32Weight:
    """A CPU float32 weight [rows, K] as the C kernels read it in place: row-major
    (`block` 0: ggml's float32 type in pg_gemm) or torch's oneDNN-packed copy, column
    blocks of `block` outputs with `k_pad` values each (pagellm/kernels/dense_f32.c).
    It has the fields of a GGUF `WeightGroup`, so the fused decode step takes either."""

    owner: torch.Tensor = field(repr=False)
    """The tensor whose memory `ptr` points into (kept alive here)."""
    ptr: int
    rows: int
    cols: int
    row_bytes: int = 0
    block: int = 0
    k_pad: int = 0
    qtype: int = 0
    row_start: int = 0
    max_rows: int = KERNEL_MAX_ROWS
    """Input rows up to which `UnquantizedLinearMethod` multiplies through this view."""


def dense_f32_weight(weight: torch.Tensor, packed: torch.Tensor | None) -> DenseF32Weight | None:
    """The C kernels' view of a float32 CPU weight (plain, or `packed` from `pack_weight`),
    or None where they do not apply. A packed copy is accepted only after the kernel found
    every value of `weight` where its layout says (the layout is oneDNN's choice, not a
    promise: another CPU or torch may pick another, which is then refused)."""
    lib = kernels_for(weight)
    if lib is None or weight.dtype != torch.float32:
        return None
    weight = weight.detach()
    n, k = weight.shape
    if packed is None:
        if not weight.is_contiguous():
            return None
        return DenseF32Weight(weight, weight.data_ptr(), n, k, row_bytes=4 * k)
    try:
        ptr, nbytes = torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)
    except (AttributeError, RuntimeError):  # a torch without these ops
        return None
    plain = weight.contiguous()
    for block in (64, 48, 32, 24, 16, 8):
        padded_rows = -(-n // block) * block
        if nbytes % (4 * padded_rows):
            continue
        k_pad = nbytes // (4 * padded_rows)
        if k_pad >= k and lib.pg_f32_blocked_matches(ptr, block, k_pad, n, k, plain.data_ptr()):
            tiles = lib.pg_f32_blocked_tiles(block)
            return DenseF32Weight(packed, ptr, n, k, block=block, k_pad=k_pad,
                                  max_rows=PACKED_KERNEL_MAX_ROWS if tiles else KERNEL_MAX_ROWS)
    return None


def dense_f32_matmul(w: DenseF32Weight, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 contiguous -> x @ W.T [M, rows] through the C kernel."""
    lib = load_kernels()
    m, k = x.shape
    if k != w.cols:  # the kernel would read past each row
        raise ValueError(f"linear: input has {k} features, the weight takes {w.cols}")
    y = torch.empty(m, w.rows, dtype=torch.float32)
    if w.block:
        rc = lib.pg_gemm_f32_blocked(w.ptr, w.block, w.k_pad, w.rows, k, x.data_ptr(), k, m,
                                     y.data_ptr(), w.rows)
    else:
        rc = lib.pg_gemm(0, w.ptr, w.row_bytes, w.rows, k, x.data_ptr(), k, m, y.data_ptr(),
                         w.rows)
    if rc:
        raise RuntimeError("float32 linear kernel failed")
    return y


class PostOp(NamedTuple):
    """An elementwise activation applied to a linear's output: in torch (`fn`), or fused
    into oneDNN's product as its post-op `attr` with `algorithm`, which writes the
    activated output in the same pass (`packed_linear`)."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    attr: str
    algorithm: str = ""


GELU = PostOp(F.gelu, "gelu", "none")
GELU_TANH = PostOp(lambda y: F.gelu(y, approximate="tanh"), "gelu", "tanh")
RELU = PostOp(F.relu, "relu")


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
    post_op: PostOp | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias with W from `pack_weight`, then `post_op` in the same pass;
    x [T, in] -> y [T, out] contiguous."""
    if torch.compiler.is_compiling():
        y = _packed_linear_op(x, packed, bias)
        return y if post_op is None else post_op.fn(y)
    attr, algorithm = ("none", "") if post_op is None else (post_op.attr, post_op.algorithm)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, attr, [], algorithm)


@torch.library.custom_op("pagellm::packed_linear", mutates_args=())
def _packed_linear_op(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`packed_linear` as an opaque op for torch.compile: inductor lowers the mkldnn op
    only for weights its own freezing pass packed, and fails on ours."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias for x [T, in] and weight [out, in].

    On CPU with few rows (decode steps), MKL runs the same product 1.3-1.6x faster with
    the weight as the left operand (measured on AVX2 for T = 16..256 and the shapes of
    small Llama models). The result is then a transposed view ([T, out] with strides
    (1, T)); element-wise ops keep that layout and the next linear takes it as a
    contiguous right operand, so nothing is copied.
    """
    if x.dim() == 2 and x.shape[0] < SMALL_BATCH_ROWS and x.device.type == "cpu":
        y = torch.mm(weight, x.t()).t()
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class UnquantizedLinearMethod(QuantizeMethodBase):
    """Weights in the model dtype: `layer.weight` [out, in] (parts stacked by rows), and on
    CPU in float32 its oneDNN-packed form `layer.packed_weight` instead after loading.
    `layer.dense_f32` is the C kernels' view of whichever copy is kept (None where they do
    not apply): up to its `max_rows` rows multiply through it, and the fused decode step
    reads it."""

    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int],
                       bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(sum(output_sizes), in_features), requires_grad=False)
        layer.register_buffer("packed_weight", None, persistent=False)
        layer.dense_f32 = None

    def load_weight(self, layer: nn.Module, shard: int, loaded: Any) -> None:
        start, size = layer.offsets[shard], layer.output_sizes[shard]
        param = layer.weight
        if not isinstance(loaded, torch.Tensor):  # a GGUF block tensor: dequantize it
            loaded = torch.from_numpy(loaded.dequantize())
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shard {shard} of weight: expected rows {size} x {tuple(param.shape[1:])}, "
                f"got {tuple(loaded.shape)}"
            )
        with torch.no_grad():
            param[start : start + size].copy_(loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Swap the loaded weight for its packed form where the CPU kernel applies; the
        plain weight is then dropped (`weight` becomes None), not kept twice."""
        if layer.weight is None:
            return  # already processed
        packed = pack_weight(layer.weight)
        layer.dense_f32 = dense_f32_weight(layer.weight, packed)
        if packed is None:
            return
        layer.packed_weight = packed
        layer.register_parameter("weight", None)

    @staticmethod
    def _takes_c_kernel(layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether x goes through the C kernel (a few float32 rows), else oneDNN or torch."""
        dense = layer.dense_f32
        return (dense is not None and x.dim() == 2 and x.shape[0] <= dense.max_rows
                and x.dtype == torch.float32 and not torch.compiler.is_compiling())

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._takes_c_kernel(layer, x):
            y = dense_f32_matmul(layer.dense_f32, x.contiguous())
            return y if bias is None else y + bias
        if layer.packed_weight is not None:
            return packed_linear(x, layer.packed_weight, bias)
        return linear(x, layer.weight, bias)

    def apply_activated(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                        post_op: PostOp) -> torch.Tensor:
        """post_op(x @ W.T + bias): in oneDNN's pass where it multiplies (many rows)."""
        if layer.packed_weight is not None and not self._takes_c_kernel(layer, x):
            return packed_linear(x, layer.packed_weight, bias, post_op)
        return post_op.fn(self.apply(layer, x, bias))


def take_rows(loaded: Any, start: int, rows: int) -> Any:
    """Rows [start, start + rows) of a checkpoint tensor: a torch view, or for a GGUF block
    tensor `GGUFRows` (still the file's blocks)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(0, start, rows)
    from pagellm.model_executor.layers.quantization.gguf import GGUFRows

    if isinstance(loaded, GGUFRows):  # rows of rows: counted from the tensor's first
        return GGUFRows(loaded.source, loaded.start + start, rows)
    return GGUFRows(loaded, start, rows)


def take_cols(loaded: Any, start: int, cols: int) -> Any:
    """Columns [start, start + cols) of a checkpoint tensor: a torch view, or for a GGUF
    block tensor `GGUFCols` (whole blocks of each row: the cut must fall on a block's
    edge)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(1, start, cols)
    from pagellm.model_executor.layers.quantization.gguf import GGUFCols

    return GGUFCols(loaded, start, cols)


def split_rows(loaded: Any, sizes: list[int], name: str = "") -> list[Any]:
    """A checkpoint tensor of a whole fused layer [sum(sizes), ...] cut into its parts'
    rows, in order: torch views, or for a GGUF block tensor `GGUFRows` (a block never
    spans two rows, so the parts keep the file's blocks; nothing is dequantized)."""
    rows = int(loaded.shape[0])
    if rows != sum(sizes):
        raise ValueError(f"{name or 'linear'}: a fused tensor of {rows} rows; the parts "
                         f"{sizes} take {sum(sizes)}")
    if isinstance(loaded, torch.Tensor):
        return list(loaded.split(sizes))
    from pagellm.model_executor.layers.quantization.gguf import GGUFRows

    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [GGUFRows(loaded, start, size) for start, size in zip(starts, sizes)]


class Linear(nn.Module):
    """y = x @ W.T (+ b) for W [out, in], kept and multiplied by `quant_method`.

    Under tensor parallelism (`parallel_state.building_with`) a layer built with `parallel`
    keeps its rank's shard, cut from the checkpoint's whole tensors as they load:
    'column' the rank's even share of each part's output rows (q|k|v and gate|up cut per
    part), 'row' its share of the input columns, the ranks' partial products summed
    (the bias added once), 'vocab' its share of the rows in parts of ceil(out / size)
    (the logits head: `compute_logits` gathers the ranks' columns). None: the whole
    weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_sizes: list[int] | None = None, parallel: str | None = None) -> None:
        super().__init__()
        if parallel not in (None, "column", "row", "vocab"):
            raise ValueError(f"linear parallel must be column, row or vocab; got {parallel!r}")
        full_sizes = list(output_sizes or [out_features])
        tp = current_group() if parallel is not None else SINGLE
        self.tp = tp
        """The group this layer's shard belongs to (SINGLE: the whole weight)."""
        self.parallel = parallel if tp.size > 1 else None
        self.full_output_sizes = full_sizes
        self.full_in_features = in_features
        self.row_shards = [(0, s) for s in full_sizes]
        """Each part's (first row, rows) of the checkpoint's tensor that this rank keeps."""
        self.col_shard = (0, in_features)
        """The checkpoint's input columns this rank keeps."""
        if self.parallel == "column":
            self.row_shards = [tp.shard(s, f"{prefix or 'linear'} output rows") for s in full_sizes]
        elif self.parallel == "vocab":
            self.row_shards = [tp.uneven_shard(out_features)]
        elif self.parallel == "row":
            self.col_shard = tp.shard(in_features, f"{prefix or 'linear'} input columns")
        in_features = self.col_shard[1]
        self.in_features = in_features
        self.output_sizes = [n for _, n in self.row_shards]
        """Rows of each part the checkpoint stores separately (one for a plain linear), as
        this rank keeps them."""
        self.out_features = out_features = sum(self.output_sizes)
        self.prefix = prefix
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method: QuantizeMethodBase = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, self.output_sizes, bias)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param_name: str, shard: int | None, loaded: Any) -> None:
        """Checkpoint tensor `loaded` into part `shard` of `param_name` ('weight' or 'bias');
        shard None: a tensor of the whole layer, which fills every part. Under tensor
        parallelism the tensor is the checkpoint's whole part, cut here to this rank's."""
        if shard is None:
            if len(self.output_sizes) > 1:
                for i, part in enumerate(split_rows(loaded, self.full_output_sizes, self.prefix)):
                    self.weight_loader(param_name, i, part)
                return
            shard = 0
        if self.parallel is not None and param_name in ("weight", "bias"):
            loaded = self._own_shard(param_name, shard, loaded)
        if param_name == "weight":
            self.quant_method.load_weight(self, shard, loaded)
            return
        start, size = self.offsets[shard], self.output_sizes[shard]
        if param_name != "bias" or self.bias is None or tuple(loaded.shape) != (size,):
            raise ValueError(
                f"{self.prefix or 'linear'}.{param_name} (part {shard}): unexpected tensor of "
                f"shape {tuple(loaded.shape)}"
            )
        with torch.no_grad():
            self.bias[start : start + size].copy_(loaded)

    def _own_shard(self, param_name: str, shard: int, loaded: Any) -> Any:
        """This rank's piece of a whole checkpoint part (checked against the whole's shape
        first, so a wrong tensor is named as the checkpoint has it)."""
        full = self.full_output_sizes[shard]
        expected = (full,) if param_name == "bias" else (full, self.full_in_features)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{self.prefix or 'linear'}.{param_name} (part {shard}): expected "
                             f"{list(expected)}, got {list(loaded.shape)}")
        if self.parallel == "row":
            return loaded if param_name == "bias" else take_cols(loaded, *self.col_shard)
        return take_rows(loaded, *self.row_shards[shard])

    def expected_weights(self) -> list[str]:
        """Names (relative to the layer) the loader must fill: one per part and parameter."""
        names = ["weight" if len(self.output_sizes) == 1 else f"weight#{i}"
                 for i in range(len(self.output_sizes))]
        if self.bias is not None:
            names += ["bias" if len(self.output_sizes) == 1 else f"bias#{i}"
                      for i in range(len(self.output_sizes))]
        return names

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel != "row":
            return self.quant_method.apply(self, x, self.bias)
        # the ranks' partial sums over their input columns, added up; the bias once
        y = self.quant_method.apply(self, x, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(y)

    def forward_activated(self, x: torch.Tensor, post_op: PostOp) -> torch.Tensor:
        """post_op(forward(x)), fused into the product where the method can."""
        fused = getattr(self.quant_method, "apply_activated", None)
        if fused is None:
            return post_op.fn(self.forward(x))
        return fused(self, x, self.bias, post_op)

    def forward_gated(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """act(gate) * up of this gate|up projection ([T, 2I] -> [T, I]), with `act` a
        gated activation (layers/activation.py): applied inside the product where the
        method can (GGUF on AMX tiles: no [T, 2I] result written and read back), else
        act.forward(forward(x))."""
        fused = getattr(self.quant_method, "apply_gated", None)
        y = fused(self, x, act) if fused is not None and self.bias is None else None
        return y if y is not None else act.forward(self.forward(x))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"method={type(self.quant_method).__name__}")


class MergedLinear(Linear):
    """y = x @ W.T (+ b) where W stacks the parts' weights along the output rows:

    rows [0, s0)            part 0 (e.g. q_proj)
    rows [s0, s0 + s1)      part 1 (e.g. k_proj)
    ...
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 parallel: str | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias, quant_config, prefix, output_sizes,
                         parallel)


class UnquantizedEmbeddingMethod:
    """A [vocab, hidden] table in the model dtype; rows looked up by token id."""

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int) -> None:
        layer.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def load_weight(self, layer: nn.Module, loaded: Any) -> None:
        if not isinstance(loaded, torch.Tensor):  # a GGUF block tensor: dequantize it
            loaded = torch.from_numpy(loaded.dequantize())
        if loaded.shape != layer.weight.shape:
            raise ValueError(
                f"expected shape {tuple(layer.weight.shape)}, got {tuple(loaded.shape)}"
            )
        with torch.no_grad():
            layer.weight.copy_(loaded)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)

    def tie_head(self, layer: nn.Module, head: Linear) -> None:
        """Make `head` (an unquantized Linear) multiply by this table, shared, not copied."""
        head.weight = layer.weight
        head.process_weights_after_loading()


class Embedding(nn.Module):
    """Token embedding table [num_embeddings, embedding_dim] kept by `quant_method`.

    `vocab_parallel` under tensor parallelism (`parallel_state.building_with`): each rank
    keeps rows [vocab_start, vocab_start + num_embeddings) of the table (parts of ceil(vocab /
    size)), looks up the ids that fall there, zeros for the rest, and the ranks' rows are
    summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 vocab_parallel: bool = False) -> None:
        super().__init__()
        self.tp = current_group() if vocab_parallel else SINGLE
        self.full_num_embeddings = num_embeddings
        self.vocab_start, num_embeddings = self.tp.uneven_shard(num_embeddings)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method: Any = method or UnquantizedEmbeddingMethod()
        self.quant_method.create_weights(self, num_embeddings, embedding_dim)

    def weight_loader(self, param_name: str, shard: int, loaded: Any) -> None:
        if self.tp.size > 1:
            if tuple(loaded.shape) != (self.full_num_embeddings, self.embedding_dim):
                raise ValueError(f"expected shape {(self.full_num_embeddings, self.embedding_dim)}, "
                                 f"got {tuple(loaded.shape)}")
            loaded = take_rows(loaded, self.vocab_start, self.num_embeddings)
        self.quant_method.load_weight(self, loaded)

    def expected_weights(self) -> list[str]:
        return ["weight"]

    def tie_head(self, head: Linear) -> None:
        self.quant_method.tie_head(self, head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.quant_method.embedding(self, ids)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.full_num_embeddings:
            raise IndexError(f"index out of range in self (token ids must be < {self.full_num_embeddings})")
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = self.quant_method.embedding(self, local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))
