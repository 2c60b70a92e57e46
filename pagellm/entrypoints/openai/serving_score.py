"""POST /score and /rerank on a pooling engine, as vLLM serves them for an embedding
model: each distinct text embedded once (AsyncLLM.encode), a pair's score the cosine
similarity of its two embeddings. /score returns a score per pair (1:1, 1:N, N:N);
/rerank the documents by relevance to the query, best first, cut to top_n.

Validation (the wrong engine, empty texts, unpairable lengths, a text over the context)
answers 400 before anything reaches the engine.
"""

from __future__ import annotations

from pagellm.entrypoints import score_utils
from pagellm.entrypoints.openai.protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
    UsageInfo,
    random_id,
)
from pagellm.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
)
from pagellm.pooling_params import PoolingParams


class OpenAIServingScore(OpenAIServing):
    async def create(self, request: ScoreRequest | RerankRequest,
                     request_id: str | None = None) -> ScoreResponse | RerankResponse:
        self.check_model(request.model)
        self.check_alive()
        self.check_pooling_engine()
        if isinstance(request, RerankRequest):
            return await self._rerank(request, request_id)
        return await self._score(request, request_id)

    async def _score(self, request: ScoreRequest, request_id: str | None) -> ScoreResponse:
        texts_1, texts_2 = _texts(request.text_1, "text_1"), _texts(request.text_2, "text_2")
        pairs = _pairs(texts_1, texts_2, ("text_1", "text_2"))
        base_id = f"score-{request_id}" if request_id else random_id("score")
        scores, num_tokens = await self._embed_and_score(
            request, {"text_1": texts_1, "text_2": texts_2}, pairs, base_id)
        return ScoreResponse(id=base_id, model=request.model or self.served_model_names[0],
                             data=[ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))

    async def _rerank(self, request: RerankRequest, request_id: str | None) -> RerankResponse:
        query, documents = _texts(request.query, "query"), _texts(request.documents, "documents")
        pairs = _pairs(query, documents, ("query", "documents"))
        base_id = f"rerank-{request_id}" if request_id else random_id("rerank")
        scores, num_tokens = await self._embed_and_score(
            request, {"query": query, "documents": documents}, pairs, base_id)
        # Best first; equal scores keep the documents' order (sorted is stable).
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        top_n = request.top_n if request.top_n > 0 else len(documents)
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=documents[i]) if request.return_documents else None)
                   for i in order[:top_n]]
        return RerankResponse(id=base_id, model=request.model or self.served_model_names[0],
                              usage=RerankUsage(total_tokens=num_tokens), results=results)

    async def _embed_and_score(self, request: ScoreRequest | RerankRequest, sides: dict[str, list[str]],
                               pairs: list[tuple[str, str]], base_id: str) -> tuple[list[float], int]:
        """The pairs' scores and the prompt tokens of the distinct texts embedded."""
        # 1. each distinct text's tokens, checked against the context under its field's name
        try:
            keep = score_utils.truncation_size(request.truncate_prompt_tokens, self.max_model_len)
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens") from e
        token_ids = score_utils.tokenize_texts(self.tokenizer, [t for texts in sides.values() for t in texts], keep)
        for name, texts in sides.items():
            for text in texts:
                self.check_pooling_length(token_ids[text], name)
        params = self.engine.input_processor.complete_pooling_params(PoolingParams(task="embed"))
        # 2. one embedding per distinct text
        vectors = dict(zip(token_ids, await self.embed_all(list(token_ids.values()), params, base_id,
                                                           request.priority)))
        # 3. a score per pair
        scores = [score_utils.cosine_similarity(vectors[a], vectors[b]) for a, b in pairs]
        return scores, sum(len(ids) for ids in token_ids.values())


def _texts(texts: str | list[str], name: str) -> list[str]:
    try:
        return score_utils.as_text_list(texts, name)
    except ValueError as e:
        raise OpenAIError(str(e), param=name) from e


def _pairs(texts_1: list[str], texts_2: list[str], names: tuple[str, str]) -> list[tuple[str, str]]:
    try:
        return score_utils.score_pairs(texts_1, texts_2, names)
    except ValueError as e:
        raise OpenAIError(str(e), param=names[1]) from e
