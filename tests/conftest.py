"""Session fixtures shared by every test package: the default GGUF model's path and a
factory of tiny random-weight HF models (see tests/utils.py). Tests never reach the hub."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# libgomp threads spin while waiting; on a 2-core machine shared with other processes
# that makes small ops 10-100x slower. Passive waiting costs nothing when idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from pagellm.model_executor.loader import default_model_path as find_default

    try:
        return find_default()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tiny_model(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: str
) -> Callable[..., str]:
    """`tiny_model("llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3", **config_overrides) -> model dir`."""
    from tests.utils import make_tiny_model

    def factory(family: str, **overrides: object) -> str:
        return make_tiny_model(family, tmp_path_factory, **overrides)

    return factory


@pytest.fixture(scope="session")
def q4_k_m_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama in Q4_K_M's mix (Q4_K, with Q6_K attn_v/ffn_down in some layers and
    a Q6_K head), random weights, llama.cpp's q/k row order."""
    from pagellm.benchmarks.synthetic_gguf import SHAPES, write_llama_gguf

    path = str(tmp_path_factory.mktemp("q4km") / "tiny-q4_k_m.gguf")
    write_llama_gguf(path, dict(SHAPES["tiny"], layers=3), "q4_k_m", seed=1)
    return path
