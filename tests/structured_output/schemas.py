"""Random JSON schemas for the structured-output tests: nested objects, arrays with item
bounds, enums, bounded numbers, required and optional fields, anyOf, string patterns and
bounded string lengths. Deterministic for a seed."""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south", "cat", "dog"]
_PATTERNS = [r"[A-Z]{2}-[0-9]{3}", r"[a-z]{3,6}", r"(yes|no)", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "pattern", "enum", "integer", "number", "boolean"])
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(1, 10)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(2, 4))}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    return {"type": "boolean"}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth > 0 and roll < 0.3:
        return make_object(rng, depth - 1)
    if depth > 0 and roll < 0.5:
        lo = rng.randint(0, 2)
        return {"type": "array", "items": _node(rng, depth - 1), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    if roll < 0.6:
        return {"anyOf": [_leaf(rng), _leaf(rng)]}
    return _leaf(rng)


def make_object(rng: random.Random, depth: int = 2) -> dict[str, Any]:
    names = rng.sample(["id", "name", "kind", "size", "tags", "owner", "score", "ok", "items", "color"],
                       rng.randint(1, 4))
    props = {n: _node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def make_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [make_object(rng, depth=rng.randint(0, 2)) for _ in range(count)]
