"""Attention backends behind a name: `get_attn_backend("torch")` returns a backend class
with `get_builder_cls()` (per-step metadata), `get_impl_cls()` (per-layer forward) and
`allocate_kv_cache(...)` (one layer's K/V cache in the storage order its impl reads).
Backends are imported lazily so optional kernels cost nothing until selected.
"""

from __future__ import annotations

import importlib

# backend name -> (module, class name)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("pagellm.attention.torch_backend", "TorchAttentionBackend"),
}


def get_attn_backend(name: str = "torch") -> type:
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}"
        )
    module_name, cls_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), cls_name)


__all__ = ["get_attn_backend"]
