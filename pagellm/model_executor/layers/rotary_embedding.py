"""Rotary position embedding (NeoX/Hugging Face "rotate half" layout) with the rope
scalings the supported families use: default, linear and llama3, plus per-frequency
divisors as llama.cpp stores them (a GGUF's `rope_freqs` tensor, e.g. Llama 3.1).

Reads rope settings from either transformers 5 (`config.rope_parameters`) or the older
`rope_theta` / `rope_scaling` attributes. cos/sin are precomputed per position in float32.
float32 heads on the CPU are rotated in place by one C pass over q and k together
(`pg_rope`, pagellm/kernels/layer_ops.c); `rotate_torch` is the composition it replaces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.kernels import load_kernels
from pagellm.model_executor.arch_config import context_length, rope_dict

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class RopeTables:
    """One step's rope inputs (`RotaryEmbedding.tables`), made once per forward and read
    by every layer: the step's positions and the whole per-position tables, with the
    rows of those positions picked out only when a layer takes the torch path."""

    positions: torch.Tensor
    """[T] int64, contiguous, each below the tables' max_position."""
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    """[max_position, D] each (`RotaryEmbedding._compute_tables`)."""
    dtype: torch.dtype
    """The activations' dtype."""
    kernels: Any
    """pagellm's C kernels where this step can use them (float32 tables on the CPU), else
    None."""
    _rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of the step's positions, each [T, 1, D] in `dtype`."""
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


def get_rope_params(config: Any) -> RopeParams:
    """Normalise old (rope_theta/rope_scaling) and new (rope_parameters) config styles."""
    params = rope_dict(config)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    factors = getattr(config, "rope_freq_factors", None)
    return RopeParams(
        float(theta),
        rope_type,
        params if rope_type != "default" else {},
        tuple(float(f) for f in factors) if factors is not None else None,
    )


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
    return inv_freq


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
    """

    def __init__(self, head_dim: int, max_position: int, rope: RopeParams) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope = rope
        self.kernels = load_kernels()
        """pagellm's C kernels, or None (no compiler): `rotate_torch` then runs."""
        cos, sin = self._compute_tables()
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _compute_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[max_position, D] float32 each: cos of every (position, frequency), repeated for
        both halves; sin likewise, negated in the first half.

        "Rotate half" pairs x[i] with x[i + D/2]:
            out[i]       = x[i] * cos - x[i + D/2] * sin
            out[i + D/2] = x[i + D/2] * cos + x[i] * sin
        which is x * cos_cache + roll(x, D/2) * sin_cache, the same products and sums
        as Hugging Face's rotate_half form.
        """
        inv_freq = compute_inv_freq(self.head_dim, self.rope)
        positions = torch.arange(self.max_position, dtype=torch.float32, device=inv_freq.device)
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The step's rope inputs for positions [T] and activations of `dtype`."""
        positions = positions.to(torch.int64).contiguous()
        use_c = (
            self.kernels is not None
            and dtype == self.cos_cache.dtype == torch.float32
            and self.cos_cache.device.type == "cpu"
        )
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
        else `rotate_torch` and a copy back."""
        lib = tables.kernels
        t, _, d = heads.shape
        if lib is None or heads.dtype != torch.float32 or heads.stride(2) != 1 or heads.stride(1) != d:
            heads[:, :n] = RotaryEmbedding.rotate_torch(heads[:, :n], tables)
            return
        lib.pg_rope(heads.data_ptr(), heads.stride(0), t, n, d, tables.positions.data_ptr(),
                    tables.cos_cache.data_ptr(), tables.sin_cache.data_ptr())

    @staticmethod
    def rotate_torch(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """x [T, heads, D] -> rotated copy, in torch ops."""
        cos, sin = tables.rows()
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    max_position = context_length(config, default=8192)
    return RotaryEmbedding(head_dim, max_position, get_rope_params(config))
