"""Reasoning parsers: exact splits, streaming equivalence at every chunking, token ids."""

from __future__ import annotations

import random

import pytest

from pagellm.reasoning import REASONING_PARSERS, get_reasoning_parser


def chunkings(text: str, n_random: int = 20, seed: int = 0) -> list[list[str]]:
    out = [list(text), [text]]
    out += [[text[:k], text[k:]] for k in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(n_random if len(text) > 1 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def streamed(name: str, chunks: list[str]) -> tuple[str | None, str | None]:
    s = get_reasoning_parser(name)().streamer()
    reasoning, content = [], []
    for delta in [s.feed(c) for c in chunks] + [s.finish()]:
        r, c = delta  # a (reasoning_content, content) pair
        assert r != "" and c != "", "empty pieces are None"
        reasoning.append(r or "")
        content.append(c or "")
    return "".join(reasoning) or None, "".join(content) or None


def check(name: str, text: str, expected: tuple[str | None, str | None]) -> None:
    assert get_reasoning_parser(name)().extract_reasoning(text) == expected
    for chunks in chunkings(text):
        assert streamed(name, chunks) == expected, chunks


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Let me think.\n</think>\n\nThe answer is 4.", ("Let me think.", "The answer is 4.")),
        ("<think>\nHmm, 2+2.\n</think>\n\n4", ("Hmm, 2+2.", "4")),
        ("  <think>a</think>b  ", ("a", "b  ")),
        ("still thinking when cut off </thi", ("still thinking when cut off </thi", None)),
        ("</think>only an answer", (None, "only an answer")),
        ("<think></think>", (None, None)),
        ("a < b </think> c </think> d", ("a < b", "c </think> d")),
        ("", (None, None)),
    ],
)
def test_deepseek_r1(text, expected):
    check("deepseek_r1", text, expected)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>\nHmm.\n</think>\n\nHello!", ("Hmm.", "Hello!")),
        ("Hello, no thinking here.", (None, "Hello, no thinking here.")),
        ("  \n Plain answer with spaces \n", (None, "  \n Plain answer with spaces \n")),
        ("<think>cut off", ("cut off", None)),
        ("<thin", (None, "<thin")),
        ("An answer that mentions <think> later", (None, "An answer that mentions <think> later")),
        ('<think>\n\n</think>\n\n{"a": 1}', (None, '{"a": 1}')),
    ],
)
def test_qwen3(text, expected):
    check("qwen3", text, expected)


def test_stream_holds_back_only_a_partial_end_marker():
    s = get_reasoning_parser("qwen3")().streamer()
    assert s.feed("<thi") == (None, None)
    assert s.feed("nk>x </th") == ("x", None)
    assert s.feed("ick") == (" </thick", None)
    assert s.feed("</think>\n") == (None, None)
    assert s.feed("\nHi") == (None, "Hi")
    assert s.finish() == (None, None)


class FakeTokenizer:
    unk_token_id = 0
    vocab = {"<think>": 7, "</think>": 8}

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.vocab.get(token, self.unk_token_id)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_token_ids(name):
    parser = get_reasoning_parser(name)(FakeTokenizer())
    assert parser.reasoning_end_token_id == 8
    assert not parser.is_reasoning_end([1, 7, 5, 5])
    assert parser.is_reasoning_end([1, 7, 5, 8])
    assert parser.is_reasoning_end([1, 7, 5, 8, 9, 9])
    # an earlier turn's closed reasoning does not end the reasoning opened after it
    assert not parser.is_reasoning_end([7, 5, 8, 3, 7, 5])
    assert parser.extract_content_ids([1, 7, 5, 8, 9, 10]) == [9, 10]
    assert parser.extract_content_ids([1, 7, 5]) == []


def test_token_ids_need_a_single_end_token():
    class NoThink(FakeTokenizer):
        vocab = {}

    with pytest.raises(ValueError, match="no single token for '</think>'"):
        _ = get_reasoning_parser("qwen3")(NoThink()).reasoning_end_token_id
    with pytest.raises(ValueError, match="needs a tokenizer"):
        _ = get_reasoning_parser("qwen3")().reasoning_end_token_id
