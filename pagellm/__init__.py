"""pagellm: LLM inference and serving with vLLM's architecture and API.

Public names are imported lazily so `import pagellm` stays light. It leaves os.environ
as it is: pagellm's OpenMP wait policy goes only to the processes that compute (see
envs.OPENMP_DEFAULTS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagellm.entrypoints.llm",
    "AsyncLLM": "pagellm.engine.async_llm",
    "SamplingParams": "pagellm.sampling_params",
    "RequestOutputKind": "pagellm.sampling_params",
    "RequestOutput": "pagellm.outputs",
    "CompletionOutput": "pagellm.outputs",
    "PoolingParams": "pagellm.pooling_params",
    "PoolingRequestOutput": "pagellm.outputs",
    "EmbeddingRequestOutput": "pagellm.outputs",
    "ScoringRequestOutput": "pagellm.outputs",
    "ScoringOutput": "pagellm.outputs",
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
