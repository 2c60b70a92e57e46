"""GGUF weights kept quantized: linears and the embedding multiply the file's blocks
directly through the CPU kernels in `pagellm/kernels/ggml_cpu.c`.

Storage. A weight used as it is (o_proj, down_proj, the embedding, an untied head) stays
a view of the memory-mapped file. A fused layer (q|k|v, gate|up) gets one owned copy of
its parts' rows, read from the file (the llama q/k row order restored: whole quantized
rows move, nothing becomes float); parts of different types (Q4_K_M mixes Q4_K and Q6_K)
stay separate groups, each multiplied into its own column range of the output. A layer
the file stores fused (Phi-3's attn_qkv, ffn_up) comes as row ranges of one tensor
(`GGUFRows`), which together stay a view of the file. A type with no kernel is
dequantized to float32 at load, with one log line naming the tensor.

Shapes. Up to `DIRECT_MAX_ROWS` rows (decode steps) the kernel reads each weight row
once and dots it with every input row (memory-bound: the weight's bytes are the cost).
Up to `BATCHED_MAX_ROWS` (batched decode) `ggml_gemm.c` dequantizes a few weight rows at
a time into a cache-resident buffer and multiplies them against all rows there. More rows
(prefill) are compute-bound enough that a 16 MiB tile of weight rows is dequantized into
a float32 scratch buffer and multiplied by torch's matmul (oneDNN's blocking wins there).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn

from pagellm.kernels import load_kernels
from pagellm.logger import init_logger
from pagellm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from pagellm.utils import cdiv, libc_madvise

logger = init_logger(__name__)

DIRECT_MAX_ROWS = 16
"""Input rows up to which the direct kernel runs (float32 activations); above, dequantized
tiles + matmul. Its sums of a row do not depend on the row count (ggml_cpu.c dot1/dot2),
so a step of up to 16 rows (decodes, or a verify run of speculative decoding) gives each
row the numbers it gets alone."""

BATCHED_MAX_ROWS = 256
"""Input rows up to which `pg_gemm_batched` runs; above, dequantized tiles + matmul."""

HEAD_INT8_LEVELS = 2
"""The logits head rounds its activations in two int8 levels: x ~ d1 q1 + d2 q2, q2 the
rounded residual (an error ~1/250 of one level's). The head decides the next token from
logits whose top two are often close; one level there changed the default model's first
token of its README answer ("The capital of France is Paris." -> "L'Étoile, la Cité, ...").
A second level costs one more int8 pass over the head's rows (each weight row unpacked
once for both): on the default model (a Q8_0 head of 49152 x 576, 2 threads) 0.98 ms
against 0.68 ms for one level, 3-5% of its decode step. Where its weights are in a 16-row
layout (AVX-512 VNNI), the second level goes only to the 16-row blocks of the weights that
can hold a row's top logit (_head_product, kernels/ggml_q8.c pg_head_q8): the other logits
keep the first level (llama.cpp's one), within a bound of the two-level ones, so each row's
top logit and its token are the two-level product's. On the default model's head with its
inputs from real text, a row's second level reaches 130-450 of its 3072 blocks; 2 threads
on an AMD EPYC, 64 rows 7.4-8.3 ms against 10.8-11.0 ms for two levels everywhere, 16 rows
2.0-2.2 against 2.8, 8 rows 1.0 against 1.4 (weights in cache), 1 row 0.41 against 0.36 (a
row alone gets the numbers it gets in a batch). From AMX_MIN_ROWS rows, where the
CPU has AMX-BF16, the head runs on AMX tiles in bfloat16 instead (GGUFLinearMethod.apply):
the default model's head at 64 rows 7.7 ms against 30.9 ms in float32 tiles (one thread).
Where the CPU has AVX-512 VNNI but no AMX, the head takes its two int8 levels at any row
count (the int8 decode kernels, whose sums of a row do not depend on the row count), not
float32 past Q8_MAX_ROWS. 2 threads on an AMD EPYC (AVX-512), 17 / 33 / 64 rows: the
default model's Q8_0 head (49152 x 576) 6.8 / 12.3 / 13.8 ms against 19.0 / 27.4 / 25.0 ms
in float32; the 1B-shaped file's Q6_K head (x 2048) 14.8 / 28.7 / 57.0 against 40.5 / 63.0 /
78.7; the 8B-shaped file's (x 4096) 63 / 115 / 110 against 169 / 230 / 268."""

Q8_MAX_ROWS = 16
"""Most rows of one product that multiply int8 activations in the decode kernels (the q8
path): a step's decode rows, or a logits head's rows (a head of any count where the CPU has
AVX-512 VNNI and no AMX: HEAD_INT8_LEVELS). Past it a decode-only step takes the
int8 GEMM where the CPU has AVX-512 VNNI (ggml_i8gemm.c), else float32, where the batched
float kernels are faster than the decode kernels (benchmarks/kernel_shapes.py)."""

AMX_MIN_ROWS = Q8_MAX_ROWS + 1
"""Rows of a step of decodes from which its int8 GEMM products run on AMX tiles in bfloat16
instead, where the CPU has AMX-BF16 (kernels/amx_gemm.c): x and the dequantized weights
rounded to bfloat16 (relative error <= 2^-9 each, less than one int8 level of x), summed in
float32. That is every decode-only step past the decode kernels' rows: with the weights
repacked sixteen rows at a time the tiles beat the int8 GEMM from 17 rows on (whole
decode steps, ms, AMX from 17 against from 32 rows: default model 17 rows 19.1 / 24.7, 24
rows 20.8 / 28.3, 28 rows 21.8 / 31.0; 1B-shaped file 17 rows 107 / 125, 24 rows 113 / 154;
8B-shaped file 17 rows 678 / 727, 24 rows 686 / 886). It was 32 until then (the 1B shapes
before the repack: 32 rows 0.7x the int8 GEMM's time, 64 rows 0.5x, 512 rows 0.3-0.4x).
The logits head of this many rows takes the tiles too. A step with prompt rows takes AMX
at any row count (`amx_min_rows`)."""

SCRATCH_VALUES = 1 << 22
"""float32 values in the dequantization scratch tile (16 MiB)."""

F32_TYPE = 0


@dataclass(eq=False)  # compared by identity: its data is an array
class WeightGroup:
    """Consecutive output rows [row_start, row_start + rows) stored as one block matrix."""

    qtype: int
    data: np.ndarray  # uint8 [rows, row_bytes]
    row_start: int
    rows: int
    block = k_pad = 0  # whole rows, not column blocks (see linear.DenseF32Weight)

    def __post_init__(self) -> None:
        self.row_bytes = self.data.shape[1]
        self.ptr = self.data.ctypes.data  # read once: a ctypes lookup per call costs ~1 us


ACTIVATIONS = ("float32", "q8", "q8x2")
"""Resolved activation paths (quantization.resolve_gguf_activations picks one)."""

INT8_LEVELS = {"float32": 1, "q8": 1, "q8x2": 2}
"""int8 levels of a decoder layer's int8 rows per path: q8 rounds once (llama.cpp's
scheme), q8x2 also rounds what the first level left (x ~ d1 q1 + d2 q2), which gives the
exact path's greedy tokens on real text at 0.6-0.8x q8's decode speed (benchmarks/README.md)."""

_logged_activations: set[str] = set()


class GGUFConfig(QuantizationConfig):
    """Linears and the embedding of a GGUF file keep the file's block types.
    `activations` "q8" (the default where the CPU has the kernels: EngineArgs.
    gguf_activations) rounds decode-sized inputs to int8 per 32 values and multiplies in
    integers, as llama.cpp does; "float32" is the exact path."""

    @classmethod
    def from_model_config(cls, model_config: Any) -> GGUFConfig:
        from pagellm.model_executor.layers.quantization import resolve_gguf_activations

        return cls(resolve_gguf_activations(getattr(model_config, "gguf_activations", "auto")))

    def __init__(self, activations: str = "float32") -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"GGUF activations {activations!r}: choose one of {', '.join(ACTIVATIONS)}")
        self.activations = activations
        if activations not in _logged_activations:  # once per process and path
            _logged_activations.add(activations)
            if activations == "float32":
                logger.info("GGUF linears: float32 activations (the exact path)")
            else:
                lib = load_kernels()
                prompt = (f"prompt chunks over {BATCHED_MAX_ROWS} rows and steps of more "
                          "decodes int8 too (AVX-512 VNNI GEMM), shorter prompt chunks float32"
                          if activations == "q8" and lib is not None and lib.pg_i8gemm_fast()
                          else "prompt rows float32")
                if activations == "q8" and lib is not None and lib.pg_amx_ready():
                    prompt = (f"prompt rows, and steps of more decodes from {AMX_MIN_ROWS}, on AMX "
                              "tiles in bfloat16 (PAGELLM_AMX=0: the int8 GEMM for prompt chunks "
                              f"over {BATCHED_MAX_ROWS} rows and steps of more decodes, shorter "
                              "prompt chunks float32)")
                logger.info("GGUF linears: decode rows (up to %d a step) multiply activations "
                            "rounded to int8 in %s (%s), the head's in two; %s; "
                            "gguf_activations='float32' (PAGELLM_GGUF_ACTIVATIONS=float32) for "
                            "the exact path", Q8_MAX_ROWS,
                            "one level" if activations == "q8" else "two levels",
                            "llama.cpp's scheme" if activations == "q8" else "q8x2", prompt)

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Any:
        from pagellm.model_executor.layers.linear import Embedding, Linear

        if isinstance(layer, Linear):
            # the head's int8 activations in two levels (HEAD_INT8_LEVELS)
            levels = HEAD_INT8_LEVELS if prefix == "lm_head" else INT8_LEVELS[self.activations]
            q8 = self.activations != "float32"
            return GGUFLinearMethod(q8_activations=q8, int8_levels=levels, repack=q8 and repack_weights(),
                                    head=prefix == "lm_head")
        if isinstance(layer, Embedding):
            return GGUFEmbeddingMethod()
        return None


def _kernels() -> Any:
    lib = load_kernels()
    if lib is None:
        raise RuntimeError(
            "the GGUF CPU kernels are not available (no C compiler, or the build failed: "
            "see the log); run with quantization='none' to dequantize at load"
        )
    return lib


_logged_fallbacks: set[tuple[str, int]] = set()


def _as_block_matrix(layer_name: str, loaded: Any, rows: int, cols: int) -> tuple[int, Any]:
    """(ggml type, GGUFTensor or float32 array) for one checkpoint part, checked against
    the expected [rows, cols]; types without a kernel become float32 here."""
    shape = tuple(loaded.shape)
    if shape != (rows, cols):
        raise ValueError(f"{layer_name}: expected a [{rows}, {cols}] weight, got {list(shape)}")
    if isinstance(loaded, torch.Tensor):
        return F32_TYPE, loaded.detach().to(torch.float32).contiguous().numpy()
    if not _kernels().pg_type_supported(loaded.qtype):
        if (loaded.path, loaded.qtype) not in _logged_fallbacks:  # one line per file and type
            _logged_fallbacks.add((loaded.path, loaded.qtype))
            logger.info("%s: no CPU kernel for %s; its tensors (first: %s) are dequantized to "
                        "float32 at load", loaded.path, loaded.type_name, loaded.name)
        return F32_TYPE, loaded.dequantize()
    return loaded.qtype, loaded


class GGUFRows:
    """Rows [start, start + rows) of a GGUF block tensor (weight_utils.GGUFTensor, rows in
    HF order): one part of a layer the file stores fused, still in the file's blocks
    (`linear.split_rows`). It answers what the linear methods ask of a GGUFTensor."""

    def __init__(self, source: Any, start: int, rows: int) -> None:
        self.source, self.start, self.rows = source, start, rows
        self.path, self.name = source.path, source.name
        self.qtype, self.type_name = source.qtype, source.type_name
        self.cols, self.row_bytes = source.cols, source.row_bytes
        stop = start + rows
        self.row_order = None if source.row_order is None else source.row_order[start:stop]
        self.data: np.ndarray | None = source.data[start:stop] if self.row_order is None else None
        """The rows as a view of the mapping (None where llama's q/k order was undone:
        then the file's rows are not consecutive)."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def read_rows(self) -> np.ndarray:
        """The rows as an owned [rows, row_bytes] uint8 array, read from the file."""
        if self.row_order is not None:
            return self.source.read_rows()[self.start : self.start + self.rows]
        raw = np.empty((self.rows, self.row_bytes), dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.source.file_offset + self.start * self.row_bytes)
            if f.readinto(memoryview(raw).cast("B")) != raw.nbytes:
                raise ValueError(f"{self.path}: tensor {self.name!r} is cut short (truncated file?)")
        return raw

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols] (gguf's reference dequantization of the whole tensor)."""
        return np.array(self.source.dequantize()[self.start : self.start + self.rows], copy=True)


class GGUFCols:
    """Columns [start, start + cols) of every row of a GGUF block tensor (a GGUFTensor or
    GGUFRows): a row-parallel linear's shard under tensor parallelism. The cut falls on
    the type's block edges, so each row keeps whole blocks of the file; the rows are copied
    out of the mapping (a row's kept bytes are not contiguous across rows)."""

    def __init__(self, source: Any, start: int, cols: int) -> None:
        import gguf

        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(source.qtype)]
        if start % block or cols % block:
            raise ValueError(f"{source.name}: columns [{start}, {start + cols}) of {source.type_name} "
                             f"do not fall on its blocks of {block} values")
        self.source, self.start, self.cols = source, start, cols
        self.path, self.name = source.path, source.name
        self.qtype, self.type_name = source.qtype, source.type_name
        self.rows = source.shape[0]
        self.row_bytes = cols // block * block_bytes
        self.row_order = None
        first = start // block * block_bytes
        rows = source.data if source.row_order is None and source.data is not None else source.read_rows()
        self.data = np.ascontiguousarray(rows[:, first : first + self.row_bytes])
        """The columns of every row, an owned copy (file row order undone already)."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def read_rows(self) -> np.ndarray:
        return self.data

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols]."""
        return np.array(self.source.dequantize()[:, self.start : self.start + self.cols], copy=True)


def _whole_source(members: list[Any]) -> np.ndarray | None:
    """The mapping's rows of `members` where they are consecutive row ranges of one
    tensor in file order (a layer the file stores fused), else None."""
    if not all(isinstance(p, GGUFRows) and p.data is not None for p in members):
        return None
    first = members[0]
    for a, b in zip(members, members[1:]):
        if b.source is not first.source or b.start != a.start + a.rows:
            return None
    return first.source.data[first.start : members[-1].start + members[-1].rows]


def _owned_rows(part: Any) -> np.ndarray:
    """uint8 [rows, row_bytes] owned rows of one part (a GGUFTensor or a float32 array)."""
    if isinstance(part, np.ndarray):
        return np.ascontiguousarray(part, dtype=np.float32).view(np.uint8)
    return part.read_rows()


class GGUFLinearMethod(QuantizeMethodBase):
    """y = x @ W.T with W in GGUF blocks (`layer.weight_groups`); `repack`: Q4_K, Q4_0, Q4_1
    and Q8_0 groups repacked after loading (repack_weights)."""

    def __init__(self, q8_activations: bool = False, int8_levels: int = 1, repack: bool = False,
                 head: bool = False) -> None:
        self.q8_activations = q8_activations
        self.int8_levels = int8_levels
        self.repack = repack
        self.head = head  # the logits head: AMX from AMX_MIN_ROWS rows (apply)

    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int],
                       bias: bool) -> None:
        layer.loaded_parts = [None] * len(output_sizes)
        layer.weight_groups = []

    def load_weight(self, layer: nn.Module, shard: int, loaded: Any) -> None:
        name = f"{layer.prefix or 'linear'} (part {shard})"
        layer.loaded_parts[shard] = _as_block_matrix(
            name, loaded, layer.output_sizes[shard], layer.in_features)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = layer.loaded_parts
        if not parts or any(p is None for p in parts):
            return  # already processed (or a tied head filled by the embedding)
        groups: list[WeightGroup] = []
        shard = 0
        while shard < len(parts):
            qtype = parts[shard][0]
            end = shard
            while end + 1 < len(parts) and parts[end + 1][0] == qtype:
                end += 1
            members = [p for _, p in parts[shard : end + 1]]
            if len(members) == 1 or _whole_source(members) is not None:
                runs = [(shard, end)]
            else:  # separate tensors (gate, up): a group each, views of the mapping; rows
                # that must be owned anyway (llama's reordered q, k) one copy together,
                # rather than copying the whole layer (2 GB of an 8B file at load)
                runs = []
                for i in range(shard, end + 1):
                    if runs and not _mapped(parts[i][1]) and not _mapped(parts[runs[-1][1]][1]):
                        runs[-1] = (runs[-1][0], i)
                    else:
                        runs.append((i, i))
            for a, b in runs:
                groups.append(WeightGroup(qtype, _group_data([p for _, p in parts[a : b + 1]]),
                                          layer.offsets[a], sum(layer.output_sizes[a : b + 1])))
            shard = end + 1
        if self.repack:
            groups = [_repacked(g, layer.in_features) for g in groups]
        layer.weight_groups = groups
        layer.loaded_parts = []
        self.prepare_head(layer)

    def prepare_head(self, layer: nn.Module) -> None:
        """`layer.head_bounds`: for a head in two int8 levels whose groups are all in a
        16-row layout (repacked where the CPU has AVX-512 VNNI), each group's bound per
        block of 16 rows and 32 inputs (pg_head_bounds), which lets `apply` take the second
        level only where it can change a row's top logit (_head_product); else None."""
        layer.head_bounds = None
        k = layer.in_features
        if not (self.head and self.q8_activations and self.int8_levels == 2 and self.repack
                and k % 32 == 0 and layer.weight_groups):
            return
        lib = _kernels()
        if lib.pg_q8_isa() != 2 or any(g.qtype not in ROWS16_TYPES or g.rows % 16
                                       for g in layer.weight_groups):
            return
        bounds = []
        for g in layer.weight_groups:
            b = torch.empty(k // 32, g.rows // 16, dtype=torch.float32)
            if lib.pg_head_bounds(g.qtype, g.ptr, g.row_bytes, g.rows, k, b.data_ptr()):
                return
            bounds.append(b)
        layer.head_bounds = bounds

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if (self.head and self.q8_activations and x.shape[0] >= AMX_MIN_ROWS
                and x.shape[1] % 32 == 0 and (lib := _kernels()).pg_amx_ready()):
            # the logits head of many rows (a batched decode step, a prompt's logprobs): on
            # AMX tiles in bfloat16 rather than float32 tiles (~4x faster at 64 rows; the
            # head's rows up to Q8_MAX_ROWS keep their two int8 levels)
            x = x.to(torch.float32).contiguous()
            y, rest = _amx_product(lib, layer.weight_groups, x, layer.out_features)
            if rest:
                y = _float_product(lib, rest, x, layer.out_features, DIRECT_MAX_ROWS, y)
        elif self.q8_activations:  # float32 rows take the batched kernel at any count
            rows = int8_rows(x.shape[0])
            if rows is None and self.head and _kernels().pg_q8_isa() == 2:
                rows = slice(0, x.shape[0])  # every row in two int8 levels (HEAD_INT8_LEVELS)
            y = None
            if (getattr(layer, "head_bounds", None) is not None and isinstance(rows, slice)
                    and (rows.start, rows.stop) == (0, x.shape[0])):
                y = _head_product(_kernels(), layer.weight_groups, layer.head_bounds, x,
                                  layer.out_features)
            if y is None:
                y = gguf_matmul(layer.weight_groups, x, layer.out_features, rows,
                                float_direct_rows=0, int8_levels=self.int8_levels,
                                int8_prompt=self.int8_levels == 1)
        else:
            y = gguf_matmul(layer.weight_groups, x, layer.out_features)
        return y if bias is None else y + bias

    def apply_gated(self, layer: nn.Module, x: torch.Tensor, act: nn.Module) -> torch.Tensor | None:
        """act(gate) * up for a gate|up layer in one AMX pass (pg_gemm_amx_gated), where
        `apply` would take the AMX kernel for every row (the products' numbers are the
        same, and so are the activation's: the unfused C pass's code); None elsewhere."""
        m, k = x.shape
        code, half = getattr(act, "c_act", None), layer.out_features // 2
        if (not self.q8_activations or self.int8_levels != 1 or code is None or act.kernels is None
                or x.dtype != torch.float32 or m < amx_min_rows(m) or k % 32 or not int8_gemm_rows(m)
                or int8_rows(m) is not None or not (lib := _kernels()).pg_amx_ready()):
            return None
        gate, up = _rows_view(layer.weight_groups, 0, half), _rows_view(layer.weight_groups, half, half)
        if gate is None or up is None:
            return None
        x = x.contiguous()
        y = torch.empty(m, half, dtype=torch.float32)
        if lib.pg_gemm_amx_gated(gate[0], gate[1], gate[2], up[0], up[1], up[2], half, k,
                                 x.data_ptr(), k, m, code, y.data_ptr(), half):
            return None  # a type the AMX kernel does not take
        return y


K_R16_TYPES = {12: (113, 148), 13: (115, 180), 14: (114, 210)}
"""Q4_K, Q5_K and Q6_K rows repacked sixteen at a time (pagellm/kernels/ggml_common.h
PG_Q4_K_R16, PG_Q5_K_R16, PG_Q6_K_R16): the file's type -> (pagellm's layout, its bytes per
256 values: the file's with Q4_K's and Q5_K's 6-bit scales unpacked). Not ggml types; the
kernels read them wherever they read the file's type."""
Q4_K_R16_TYPE, Q5_K_R16_TYPE, Q6_K_R16_TYPE = (K_R16_TYPES[t][0] for t in (12, 13, 14))

R16_TYPES = {2: 102, 3: 103, 8: 108}
"""Q4_0, Q4_1 and Q8_0 rows repacked sixteen at a time (ggml_common.h PG_Q4_0_R16 ...): the
file's type -> pagellm's layout, read by the kernels wherever they read the file's type."""

ROWS16_TYPES = frozenset(R16_TYPES.values()) | {t for t, _ in K_R16_TYPES.values()}
"""pagellm's 16-row layouts (ggml_common.h pg_rows16)."""

TYPE_NAMES = {Q4_K_R16_TYPE: "Q4_K_R16", Q5_K_R16_TYPE: "Q5_K_R16", Q6_K_R16_TYPE: "Q6_K_R16",
              **{r16: f"{gguf.GGMLQuantizationType(t).name}_R16" for t, r16 in R16_TYPES.items()}}
"""Names of pagellm's own layouts (the rest are gguf.GGMLQuantizationType's)."""


def repack_weights() -> bool:
    """Whether GGUF linears are repacked at load for the int8 decode kernels (Q4_K, Q5_K,
    Q6_K, Q4_0, Q4_1 and Q8_0 as their 16-row layouts): where those kernels run on AVX-512 VNNI. A
    block of sixteen rows is then the int8 GEMM's tile after an AND and a shift, multiplied
    by each input row with no per-row scale permutes: each extra row of a step (a
    speculative verify run, a batch) costs a fraction of what it did (benchmarks/README.md).
    PAGELLM_GGUF_REPACK=0 keeps the file's layout."""
    from pagellm import envs

    lib = load_kernels()
    return envs.PAGELLM_GGUF_REPACK and lib is not None and lib.pg_q8_isa() == 2


def _repacked(group: WeightGroup, k: int) -> WeightGroup:
    """A Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 or Q8_0 group in its 16-row layout, in memory of
    its own or read from the repack cache of the file (RepackCache; other groups, and
    groups whose rows do not fill the layout's, as they are); the file's pages it was read
    from are released from this process (the page cache keeps them), so memory stays ~ the
    file's."""
    if group.qtype in K_R16_TYPES and group.rows % 16 == 0 and k % 256 == 0:
        qtype, sb_bytes = K_R16_TYPES[group.qtype]
        shape = (group.rows, sb_bytes * (k // 256))
    elif group.qtype in R16_TYPES and group.rows % 16 == 0 and k % 32 == 0:
        qtype, shape = R16_TYPES[group.qtype], group.data.shape
    else:
        return group
    cache = RepackCache.active
    out = cache.take(group, k, qtype, shape) if cache is not None else None
    if out is None:
        out = cache.buffer(shape) if cache is not None else np.empty(shape, dtype=np.uint8)
        lib = _kernels()
        repack = lib.pg_repack_k_r16 if group.qtype in K_R16_TYPES else lib.pg_repack_r16
        if repack(group.qtype if group.qtype in K_R16_TYPES else qtype, group.ptr, group.row_bytes,
                  group.rows, k, out.ctypes.data):
            return group
    _release_mapped(group.data)
    return WeightGroup(qtype, out, group.row_start, group.rows)


class RepackCache:
    """A GGUF file's repacked groups kept on disk (`<cache>/gguf/<key>/repacked-*.bin`,
    named by its index, `repacked.json`), so that a later load maps them instead of repacking: the
    8B-shaped Q4_K_M file's load went from 2.6-5.4 s to ~0.5 s (benchmarks/README.md),
    and engine cores that load the same file (data parallel ranks) share those pages.

    Entries follow the order of the load's `_repacked` calls, each checked against its
    source (type, rows, row bytes, K, first row, a checksum of its first and last rows' bytes)
    and its layout; the key of the directory holds the file's path, size and modification
    time, and the index the kernels' build key (`kernels.build_key`: the layouts are the C
    code's), so a changed file or kernel never reads a stale layout. A miss makes every
    group's layout in a memfd that a writer process (repack_writer.py) copies to a new file
    once the load ends, then swaps the index to it: the load does not wait for the disk, a
    process mapping the old file keeps reading it, and one process writes at a time.
    PAGELLM_GGUF_CACHE=0 turns it off with the rest of the GGUF cache."""

    active: RepackCache | None = None
    """The cache of the load under way (`open`), read by `_repacked`."""

    FORMAT = 2

    WRITER_MIN_BYTES = 256 << 20
    """Repacked bytes from which a writer process writes the cache; below, the load does,
    in a fraction of a second (the default model's 0.1 GB)."""

    def __init__(self, directory: str):
        import json
        import os

        from pagellm.kernels import build_key

        self.directory = directory
        self.index_file = os.path.join(directory, "repacked.json")
        self.bin: str | None = None
        self.build = build_key()
        self.entries: list[dict[str, Any]] = []
        self.mapping: Any = None
        self.calls: list[tuple[dict[str, Any], Any]] = []
        self.missed = False
        self.memfd: int | None = None
        self.size = 0
        """Bytes of the memfd the misses' layouts are made in (`buffer`)."""
        try:
            with open(self.index_file) as f:
                index = json.load(f)
            entries = index["entries"]
            if (index["format"] == self.FORMAT and index["build"] == self.build
                    and isinstance(index["file"], str) and isinstance(entries, list)
                    and all(isinstance(e, dict) and isinstance(e.get("offset"), int)
                            and e["offset"] >= 0 for e in entries)):
                self.bin = os.path.join(directory, os.path.basename(index["file"]))
                self.entries = entries
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.entries = []  # no index, or not one this version wrote: a miss

    @staticmethod
    def _map(path: str) -> Any:
        """The file mapped read-only (its pages faulted in at once where Linux can)."""
        import mmap

        with open(path, "rb") as f:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            return mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)

    @classmethod
    @contextlib.contextmanager
    def open(cls, directory: str | None) -> Iterator[RepackCache | None]:
        """Makes the cache in `directory` active for the load in the block (None: no
        cache) and writes what it missed at the end."""
        cache = cls(directory) if directory is not None else None
        cls.active = cache
        try:
            yield cache
        finally:
            cls.active = None
        if cache is not None:
            cache.commit()

    def take(self, group: WeightGroup, k: int, qtype: int, shape: tuple[int, ...]) -> np.ndarray | None:
        """The cached layout of the load's next repacked group, or None (a miss)."""
        import zlib

        rows = np.asarray(group.data)  # [rows, row bytes]: its first and last row's bytes
        sample = zlib.crc32(rows[-1].tobytes(), zlib.crc32(rows[0].tobytes()))
        entry = {"source": [group.qtype, group.rows, group.row_bytes, k, group.row_start, sample],
                 "type": qtype, "shape": list(shape)}
        i = len(self.calls)
        if not self.missed and self.bin is not None and i < len(self.entries):
            cached = self.entries[i]
            try:
                if self.mapping is None:  # mapped at the first group that may use it
                    self.mapping = self._map(self.bin)
                n = int(np.prod(shape))
                if ({key: cached.get(key) for key in entry} == entry
                        and cached["offset"] + n <= len(self.mapping)):
                    out = np.frombuffer(self.mapping, np.uint8, n, cached["offset"]).reshape(shape)
                    self.calls.append((entry, out))
                    return out
            except (OSError, ValueError, TypeError, KeyError):
                pass  # a missing or short file: a miss
        if not self.missed:  # the groups mapped so far go to the new file too
            for hit, out in self.calls:
                placed = self._place(hit, out.shape)
                if placed is not None:
                    placed[...] = out
        self.missed = True
        self.calls.append((entry, None))
        return None

    def buffer(self, shape: tuple[int, ...]) -> np.ndarray:
        """Memory for the layout of the load's last miss (`_place`), else np.empty (then
        nothing is cached)."""
        entry = self.calls[-1][0]
        out = self._place(entry, shape)
        if out is None:
            out = np.empty(shape, dtype=np.uint8)
        self.calls[-1] = (entry, out)
        return out

    def _place(self, entry: dict[str, Any], shape: tuple[int, ...]) -> np.ndarray | None:
        """The next page-aligned part of a memfd (anonymous shared memory, where Linux has
        them) for a group, its offset noted in `entry`: the writer process copies the memfd
        to the cache file as it stands. None where there is no memfd."""
        import mmap
        import os

        if self.memfd is None and hasattr(os, "memfd_create"):
            try:
                self.memfd = os.memfd_create("pagellm-repacked")
            except OSError:
                self.memfd = -1
        if self.memfd is None or self.memfd < 0:
            return None
        n = int(np.prod(shape))
        offset = -(-self.size // mmap.PAGESIZE) * mmap.PAGESIZE
        os.ftruncate(self.memfd, offset + n)
        self.size = offset + n
        entry["offset"] = offset
        return np.frombuffer(mmap.mmap(self.memfd, n, offset=offset), np.uint8).reshape(shape)

    def commit(self) -> None:
        """Where any group of this load was missed, hand every group to a writer process
        (repack_writer.py, `writers`) that copies them to a new cache file and replaces the
        index: the load goes on at once, and the write outlives this process (an 8B file's
        4.4 GB takes ~12 s here once the kernel's limit of dirty pages is reached). Under
        WRITER_MIN_BYTES the load writes them itself."""
        import json
        import os
        import subprocess
        import sys

        fd, self.memfd = self.memfd, None
        try:
            if not (self.missed or len(self.calls) != len(self.entries)) or not self.calls:
                return
            if fd is None or fd < 0 or any(out is None or entry.get("offset") is None
                                           for entry, out in self.calls):
                return  # no memfd, or a repack failed: nothing complete to keep
            job = {"fd": fd, "directory": self.directory, "build": self.build,
                   "format": self.FORMAT, "bytes": self.size,
                   "entries": [entry for entry, _ in self.calls]}
            if self.size < self.WRITER_MIN_BYTES:  # the page cache takes it at once
                from pagellm.model_executor.layers.quantization import repack_writer

                repack_writer.write(job)
                return
            writer = subprocess.Popen(
                [sys.executable, os.path.join(os.path.dirname(__file__), "repack_writer.py")],
                stdin=subprocess.PIPE, pass_fds=(fd,), start_new_session=True,
                stdout=subprocess.DEVNULL, text=True)
            RepackCache.writers.append(writer)
            assert writer.stdin is not None
            writer.stdin.write(json.dumps(job))
            writer.stdin.close()
            logger.info("Caching %d repacked weight groups (%.1f GB) in %s (a writer process)",
                        len(self.calls), self.size / 1e9, self.directory)
        except OSError as e:
            logger.warning("Could not cache repacked weights in %s: %s", self.directory, e)
        finally:
            if fd is not None and fd >= 0:
                os.close(fd)  # the mappings keep the memory

    writers: list[Any] = []
    """Writer processes this process started (`wait` waits for them)."""

    @classmethod
    def wait(cls) -> None:
        """Returns once the writer processes this process started have ended."""
        while cls.writers:
            cls.writers.pop().wait()


def _release_mapped(data: np.ndarray) -> None:
    """Drop this process's mapping of the whole pages under `data` where it is a view of a
    file mapping (MADV_DONTNEED: a later read maps them again from the page cache)."""
    import mmap

    base = data
    while base is not None and not isinstance(base, (np.memmap, mmap.mmap)):
        base = getattr(base, "base", None)
    if base is None:
        return
    page = mmap.PAGESIZE
    start = cdiv(data.ctypes.data, page) * page
    end = (data.ctypes.data + data.nbytes) // page * page
    madvise = libc_madvise()
    if end > start and madvise is not None:
        madvise(start, end - start, mmap.MADV_DONTNEED)


def int8_rows(m: int) -> slice | torch.Tensor | None:
    """The rows of an m-row product that multiply int8 activations in the decode kernels
    (pg_gemm_q8) on the q8 path. In a model step: the step's decodes (one new token of a
    running request); prompt rows take float32, the int8 GEMM or AMX (`int8_gemm_rows`),
    so that neither kind of row's numbers depend on what else the step holds. Outside a step (the logits head, direct calls): every row. None where there are
    none or more than Q8_MAX_ROWS (then the int8 GEMM or float32, `int8_gemm_rows`)."""
    from pagellm.attention.backend import current_forward_context

    ctx = current_forward_context()
    rows = slice(0, m) if ctx is None else ctx.decode_rows
    if rows is None:
        return None
    return rows if 0 < _count(rows) <= Q8_MAX_ROWS else None


def int8_gemm_rows(m: int) -> bool:
    """Whether the rows of an m-row product on the q8 path that are not int8 decode rows
    take the int8 GEMM (where the CPU has AVX-512 VNNI) rather than float32: a long prompt
    chunk (more than BATCHED_MAX_ROWS rows: 1.5-2x faster at 1B shapes, held to the q8
    quality bounds, tests/model_executor/test_q8_quality.py), a step of decodes only
    (more than Q8_MAX_ROWS of them; a batched decode step 1.2-2.1x faster), or, where the
    CPU has AMX-BF16, any step with prompt rows: those products then run on AMX tiles in
    bfloat16 (`amx_min_rows`), 2.5-6x faster than float32 at 1-256 rows (1B-shaped file).
    Without AMX shorter prompt chunks (a chat turn) stay float32: their last row's logits
    pick the reply's first token, where one int8 level flips near-ties (the default model
    answers "What is the capital of France?" with "L'Étoile, ..." from an int8 prompt, "The
    capital of France is Paris." from a float32 or a bfloat16 one). Either way a prompt
    row's numbers do not depend on the step's row count, so a prompt gives the same tokens
    alone, batched, or after a prefix-cache hit (tests/entrypoints/test_llm.py). Measured and
    left: a few prompt rows alone through the int8 decode kernels in two levels, faster
    than AMX up to ~8 rows (1B-shaped file, one row: 34 against 86 ms; 8B-shaped 191
    against 554), but their numbers are not AMX's, so a prompt read alone and the same
    prompt batched, or its tail after a prefix-cache hit, gave different tokens."""
    if m > BATCHED_MAX_ROWS:
        return True
    prompt = _holds_prompt_rows(m)
    if prompt is None:
        return False
    return (not prompt and m > Q8_MAX_ROWS) or (prompt and _kernels().pg_amx_ready() != 0)


def amx_min_rows(m: int) -> int:
    """Rows of an m-row product from which its int8 GEMM products run on AMX tiles instead
    (where the CPU has AMX-BF16): AMX_MIN_ROWS for a step of decodes (or a product outside
    a step), 1 for a step with prompt rows, whose other choice is float32."""
    return 1 if _holds_prompt_rows(m) else AMX_MIN_ROWS


def _holds_prompt_rows(m: int) -> bool | None:
    """Whether an m-row product of a model step holds rows that are not the step's decodes
    (prompt rows); None outside a step."""
    from pagellm.attention.backend import current_forward_context

    ctx = current_forward_context()
    if ctx is None:
        return None
    rows = ctx.decode_rows
    return rows is None or _count(rows) < m


def _count(rows: slice | torch.Tensor) -> int:
    """How many rows a step's row selection (a slice or an index tensor) holds."""
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def _rows_view(groups: list[WeightGroup], start: int, rows: int) -> tuple[int, int, int] | None:
    """(type, pointer, row bytes) of output rows [start, start + rows) where one group
    holds them from a whole bundle of its 16-row layout, else None."""
    for g in groups:
        if g.row_start <= start and start + rows <= g.row_start + g.rows and (start - g.row_start) % 16 == 0:
            return g.qtype, g.ptr + (start - g.row_start) * g.row_bytes, g.row_bytes
    return None


def _mapped(part: Any) -> bool:
    """Whether a part's rows are a view of the file's mapping in order (not a float32
    array, not llama's reordered q/k rows)."""
    return not isinstance(part, np.ndarray) and part.row_order is None


def _group_data(members: list[Any]) -> np.ndarray:
    """One block matrix for parts of one type: a single part used as it is, or
    consecutive rows of one fused tensor, stay the file's mapping; several (or
    reordered) rows become one owned copy."""
    whole = _whole_source(members)
    if whole is not None:
        return whole
    if len(members) == 1:
        part = members[0]
        if isinstance(part, np.ndarray):
            return part.view(np.uint8)
        if part.row_order is None:
            return part.data
        return part.read_rows()
    return np.concatenate([_owned_rows(p) for p in members])


_scratch = threading.local()


def _scratch_tile(values: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < values:
        buf = _scratch.buf = torch.empty(values, dtype=torch.float32)
    return buf[:values]


def gguf_matmul(groups: list[WeightGroup], x: torch.Tensor, n_out: int,
                q8_rows: slice | torch.Tensor | None = None,
                float_direct_rows: int = DIRECT_MAX_ROWS, int8_levels: int = 1,
                int8_prompt: bool = False) -> torch.Tensor:
    """x [M, K] float32 -> x @ W.T [M, n_out] for W given as block-matrix groups.
    `q8_rows` (see int8_rows) multiply int8-rounded activations where a
    group's type has a q8 kernel (ggml_q8.c); other rows and groups keep float32, through
    the direct kernel up to `float_direct_rows` rows, else the batched one. The q8 path
    gives 0: pg_gemm_batched's sums do not depend on the row count, so a prompt's float
    rows get the same numbers whatever else its step holds (the direct kernel's differ in
    rounding, which int8 rounding downstream could turn into a different token).
    `int8_levels` 2 rounds the int8 rows in two levels (HEAD_INT8_LEVELS).
    `int8_prompt`: where `int8_gemm_rows(m)` (a prompt chunk longer than BATCHED_MAX_ROWS,
    or more than Q8_MAX_ROWS decodes alone in a step) the other rows are rounded to int8 too
    and multiplied in the int8 GEMM (ggml_i8gemm.c), where the CPU has its AVX-512 VNNI
    kernel; the one-region step does the same for its decode-only steps
    (pg_step.i8_batched)."""
    lib = _kernels()
    if x.dtype != torch.float32:
        raise TypeError(f"GGUF linears compute in float32, got {x.dtype} activations")
    x = x.contiguous()
    m, k = x.shape
    q8_groups = ([g for g in groups if lib.pg_q8_supported(g.qtype)]
                 if q8_rows is not None and k % 32 == 0 else [])  # fmt: skip
    every = bool(q8_groups) and isinstance(q8_rows, slice) and (q8_rows.start, q8_rows.stop) == (0, m)
    float_groups = [g for g in groups if g not in q8_groups] if every else groups
    y = None
    if int8_prompt and k % 32 == 0 and int8_gemm_rows(m) and lib.pg_i8gemm_fast():
        y, float_groups = _int8_prompt_product(lib, float_groups, x, n_out)
    if float_groups:
        y = _float_product(lib, float_groups, x, n_out, float_direct_rows, y)
    if not q8_groups:
        return y
    # every row: the q8 groups' columns of y; some rows: those rows again, into a scratch
    # result whose q8 columns then replace theirs
    xq = x if every else x[q8_rows]
    qx, dx, sx = _quantize_q8(lib, xq, int8_levels)
    out = y if every and y is not None else torch.empty(xq.shape[0], n_out, dtype=torch.float32)
    for g in q8_groups:
        if lib.pg_gemm_q8(g.qtype, g.ptr, g.row_bytes, g.rows, k, qx.data_ptr(), dx.data_ptr(),
                          sx.data_ptr(), xq.shape[0], int8_levels, out.data_ptr() + 4 * g.row_start,
                          n_out):
            raise RuntimeError(f"GGUF q8 kernel failed for type {g.qtype}")
    if every:
        return out
    for g in q8_groups:
        cols = slice(g.row_start, g.row_start + g.rows)
        y[q8_rows, cols] = out[:, cols]
    return y


def _head_product(lib: Any, groups: list[WeightGroup], bounds: list[torch.Tensor],
                  x: torch.Tensor, n_out: int) -> torch.Tensor | None:
    """The logits head's x @ W.T with x in two int8 levels where they can change a row's
    top logit, else one (pg_head_q8): each row's top logit and its token are the two-level
    product's (HEAD_INT8_LEVELS), the logits that cannot be it are llama.cpp's one level.
    None where the kernel is not there (pg_q8_wide 0)."""
    if x.dtype != torch.float32 or x.shape[0] == 0:
        return None
    x = x.contiguous()
    m, k = x.shape
    qx, dx, sx = _quantize_q8(lib, x, 2)
    y = torch.empty(m, n_out, dtype=torch.float32)
    for g, b in zip(groups, bounds, strict=True):
        rc = lib.pg_head_q8(g.qtype, g.ptr, g.row_bytes, g.rows, k, qx.data_ptr(), dx.data_ptr(),
                            sx.data_ptr(), m, b.data_ptr(), y.data_ptr() + 4 * g.row_start, n_out,
                            None)
        if rc == -1:
            return None
        if rc:
            raise MemoryError("the logits head's int8 kernel ran out of memory")
    return y


def _int8_prompt_product(lib: Any, groups: list[WeightGroup], x: torch.Tensor,
                         n_out: int) -> tuple[torch.Tensor, list[WeightGroup]]:
    """x @ W.T with x rounded to int8 (one level) for the groups the int8 GEMM takes, into
    their columns of a new result; returns it and the groups left for float32. From
    AMX_MIN_ROWS rows, where the CPU has AMX-BF16, the same groups take the AMX kernel
    instead (x and the weights in bfloat16, amx_gemm.c), at any count for a step with prompt
    rows (`amx_min_rows`)."""
    m, k = x.shape
    if m >= amx_min_rows(m) and lib.pg_amx_ready():
        return _amx_product(lib, groups, x, n_out)
    y = torch.empty(m, n_out, dtype=torch.float32)
    qx, dx, sx = _quantize_q8(lib, x)
    rest = []
    for g in groups:
        if not lib.pg_i8gemm_supported(g.qtype):
            rest.append(g)
        elif lib.pg_gemm_i8(g.qtype, g.ptr, g.row_bytes, g.rows, k, qx.data_ptr(), dx.data_ptr(),
                            sx.data_ptr(), m, y.data_ptr() + 4 * g.row_start, n_out):
            raise RuntimeError(f"GGUF int8 GEMM failed for type {g.qtype}")
    return y, rest


def _amx_product(lib: Any, groups: list[WeightGroup], x: torch.Tensor,
                 n_out: int) -> tuple[torch.Tensor, list[WeightGroup]]:
    """x @ W.T on AMX tiles in bfloat16 (kernels/amx_gemm.c) for the groups it takes, into
    their columns of a new result; returns it and the groups left for float32."""
    m, k = x.shape
    y = torch.empty(m, n_out, dtype=torch.float32)
    rest = []
    for g in groups:
        if not lib.pg_i8gemm_supported(g.qtype):
            rest.append(g)
        elif lib.pg_gemm_amx(g.qtype, g.ptr, g.row_bytes, g.rows, k, x.data_ptr(), k, m,
                             y.data_ptr() + 4 * g.row_start, n_out):
            raise RuntimeError(f"GGUF AMX kernel failed for type {g.qtype}")
    return y, rest


def _float_product(lib: Any, groups: list[WeightGroup], x: torch.Tensor, n_out: int,
                   direct_rows: int, y: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T on float32 activations for `groups`, into their columns of `y` (a new
    result when None; its other columns are left as they are)."""
    m, k = x.shape
    if m <= BATCHED_MAX_ROWS:  # one kernel call per group, into its columns of y
        y = torch.empty(m, n_out, dtype=torch.float32) if y is None else y
        gemm = lib.pg_gemm if m <= direct_rows else lib.pg_gemm_batched
        x_ptr, y_ptr = x.data_ptr(), y.data_ptr()
        for g in groups:
            if gemm(g.qtype, g.ptr, g.row_bytes, g.rows, k, x_ptr, k, m, y_ptr + 4 * g.row_start, n_out):
                raise RuntimeError(f"GGUF kernel failed for type {g.qtype}")
        return y
    # Compute-bound: tiles of dequantized rows, each multiplied by oneDNN's float32
    # product (fed a plain weight it is within ~20% of a pre-packed one; MKL's sgemm is
    # ~2x slower here), written into the tile's columns of y.
    tile_rows = max(1, SCRATCH_VALUES // k)
    y = None
    for g in groups:
        for r0 in range(0, g.rows, tile_rows):
            rows = min(tile_rows, g.rows - r0)
            tile = _scratch_tile(rows * k)
            lib.pg_dequant_rows(g.qtype, g.ptr, g.row_bytes, k, None, r0, rows,
                                tile.data_ptr())
            part = _dense_matmul(x, tile.view(rows, k))
            if rows == n_out and y is None:
                return part
            if y is None:
                y = torch.empty(m, n_out, dtype=torch.float32)
            start = g.row_start + r0
            y[:, start : start + rows] = part
    return y


def _quantize_q8(lib: Any, x: torch.Tensor, levels: int = 1) -> tuple[torch.Tensor, ...]:
    """x [M, K] -> (int8 values [M * levels, K], scales [M * levels, K/32], sums per 16
    [M * levels, K/16]): row m * levels + l is level l of x[m] (ggml_q8.c)."""
    m, k = x.shape
    qx = torch.empty(m * levels, k, dtype=torch.int8)
    dx = torch.empty(m * levels, k // 32, dtype=torch.float32)
    sx = torch.empty(m * levels, k // 16, dtype=torch.int32)
    lib.pg_quantize_q8(x.data_ptr(), k, m, k, levels, qx.data_ptr(), dx.data_ptr(), sx.data_ptr())
    return qx, dx, sx


def _dense_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return torch.mm(x, w.t())


class GGUFEmbeddingMethod:
    """The token table in GGUF blocks; looked-up rows are dequantized on the fly."""

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int) -> None:
        layer.weight_groups = []

    def load_weight(self, layer: nn.Module, loaded: Any) -> None:
        name = layer.prefix or "embedding"
        qtype, part = _as_block_matrix(name, loaded, layer.num_embeddings, layer.embedding_dim)
        layer.weight_groups = [WeightGroup(qtype, _group_data([part]), 0, layer.num_embeddings)]

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        (g,) = layer.weight_groups
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < layer.num_embeddings:
            # the C lookup does not check bounds; F.embedding's error, for the same input
            raise IndexError(f"index out of range in self (token ids must be < {layer.num_embeddings})")
        out = torch.empty(*ids.shape, layer.embedding_dim, dtype=torch.float32)
        _kernels().pg_dequant_rows(g.qtype, g.ptr, g.row_bytes, layer.embedding_dim,
                                   ids.data_ptr(), 0, ids.numel(), out.data_ptr())
        return out

    def tie_head(self, layer: nn.Module, head: nn.Module) -> None:
        """The head multiplies by the same blocks (shared, not copied); where the head's
        kernels take a repacked layout, both read the repacked rows."""
        if not isinstance(head.quant_method, GGUFLinearMethod):
            raise TypeError("a GGUF embedding can only be tied to a GGUF head")
        if head.quant_method.repack:  # lookups read the repacked rows too (pg_dequant_rows)
            layer.weight_groups = [_repacked(g, layer.embedding_dim) for g in layer.weight_groups]
        head.weight_groups = list(layer.weight_groups)
        head.loaded_parts = []
        head.quant_method.prepare_head(head)
