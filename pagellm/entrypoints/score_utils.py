"""Scoring text pairs on an embedding model, shared by LLM.score and /score, /rerank:
two text lists -> the pairs to score (1:1, 1:N, N:N), each distinct text tokenized
once (truncated as asked), and the cosine similarity of two embeddings.

Plain functions on lists and numpy arrays; they raise ValueError naming the argument
(the server turns it into a 400). No engine, no tokenizer of their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

COSINE_EPS = 1e-8
"""The smallest norm product divided by, as torch's cosine_similarity (vLLM's)."""


def as_text_list(texts: str | list[str], name: str) -> list[str]:
    """One text or a list of them as a non-empty list of non-empty strings."""
    items = [texts] if isinstance(texts, str) else list(texts)
    if not items:
        raise ValueError(f"{name} is empty: give a string or a list of strings.")
    for i, text in enumerate(items):
        if not isinstance(text, str):
            raise ValueError(f"{name}[{i}] must be a string, got {type(text).__name__}.")
        if not text:
            where = name if isinstance(texts, str) else f"{name}[{i}]"
            raise ValueError(f"{where} is an empty string: each text must have at least one character.")
    return items


def score_pairs(texts_1: list[str], texts_2: list[str], names: tuple[str, str]) -> list[tuple[str, str]]:
    """The pairs to score, as vLLM makes them: 1:1, 1:N (the one first text against
    each second) or N:N (the i-th with the i-th)."""
    n1, n2 = len(texts_1), len(texts_2)
    if n1 > 1 and n1 != n2:
        raise ValueError(f"Input lengths must be either 1:1, 1:N or N:N: {names[0]} has {n1} texts "
                         f"and {names[1]} has {n2}.")
    if n1 == 1:
        return [(texts_1[0], t) for t in texts_2]
    return list(zip(texts_1, texts_2))


def truncation_size(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many tokens a text keeps (its last ones, vLLM's left truncation); -1 is the
    model's context length, None no truncation."""
    k = truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 (the context length) or a positive number of "
                         f"tokens, got {k!r}.")
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_model_len}). "
                         "Please, select a smaller truncation size.")
    return k


def tokenize_texts(tokenizer: Any, texts: list[str], keep: int | None) -> dict[str, list[int]]:
    """Each distinct text's token ids (special tokens added, as for an embedding), cut
    to the last `keep` tokens when given; in first-seen order."""
    ids = {}
    for text in dict.fromkeys(texts):
        tokens = tokenizer.encode(text, add_special_tokens=True)
        ids[text] = tokens[-keep:] if keep is not None else tokens
    return ids


def cosine_similarity(a: Any, b: Any) -> float:
    """a·b / max(|a| |b|, eps) in float64 (embeddings arrive as float32)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y / max(float(np.linalg.norm(x) * np.linalg.norm(y)), COSINE_EPS))
