"""One registry of quantization methods: `--quantization` names, their config classes."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from pagellm.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    get_quantization_config,
    resolve_quantization,
)


def test_each_registered_name_builds_its_config() -> None:
    for name, path in QUANTIZATION_METHODS.items():
        module, cls_name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), cls_name)
        assert cls.get_name() == name
        config = get_quantization_config(SimpleNamespace(quantization=name, gguf_activations="float32"))
        assert type(config) is cls


def test_no_method_and_unknown_ones() -> None:
    assert get_quantization_config(SimpleNamespace(quantization=None)) is None
    with pytest.raises(ValueError, match=r"^unknown quantization method 'awq'$"):
        get_quantization_config(SimpleNamespace(quantization="awq"))
    with pytest.raises(ValueError, match=r"^quantization='awq' is not supported; choose one of gguf or 'none'"):
        resolve_quantization("awq", "model.gguf", "cpu")
