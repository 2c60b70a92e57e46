"""Attention backends behind a name: `get_attn_backend(name)` returns an AttentionBackend
subclass with `get_builder_cls()` (per-step metadata), `get_impl_cls()` (per-layer
forward) and `allocate_kv_cache(...)` (one layer's K/V cache in the storage order its impl
reads). The engine selects one, once, by `config.attention_config.backend`; no name is
assumed here. Backends are imported lazily so optional kernels cost nothing until selected.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # backend.py needs torch; the CLI lists the names without it
    from pagellm.attention.backend import AttentionBackend

# backend name (its get_name()) -> (module, class name)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("pagellm.attention.torch_backend", "TorchAttentionBackend"),
}


def available_attn_backends() -> list[str]:
    """The names `get_attn_backend` accepts, sorted."""
    return sorted(_BACKENDS)


def get_attn_backend(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(available_attn_backends())}"
        )
    from pagellm.attention.backend import AttentionBackend

    module_name, cls_name = _BACKENDS[name]
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not issubclass(cls, AttentionBackend):
        raise TypeError(
            f"attention backend {name!r} ({cls_name}) does not subclass AttentionBackend"
        )
    # A backend is used as a class, never instantiated, so ABC alone would never report
    # a missing method: check here, where it is selected.
    if cls.__abstractmethods__:
        raise TypeError(
            f"attention backend {name!r} ({cls_name}) does not implement "
            f"{', '.join(sorted(cls.__abstractmethods__))}"
        )
    return cls


__all__ = ["AttentionBackend", "available_attn_backends", "get_attn_backend"]
