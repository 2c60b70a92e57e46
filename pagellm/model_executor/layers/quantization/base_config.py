"""The two contracts of a quantization method.

`QuantizationConfig` describes how a checkpoint's weights are quantized and picks, for
each layer, the `QuantizeMethodBase` that owns that layer's weights. A method creates the
layer's weight attributes, takes the checkpoint tensors the loader hands it, re-lays them
out once after loading, and computes the layer's output in `apply`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


class QuantizeMethodBase(ABC):
    """How one layer's weights are kept and multiplied."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int],
                       bias: bool) -> None:
        """Give `layer` its weight attributes for `in_features` inputs and the output
        partitions `output_sizes` (one entry for a plain linear, one per fused part)."""

    @abstractmethod
    def load_weight(self, layer: nn.Module, shard: int, loaded: Any) -> None:
        """Store checkpoint tensor `loaded` as output partition `shard` of the weight."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Re-lay out the loaded weights for the kernels (once, after every shard);
        nothing to do by default."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> x @ W.T (+ bias) [T, out] (may be a transposed view)."""


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme; hands layers their methods."""

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The name `--quantization` takes."""

    @classmethod
    @abstractmethod
    def from_model_config(cls, model_config: Any) -> QuantizationConfig:
        """The config for a model (ModelConfig: its path, its method's options)."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for `layer` (named `prefix` in the checkpoint's HF naming), or None
        for the unquantized method."""
