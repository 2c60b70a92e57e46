"""Rotary position embedding (NeoX/Hugging Face "rotate half" layout) with the rope
scalings the supported families use: default, linear, llama3 and Phi-3's longrope, plus
per-frequency divisors as llama.cpp stores them (a GGUF's `rope_freqs` tensor, e.g.
Llama 3.1), and partial rotary (`partial_rotary_factor`: only the first dims of each
head turn, Phi-4-mini).

Reads rope settings from either transformers 5 (`config.rope_parameters`) or the older
`rope_theta` / `rope_scaling` attributes. cos/sin are precomputed per position in float32.
float32 heads on the CPU are rotated in place by one C pass over q and k together
(`pg_rope`, pagellm/kernels/layer_ops.c); `rotate_torch` is the composition it replaces,
and what partial rotary runs (the C pass turns whole heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.config.arch_config import context_length, rope_dict
from pagellm.platforms import platform_of

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass
class RopeTables:
    """One step's rope inputs (`RotaryEmbedding.tables`), made once per forward and read
    by every layer: the step's positions and the whole per-position tables, with the
    rows of those positions picked out only when a layer takes the torch path."""

    positions: torch.Tensor
    """[T] int64, contiguous, each below the tables' max_position."""
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    """[max_position, R] each (`RotaryEmbedding._compute_tables`; R the rotary dims,
    the head dim D unless rotary is partial)."""
    dtype: torch.dtype
    """The activations' dtype."""
    kernels: Any
    """pagellm's C kernels where this step can use them (float32 tables on the CPU), else
    None."""
    _rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of the step's positions, each [T, 1, R] in `dtype`."""
        if self._rows is None:
            cos = self.cos_cache.index_select(0, self.positions).to(self.dtype)
            sin = self.sin_cache.index_select(0, self.positions).to(self.dtype)
            self._rows = cos[:, None, :], sin[:, None, :]
        return self._rows


@dataclass(frozen=True)
class RopeParams:
    theta: float
    rope_type: str
    scaling: dict[str, Any]
    """The full rope dict (factor, low_freq_factor, ...) for scaled types; empty otherwise."""
    freq_factors: tuple[float, ...] | None = None
    """Divisor of each inverse frequency (config `rope_freq_factors`, from a GGUF's
    `rope_freqs` tensor, where llama.cpp's converter bakes llama3 scaling)."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dims that rotate (the first int(D * factor)); the rest pass
    through unchanged (Phi-4-mini: 0.75)."""


def get_rope_params(config: Any) -> RopeParams:
    """Normalise old (rope_theta/rope_scaling) and new (rope_parameters) config styles."""
    params = rope_dict(config)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("su", "yarn") and "long_factor" in params:
        rope_type = "longrope"  # older Phi-3 configs' names for it (as transformers reads them)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    factors = getattr(config, "rope_freq_factors", None)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    scaling = _longrope_scaling(config, params) if rope_type == "longrope" else params
    return RopeParams(
        float(theta),
        rope_type,
        scaling if rope_type != "default" else {},
        tuple(float(f) for f in factors) if factors is not None else None,
        float(partial) if partial is not None else 1.0,
    )


def _longrope_scaling(config: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The longrope dict with what transformers derives filled in: the pre-training
    length `original_max_position_embeddings` (Phi-3 configs keep it beside the rope
    dict), `factor` = max_position_embeddings / that length where not given, and the
    cos/sin multiplier `attention_factor` = sqrt(1 + ln(factor) / ln(original)) (1 for
    factor <= 1) where not given (transformers' _compute_longrope_parameters)."""
    original = (params.get("original_max_position_embeddings")
                or getattr(config, "original_max_position_embeddings", None)
                or config.max_position_embeddings)  # fmt: skip
    factor = params.get("factor") or config.max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {**params, "original_max_position_embeddings": int(original), "factor": factor,
            "attention_factor": float(attention)}


def compute_inv_freq(rotary_dim: int, rope: RopeParams) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in float32, scaled per rope type."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != rotary_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(rope.freq_factors)} entries; expected "
                f"{rotary_dim // 2} (head_dim / 2)"
            )
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.scaling["factor"]
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope.scaling)
    if rope.rope_type == "longrope":
        return longrope_inv_freqs(rotary_dim, rope)[0]
    return inv_freq


def longrope_inv_freqs(rotary_dim: int, rope: RopeParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(short, long) inverse frequencies [rotary_dim / 2] of LongRoPE: the plain ones, each
    divided by its entry of `short_factor` / `long_factor` (transformers' expression, for
    the same float32 values)."""
    out = []
    for key in ("short_factor", "long_factor"):
        factors = rope.scaling[key]
        if len(factors) != rotary_dim // 2:
            raise ValueError(f"longrope {key} has {len(factors)} entries; expected "
                             f"{rotary_dim // 2} (rotary dims / 2)")
        ext = torch.tensor(factors, dtype=torch.float32)
        shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        out.append(1.0 / (ext * rope.theta**shape))
    return out[0], out[1]


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are divided by `factor`, short ones kept, and
    the band between them interpolated smoothly."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rope tables for `max_position` positions, shared by all layers of a model.

    `tables(positions)` runs once per forward and picks the rows of the step's tokens;
    each layer then rotates its q and k heads together with `rotate`.

    LongRoPE: positions below `original_max_position_embeddings` take the short factors,
    later ones the long factors (vLLM's split, both in one table), all times the
    attention factor. transformers instead picks one set for the whole sequence: short
    while the sequence fits in the original length, long for every position (its cache
    recomputed) once it is longer. Both agree up to that length; past it, pagellm keeps
    the short-factor keys of the first positions, so a token's cached k depends only on
    its position (chunked prefill, prefix caching and preemption stay exact), and
    transformers' logits differ.
    """

    def __init__(self, head_dim: int, max_position: int, rope: RopeParams) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        """Leading dims of each head that rotate (head_dim unless rotary is partial)."""
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor {rope.partial_rotary_factor} gives "
                             f"{self.rotary_dim} rotary dims of {head_dim}; expected an even "
                             "number from 2 to head_dim")
        self.max_position = max_position
        self.rope = rope
        self.kernels = platform_of("cpu").kernels()
        """pagellm's C kernels for CPU tables, or None (no compiler): `rotate_torch` then
        runs, as it does for tables on a device without them."""
        cos, sin = self._compute_tables()
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _compute_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[max_position, R] float32 each (R = rotary_dim): cos of every (position,
        frequency), repeated for both halves; sin likewise, negated in the first half.

        "Rotate half" pairs x[i] with x[i + R/2]:
            out[i]       = x[i] * cos - x[i + R/2] * sin
            out[i + R/2] = x[i + R/2] * cos + x[i] * sin
        which is x * cos_cache + roll(x, R/2) * sin_cache, the same products and sums
        as Hugging Face's rotate_half form.
        """
        positions = torch.arange(self.max_position, dtype=torch.float32)
        if self.rope.rope_type == "longrope":
            short, long = longrope_inv_freqs(self.rotary_dim, self.rope)
            split = self.rope.scaling["original_max_position_embeddings"]
            freqs = torch.cat([positions[:split, None] * short[None, :],
                               positions[split:, None] * long[None, :]])
            scale = self.rope.scaling["attention_factor"]
            cos, sin = freqs.cos() * scale, freqs.sin() * scale
        else:
            inv_freq = compute_inv_freq(self.rotary_dim, self.rope)
            freqs = positions[:, None] * inv_freq[None, :]
            cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The step's rope inputs for positions [T] and activations of `dtype`."""
        positions = positions.to(torch.int64).contiguous()
        use_c = self.kernels is not None and self.cos_cache.is_cpu and dtype == self.cos_cache.dtype == torch.float32
        if use_c and positions.numel() and int(positions.max()) >= self.max_position:
            # the C pass reads table rows unchecked; index_select's error instead
            raise IndexError(f"position {int(positions.max())} is past the rope tables' "
                             f"{self.max_position} positions")
        return RopeTables(positions, self.cos_cache, self.sin_cache, dtype,
                          self.kernels if use_c else None)

    @staticmethod
    def rotate_(heads: torch.Tensor, n: int, tables: RopeTables) -> None:
        """Rotates the first `n` heads of heads [T, heads, D] in place (q and k heads of a
        fused qkv output, v's after them untouched): one C pass over contiguous heads,
        else `rotate_torch` and a copy back. Partial rotary (tables narrower than D)
        turns the first R dims of each head in torch and leaves the rest."""
        lib = tables.kernels
        t, _, d = heads.shape
        r = tables.cos_cache.shape[-1]
        if r != d:
            heads[:, :n, :r] = RotaryEmbedding.rotate_torch(heads[:, :n, :r], tables)
            return
        if lib is None or heads.dtype != torch.float32 or heads.stride(2) != 1 or heads.stride(1) != d:
            heads[:, :n] = RotaryEmbedding.rotate_torch(heads[:, :n], tables)
            return
        lib.pg_rope(heads.data_ptr(), heads.stride(0), t, n, d, tables.positions.data_ptr(),
                    tables.cos_cache.data_ptr(), tables.sin_cache.data_ptr())

    @staticmethod
    def rotate_torch(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """x [T, heads, R] -> rotated copy, in torch ops."""
        cos, sin = tables.rows()
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def rope_positions(config: Any, context: int) -> int:
    """Positions a rope table needs: the model's context, or the engine's max_model_len
    where the loader gave it (`config.max_model_len`) and it is shorter. (A table is
    [positions, head_dim] per cos and sin: Llama 3.1's 131072 positions at head_dim 128
    would be 128 MB for a server of 4096.)"""
    limit = getattr(config, "max_model_len", None)
    return min(context, int(limit)) if limit else context


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    max_position = rope_positions(config, context_length(config, default=8192))
    return RotaryEmbedding(head_dim, max_position, get_rope_params(config))
