"""The EngineCoreClient contract, without starting an engine: the base class is abstract,
every client keeps its signatures, make_client picks by mode, and the frontend reads every
rank's ready response."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from pagellm.core.protocol import EngineCoreReadyResponse
from pagellm.engine.core_client import (
    AsyncMPClient,
    DPAsyncMPClient,
    DPLBAsyncMPClient,
    EngineCoreClient,
    InprocClient,
    MPClient,
    SyncMPClient,
    merge_ready_responses,
)
from pagellm.utils import describe_exit

CLIENTS = [InprocClient, MPClient, SyncMPClient, AsyncMPClient, DPAsyncMPClient, DPLBAsyncMPClient]
API = [
    name for name, member in vars(EngineCoreClient).items()
    if callable(member) and not name.startswith("_") and name not in ("make_client", "make_async_mp_client")
]


def test_the_base_client_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        EngineCoreClient()  # type: ignore[abstract]


@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.__name__)
def test_every_client_keeps_the_base_signatures(client: type[EngineCoreClient]) -> None:
    assert set(API) >= {"shutdown", "get_output", "add_request", "call_utility_async"}
    for name in API:
        base, sub = getattr(EngineCoreClient, name), getattr(client, name)
        assert inspect.signature(sub) == inspect.signature(base), f"{client.__name__}.{name}"
        assert inspect.iscoroutinefunction(sub) == inspect.iscoroutinefunction(base), name


def test_async_mode_needs_multiprocessing() -> None:
    with pytest.raises(ValueError, match="own process"):
        EngineCoreClient.make_client(False, True, None)  # type: ignore[arg-type]


def test_only_the_async_engine_restarts_engine_cores() -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1, restart_engine_on_failure=True))
    with pytest.raises(ValueError, match="^restart_engine_on_failure applies to the server's engine"):
        EngineCoreClient.make_client(True, False, config)  # type: ignore[arg-type]


def test_exit_codes_in_words() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(1) == "exited with code 1"


def test_every_ranks_ready_response_is_read() -> None:
    readies = {0: EngineCoreReadyResponse(40), 1: EngineCoreReadyResponse(31), 2: EngineCoreReadyResponse(35)}
    assert merge_ready_responses(readies) == EngineCoreReadyResponse(31)
    assert merge_ready_responses({0: EngineCoreReadyResponse(7)}) == EngineCoreReadyResponse(7)
    assert merge_ready_responses({1: EngineCoreReadyResponse(5, "gguf"), 0: EngineCoreReadyResponse(9, "gguf")}) \
        == EngineCoreReadyResponse(5, "gguf")


def test_the_engine_cores_quantization_reaches_the_frontends_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frontend resolves an auto 'gguf' (and an auto q8_0 KV cache) from the compiler
    alone (no torch import); an engine core whose kernel build fails runs dequantized, on a
    float16 cache where q8_0 was picked (only the kernels read q8_0), and says so in its
    handshake, and the frontend's model_config follows."""
    from pagellm import kernels
    from pagellm.core.engine_core import _confirm_quantization
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.engine.llm_engine import apply_ready_response

    config = EngineArgs(max_model_len=64).create_engine_config()
    config = dataclasses.replace(config, cache_config=dataclasses.replace(config.cache_config, cache_dtype="q8_0"))
    assert config.model_config.quantization == "gguf"
    assert _confirm_quantization(config) is config
    monkeypatch.setattr(kernels, "load_kernels", lambda: None)
    fallback = _confirm_quantization(config)
    assert fallback.model_config.quantization is None
    assert dataclasses.replace(fallback.model_config, quantization="gguf") == config.model_config
    assert fallback.cache_config == dataclasses.replace(config.cache_config, cache_dtype="float16")
    exact = dataclasses.replace(config, model_config=dataclasses.replace(config.model_config, quantization=None))
    assert _confirm_quantization(exact).cache_config.cache_dtype == "float16"  # float weights, q8_0 asked

    class Client:
        ready = EngineCoreReadyResponse(12, None)

    applied = apply_ready_response(config, Client())  # type: ignore[arg-type]
    assert (applied.model_config.quantization, applied.cache_config.num_gpu_blocks) == (None, 12)


def test_model_config_keeps_the_dtype_by_name() -> None:
    """The frontend builds (and pickles) the config without torch: the dtype is a name,
    a torch.dtype given is stored by its name, and torch_dtype is the torch object."""
    import torch

    from pagellm.engine.arg_utils import EngineArgs

    mc = EngineArgs(max_model_len=64, dtype="half").create_engine_config().model_config
    assert (mc.dtype, mc.torch_dtype) == ("float16", torch.float16)
    assert dataclasses.replace(mc, dtype=torch.bfloat16).dtype == "bfloat16"
