"""Rotary position embedding (NeoX/Hugging Face "rotate half" layout) with the rope
scalings the supported families use: default, linear and llama3.

Reads rope settings from either transformers 5 (`config.rope_parameters`) or the older
`rope_theta` / `rope_scaling` attributes. cos/sin are precomputed per position in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeParams:
    theta: float
    rope_type: str
    scaling: dict[str, Any]
    """The full rope dict (factor, low_freq_factor, ...) for scaled types; empty otherwise."""


def get_rope_params(config: Any) -> RopeParams:
    """Normalise old (rope_theta/rope_scaling) and new (rope_parameters) config styles."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if not params.get("rope_type") and isinstance(scaling, dict):
        params.update(scaling)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeParams(float(theta), rope_type, params if rope_type != "default" else {})


def compute_inv_freq(rotary_dim: int, rope: RopeParams) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in float32, scaled per rope type."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
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
    """Applies rope to q [T, H, D] and k [T, KVH, D] given positions [T].

    One instance is shared by all layers of a model; the cos/sin table covers
    `max_position` positions and is indexed by the step's positions.
    """

    def __init__(self, head_dim: int, max_position: int, rope: RopeParams) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope = rope
        self.register_buffer("cos_sin_cache", self._compute_cache(), persistent=False)

    def _compute_cache(self) -> torch.Tensor:
        """[max_position, D] float32: cos of every (position, frequency) in the first
        half, sin in the second half (each D/2 wide)."""
        inv_freq = compute_inv_freq(self.head_dim, self.rope)
        positions = torch.arange(self.max_position, dtype=torch.float32, device=inv_freq.device)
        freqs = positions[:, None] * inv_freq[None, :]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype)
        cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)  # each [T, 1, D/2]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # "rotate half": pairs are (x[i], x[i + D/2]), not adjacent elements.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    max_position = int(getattr(config, "max_position_embeddings", None) or 8192)
    return RotaryEmbedding(head_dim, max_position, get_rope_params(config))
