"""pagellm: LLM inference and serving with vLLM's architecture and API.

Public names are imported lazily so `import pagellm` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagellm.envs import apply_openmp_defaults

apply_openmp_defaults()  # before anything imports torch (see envs.OPENMP_DEFAULTS)

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagellm.entrypoints.llm",
    "AsyncLLM": "pagellm.engine.async_llm",
    "SamplingParams": "pagellm.sampling_params",
    "RequestOutputKind": "pagellm.sampling_params",
    "RequestOutput": "pagellm.outputs",
    "CompletionOutput": "pagellm.outputs",
    "EngineArgs": "pagellm.engine.arg_utils",
    "AsyncEngineArgs": "pagellm.engine.arg_utils",
    "LLMEngine": "pagellm.engine.llm_engine",
    "TextPrompt": "pagellm.inputs",
    "TokensPrompt": "pagellm.inputs",
    "PromptType": "pagellm.inputs",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from pagellm.engine.arg_utils import EngineArgs  # noqa: F401
    from pagellm.entrypoints.llm import LLM  # noqa: F401
    from pagellm.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from pagellm.sampling_params import RequestOutputKind, SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
