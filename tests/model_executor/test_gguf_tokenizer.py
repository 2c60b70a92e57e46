"""GGUF SentencePiece vocabularies tokenize as llama.cpp does; BPE ones as before.

Test data (tests/data/), from llama.cpp's models/ folder (MIT), as shipped in the
llama-cpp-python 0.3.36 sdist on PyPI (vendor/llama.cpp/models/; the same vocabulary file
as ggerganov/llama.cpp's):
- llama_spm_vocab.json.xz: the tokens, scores and token types of
  ggml-vocab-llama-spm.gguf, llama.cpp's vocabulary-only GGUF of Llama-2's 32000-token
  SentencePiece tokenizer (the tests write GGUF files from it with gguf's GGUFWriter);
- ggml-vocab-llama-spm.gguf.inp / .out: llama.cpp's tokenizer test strings and the ids
  llama.cpp gives them (tests/test-tokenizer-0.cpp: no BOS, special tokens not parsed).
"""

from __future__ import annotations

import heapq
import json
import lzma
import random
from pathlib import Path
from typing import Any

import pytest

from pagellm.model_executor import gguf_tokenizer
from pagellm.model_executor.loader import load_tokenizer

DATA = Path(__file__).resolve().parent.parent / "data"
SPACE = "\u2581"

LLAMA2_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def _llama_cpp_cases() -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs, split as tests/test-tokenizer-0.cpp's read_tests does."""
    raw = (DATA / "ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8")
    sep = "\n__ggml_vocab_test__\n"
    texts = raw.split(sep)
    assert texts[-1] == ""  # the file ends with a separator, which ends the last test
    out = (DATA / "ggml-vocab-llama-spm.gguf.out").read_text(encoding="utf-8").split("\n")
    assert out[-1] == ""
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts[:-1], out[:-1], strict=True)]


CASES = _llama_cpp_cases()


@pytest.fixture(scope="module")
def vocab() -> dict[str, Any]:
    with lzma.open(DATA / "llama_spm_vocab.json.xz", "rt", encoding="utf-8") as f:
        return json.load(f)


def write_spm_gguf(path: Path, vocab: dict[str, Any], **flags: Any) -> str:
    """A vocabulary-only GGUF like llama.cpp's, with optional add_space_prefix and template."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab["tokens"])
    w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["token_type"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if "add_space_prefix" in flags:
        w.add_add_space_prefix(flags["add_space_prefix"])
    if "chat_template" in flags:
        w.add_chat_template(flags["chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory, vocab: dict[str, Any]) -> str:
    path = tmp_path_factory.mktemp("spm") / "llama-spm.gguf"
    return write_spm_gguf(path, vocab, chat_template=LLAMA2_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _load(path: str, cache: Path) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_CACHE_DIR", str(cache))
        return load_tokenizer(path)


@pytest.fixture(scope="module")
def spm(spm_gguf: str, cache_dir: Path) -> Any:
    return _load(spm_gguf, cache_dir)


# ------------------------------------------------------------------- llama.cpp's strings


def test_llama_cpp_test_file_has_all_cases() -> None:
    assert len(CASES) == 46
    assert CASES[5] == ("   ", [268])


@pytest.mark.parametrize("text,ids", CASES, ids=[f"{i:02d}" for i in range(len(CASES))])
def test_tokenizes_as_llama_cpp(spm: Any, text: str, ids: list[int]) -> None:
    assert spm.encode(text, add_special_tokens=False) == ids
    assert spm.decode(ids) == text  # llama.cpp's detokenizer drops the prefix space too


def test_leading_spaces_are_kept(spm: Any) -> None:
    # The cases transformers' GGUF conversion got wrong: a space already in front.
    assert spm.encode(" Hello", add_special_tokens=False) == [29871, 15043]
    assert spm.encode("  Hello", add_special_tokens=False) == [259, 15043]
    assert spm.encode(" ", add_special_tokens=False) == [259]
    assert spm.encode("", add_special_tokens=False) == []


def test_bos_special_tokens_and_chat_template(spm: Any) -> None:
    assert spm.encode("Hello world") == [1, 15043, 3186]  # add_bos_token
    assert (spm.bos_token_id, spm.eos_token_id, spm.unk_token_id) == (1, 2, 0)
    # Special tokens in text are parsed (llama.cpp's parse_special); the text after one
    # gets the prefix space, as in llama.cpp.
    assert spm.encode("<s>[INST] hi [/INST]", add_special_tokens=False) == [
        1, 518, 25580, 29962, 7251, 518, 29914, 25580, 29962]
    assert spm.decode([1, 15043, 3186], skip_special_tokens=True) == "Hello world"
    assert spm.decode([1, 15043, 3186, 2]) == "<s> Hello world</s>"
    prompt = spm.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s>[INST] Hi [/INST]"
    assert spm.encode(prompt, add_special_tokens=False) == [1, 518, 25580, 29962, 6324, 518,
                                                            29914, 25580, 29962]


def test_byte_fallback_round_trips(spm: Any) -> None:
    text = "🦙 \u0f00\u16a0 \x07"  # characters outside the vocabulary: <0xXX> tokens
    ids = spm.encode(text, add_special_tokens=False)
    assert ids[:6] == [29871, 243, 162, 169, 156, 29871]  # ▁, <0xF0><0x9F><0xA6><0x99>, ▁
    assert spm.decode(ids) == text


def test_cached_tokenizer_is_the_same(spm: Any, spm_gguf: str, cache_dir: Path) -> None:
    cached = list((cache_dir / "tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer_config.json").is_file()
    again = _load(spm_gguf, cache_dir)
    for text, ids in CASES:
        assert again.encode(text, add_special_tokens=False) == ids
        assert again.encode(text) == [1, *ids]
    assert again.chat_template == LLAMA2_CHAT_TEMPLATE
    assert again.decode([1, 15043, 3186], skip_special_tokens=True) == "Hello world"


def test_streamed_decode_equals_decode(spm: Any) -> None:
    """pagellm's detokenizer streams through tokenizers' DecodeStream."""
    from tokenizers.decoders import DecodeStream

    for text, _ in CASES[:20]:
        ids = spm.encode(text, add_special_tokens=False)
        stream = DecodeStream(skip_special_tokens=True)
        pieces = [stream.step(spm.backend_tokenizer, i) for i in ids]
        assert "".join(p for p in pieces if p) == text


def test_add_space_prefix_false(tmp_path: Path, vocab: dict[str, Any]) -> None:
    path = write_spm_gguf(tmp_path / "no-prefix.gguf", vocab, add_space_prefix=False)
    tok = _load(path, tmp_path / "cache")
    assert tok.encode("Hello world", add_special_tokens=False) == [10994, 3186]
    assert tok.encode(" Hello", add_special_tokens=False) == [15043]
    assert tok.decode([15043, 3186]) == " Hello world"


# ------------------------------------------- llama.cpp's SPM algorithm on other strings


def llama_cpp_spm(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llm_tokenizer_spm_session::tokenize (llama-vocab.cpp) on one fragment, written out:
    prefix space, ' ' -> '▁', merge the adjacent pair whose concatenation is the token of
    the highest score (ties: leftmost), unknown pieces as <0xXX> bytes."""
    syms = list((" " + text).replace(" ", SPACE))
    nxt = [*range(1, len(syms)), -1]
    prev = list(range(-1, len(syms) - 1))
    queue: list[tuple[float, int, int, int]] = []

    def add(left: int, right: int) -> None:
        if left != -1 and right != -1 and (syms[left] + syms[right]) in vocab:
            merged = syms[left] + syms[right]
            heapq.heappush(queue, (-scores[vocab[merged]], left, right, len(merged)))

    for i in range(1, len(syms)):
        add(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
            continue
        syms[left], syms[right] = syms[left] + syms[right], ""
        nxt[left] = nxt[right]
        if nxt[right] != -1:
            prev[nxt[right]] = left
        add(prev[left], left)
        add(left, nxt[left])
    out: list[int] = []
    i = 0
    while i != -1:
        piece = syms[i]
        out.extend([vocab[piece]] if piece in vocab else
                   [vocab[f"<0x{b:02X}>"] for b in piece.encode()])
        i = nxt[i]
    return out


def test_reference_port_reproduces_llama_cpp(vocab: dict[str, Any]) -> None:
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    for text, expected in CASES:
        if text:
            assert llama_cpp_spm(text, ids, vocab["scores"]) == expected, text


def test_random_text_matches_llama_cpp_algorithm(spm: Any, vocab: dict[str, Any]) -> None:
    """Random mixes of vocabulary pieces, space runs (equal-score merges), newlines, tabs,
    non-ASCII and characters outside the vocabulary."""
    tokens, scores = vocab["tokens"], vocab["scores"]
    ids = {t: i for i, t in enumerate(tokens)}
    words = [t.replace(SPACE, " ") for t in tokens[259:]]
    chars = list(" \t\n\r\xa0\u3000abcXYZ019.,'!?-_()[]<>/\\\"") + list("éüßñ日本語한국어привет") + [
        "🦙", "😀", "\u200d", "\x7f", "\U00010000", "\ufb01"]
    rng = random.Random(1234)
    texts = []
    for _ in range(300):
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.5:
                parts.append(rng.choice(words))
            elif r < 0.6:
                parts.append(" " * rng.randint(1, 40))
            else:
                parts.append("".join(rng.choice(chars) for _ in range(rng.randint(1, 6))))
        texts.append("".join(parts))
    texts += [" " * n for n in range(1, 40)] + [f"a{' ' * n}b" for n in range(1, 40)]
    got = spm(texts, add_special_tokens=False)["input_ids"]
    for text, ids_ in zip(texts, got, strict=True):
        assert ids_ == llama_cpp_spm(text, ids, scores), text
        assert spm.decode(ids_) == text


def test_equal_score_merges_grow_leftmost() -> None:
    """Space runs all score -1e9 in Llama's vocabulary: longer left parts rank first."""
    tokens = ["<unk>", "a", SPACE, SPACE * 2, SPACE * 3, SPACE * 4]
    merges = gguf_tokenizer.spm_merges(tokens, [0.0, 0.0, -1e9, -1e9, -1e9, -1e9])
    s1, s2, s3 = SPACE, SPACE * 2, SPACE * 3
    assert merges == [(s3, s1), (s2, s1), (s2, s2), (s1, s1), (s1, s2), (s1, s3)]


# ---------------------------------------------------------------- BPE: unchanged


def test_default_bpe_model_tokenizes_as_before(default_model_path: str) -> None:
    assert not gguf_tokenizer.is_spm_gguf(default_model_path)
    tok = load_tokenizer(default_model_path)
    cases = {
        "Hello world": [19556, 905],
        " Hello, world!  日本語\n\tcode": [38699, 28, 905, 17, 216, 17097, 241, 115, 40993,
                                          179, 120, 248, 198, 197, 4635],
        "   leading spaces and 🦙 emoji's don't": [256, 2899, 5600, 284, 15107, 116, 243, 649,
                                                   33777, 506, 1326, 982],
    }
    for text, ids in cases.items():
        assert tok.encode(text) == ids
        assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
