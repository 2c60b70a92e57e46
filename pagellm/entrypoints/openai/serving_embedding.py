"""POST /v1/embeddings: inputs (text or token ids) -> AsyncLLM.encode on a pooling engine
-> OpenAI's embedding list (float lists or base64 float32), with usage.

Validation (empty input, input over the context, dimensions, the wrong engine) answers
400 before anything reaches the engine.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from pagellm.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    random_id,
)
from pagellm.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
)
from pagellm.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    def _prepare(self, request: EmbeddingRequest) -> tuple[list[list[int]], PoolingParams]:
        self.check_model(request.model)
        self.check_alive()
        self.check_pooling_engine()
        inputs: list[Any]
        if isinstance(request.input, str) or (request.input and isinstance(request.input[0], int)):
            inputs = [request.input]
        else:
            inputs = list(request.input)
        if not inputs:
            raise OpenAIError("The input is empty: give a string, a list of strings or token ids.", param="input")
        prompts = []
        for item in inputs:
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, add_special_tokens=True)
            else:
                ids = list(item)
                self.check_token_ids(ids, "input")
            if not ids:
                raise OpenAIError("An input is empty: each must contain at least one token.", param="input")
            self.check_pooling_length(ids, "input")
            prompts.append(ids)
        try:
            params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize, task="embed")
            params = self.engine.input_processor.complete_pooling_params(params)
        except ValueError as e:
            raise OpenAIError(str(e), param="dimensions") from e
        return prompts, params

    async def create(self, request: EmbeddingRequest, request_id: str | None = None) -> EmbeddingResponse:
        prompts, params = self._prepare(request)
        base_id = f"embd-{request_id}" if request_id else random_id("embd")
        vectors = await self.embed_all(prompts, params, base_id, request.priority)
        data = [EmbeddingData(index=i, embedding=_encode(vec, request.encoding_format))
                for i, vec in enumerate(vectors)]
        num_tokens = sum(len(ids) for ids in prompts)
        return EmbeddingResponse(id=base_id, model=request.model or self.served_model_names[0], data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


def _encode(vec: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
    return vec.tolist()

