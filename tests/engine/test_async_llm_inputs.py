"""AsyncLLM.add_request checks a ready-made EngineCoreRequest (which skips the
InputProcessor) instead of passing it on unvalidated. No engine is started."""

from __future__ import annotations

import types

import pytest

from pagellm.core.protocol import EngineCoreRequest
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.output_processor import OutputProcessor
from pagellm.sampling_params import SamplingParams


def engine_without_core() -> AsyncLLM:
    engine = AsyncLLM.__new__(AsyncLLM)
    engine.engine_core = types.SimpleNamespace(engine_dead=False)  # type: ignore[assignment]
    engine.output_handler = None
    engine.output_processor = OutputProcessor(None, log_stats=False)
    return engine


@pytest.mark.parametrize(
    ("request_id", "max_tokens", "error"),
    [("other", 4, "differs from the EngineCoreRequest's 'r'"), ("r", None, "needs max_tokens set")],
)
async def test_a_ready_made_request_is_checked(request_id: str, max_tokens: int | None, error: str) -> None:
    request = EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=max_tokens), 0.0)
    engine = engine_without_core()
    with pytest.raises(ValueError, match=error):
        await engine.add_request(request_id, request, request.sampling_params)
    assert not engine.output_processor.has_unfinished_requests()
