"""Quantization methods: how a layer's weights are stored and multiplied.

A `QuantizationConfig` is chosen once per model from the checkpoint (`resolve_quantization`
names it, `get_quantization_config` builds it) and hands each linear / embedding layer a
method object (`QuantizeMethodBase`: create weights, load them, process them after
loading, apply). Layers built without a config use the unquantized method
(`pagellm.model_executor.layers.linear.UnquantizedLinearMethod`).

A new method goes in a module here and one line in `QUANTIZATION_METHODS`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagellm.logger import init_logger
from pagellm.platforms import platform_of

if TYPE_CHECKING:
    from pagellm.model_executor.layers.quantization.base_config import (
        QuantizationConfig,
        QuantizeMethodBase,
    )

logger = init_logger(__name__)

QUANTIZATION_METHODS = {"gguf": "pagellm.model_executor.layers.quantization.gguf.GGUFConfig"}
"""The registry: each name `--quantization` takes besides 'none' (dequantize / keep the
checkpoint dtype), and its `QuantizationConfig` class (imported when a model uses it:
the frontend checks names without torch)."""


GGUF_ACTIVATIONS = ("auto", "float32", "q8", "q8x2")
"""Values of EngineArgs.gguf_activations and PAGELLM_GGUF_ACTIVATIONS."""


def check_gguf_activations(value: str, name: str = "PAGELLM_GGUF_ACTIVATIONS") -> None:
    """Refuse a value outside GGUF_ACTIVATIONS, naming the option (the engine argument or
    the environment variable)."""
    if value not in GGUF_ACTIVATIONS:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(GGUF_ACTIVATIONS)}")


def q8_kernels_available() -> bool:
    """Whether the kernel library built on this CPU has the int8-activation kernels
    (ggml_q8.c: x86 with AVX2, FMA and F16C, the library's SIMD build), read from the CPU's
    flags without building or loading anything."""
    from pagellm import kernels

    return kernels.simd_flags_available()


def resolve_gguf_activations(requested: str) -> str:
    """'float32', 'q8' or 'q8x2' for `requested` (an EngineArgs.gguf_activations value).
    'auto' takes PAGELLM_GGUF_ACTIVATIONS when set, else the fixed rule: q8 where the CPU
    has the int8 kernels (measured faster there at every shape the stack runs, 135M to 8B:
    benchmarks/README.md), float32 elsewhere. One machine and one model always get the
    same numerics: no timing decides."""
    from pagellm import envs

    check_gguf_activations(requested, "gguf_activations")
    if requested == "auto":
        requested = envs.PAGELLM_GGUF_ACTIVATIONS or "auto"
        check_gguf_activations(requested)
    if requested == "auto":
        return "q8" if q8_kernels_available() else "float32"
    return requested


def resolve_quantization(requested: str | None, model_path: str, device: str) -> str | None:
    """The method a model runs with: None (weights in the model dtype) or a name from
    QUANTIZATION_METHODS. `requested` None detects it from the checkpoint ('gguf' for a
    .gguf file on CPU); 'none' forces unquantized weights (GGUF files dequantized at load).
    PAGELLM_GGUF_ACTIVATIONS is checked here too, before any model loads, and said to be
    ignored where the model does not run on GGUF blocks."""
    from pagellm import envs

    activations = envs.PAGELLM_GGUF_ACTIVATIONS
    if activations:
        check_gguf_activations(activations)
    method = _resolve_method(requested, model_path, device)
    if method != "gguf" and activations not in ("", "auto"):
        logger.warning("PAGELLM_GGUF_ACTIVATIONS=%s is ignored: %s does not run on GGUF blocks",
                       activations, model_path)
    return method


def _resolve_method(requested: str | None, model_path: str, device: str) -> str | None:
    from pagellm.model_executor import weight_utils

    is_gguf = weight_utils.is_gguf(model_path)
    if requested is None:
        if not is_gguf:
            return None
        if not platform_of(device).runs_gguf_blocks:
            logger.info("GGUF weights are dequantized at load on %s (quantized kernels are CPU only)", device)
            return None
        from pagellm import kernels

        # Without a compiler, load_kernels logs so and returns None before importing
        # torch. With one, the kernels are loaded (built once, cached) by the engine core,
        # which falls back to None if the build fails (EngineCore._confirm_quantization):
        # the frontend never imports torch for this.
        if kernels.find_compiler() is None:
            kernels.load_kernels()  # logs once that there is no compiler
            return None
        return "gguf"
    if requested == "none":
        return None
    if requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={requested!r} is not supported; choose one of "
            f"{', '.join(QUANTIZATION_METHODS)} or 'none' (default: detected from the checkpoint)"
        )
    if requested == "gguf" and not is_gguf:
        raise ValueError(f"quantization='gguf' needs a .gguf model file; {model_path} is not one")
    if not platform_of(device).runs_gguf_blocks:
        raise ValueError(f"quantization={requested!r} runs on CPU only; got device={device!r}")
    from pagellm.kernels import load_kernels

    if load_kernels() is None:
        raise ValueError(
            f"quantization={requested!r} needs the GGUF CPU kernels, which could not be built "
            "(no C compiler, or the build failed: see the log); use quantization='none'"
        )
    return requested


def get_quantization_config(model_config: Any) -> QuantizationConfig | None:
    """The config object for `model_config.quantization` (None: unquantized)."""
    name = getattr(model_config, "quantization", None)
    if name is None:
        return None
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization method {name!r}")
    module, cls = QUANTIZATION_METHODS[name].rsplit(".", 1)
    return getattr(importlib.import_module(module), cls).from_model_config(model_config)


__all__ = [
    "GGUF_ACTIVATIONS",
    "QUANTIZATION_METHODS",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "check_gguf_activations",
    "get_quantization_config",
    "q8_kernels_available",
    "resolve_gguf_activations",
    "resolve_quantization",
]


def __getattr__(name: str) -> Any:
    # The base classes import torch; the frontend imports this package only for
    # resolve_quantization, which must not (see EngineArgs.create_engine_config).
    if name in ("QuantizationConfig", "QuantizeMethodBase"):
        from pagellm.model_executor.layers.quantization import base_config

        return getattr(base_config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
