"""A fast tokenizer for GGUF files with a SentencePiece vocabulary that tokenizes as llama.cpp.

`tokenizer.ggml.model == "llama"` (Llama-2, Mistral, TinyLlama files) names llama.cpp's SPM
tokenizer (src/llama-vocab.cpp, `llm_tokenizer_spm_session`). For each stretch of text
between special tokens it

1. puts a space in front when `tokenizer.ggml.add_space_prefix` (default true) and the
   stretch starts the text or follows a special token;
2. writes every ' ' as U+2581 '▁';
3. splits the result into characters and, while two adjacent pieces concatenate to a
   vocabulary token, merges the pair whose token has the highest score (ties: the
   leftmost pair);
4. emits each piece's id, or for a piece that is no token its UTF-8 bytes as `<0xXX>`.

Step 3 is a BPE whose merges are every (a, b) with a, b and a+b tokens, ranked by the
score of a+b, so it is built as a `tokenizers` BPE (byte fallback on) behind a
Prepend/Replace normalizer and no pre-tokenizer. Equal scores (Llama's space runs
'▁▁'...'▁'*16 all score -1e9) are ranked longest left part first, which reproduces
llama.cpp's leftmost-first growth of a run. Decoding mirrors llama.cpp's detokenizer:
'▁' -> ' ', `<0xXX>` -> the byte, and one leading space of the text removed.

transformers' own GGUF conversion uses a Metaspace pre-tokenizer that adds no space in
front of text that already starts with one, so " Hello" lost llama.cpp's 29871 there.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagellm.model_executor import weight_utils

TOKENIZER_CACHE_FORMAT = 2
"""Part of the tokenizer cache key: bumped when what a GGUF file's cached tokenizer holds
changes (2: SPM vocabularies built here instead of by transformers' GGUF conversion)."""

# gguf's TokenType values (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPACE = "\u2581"


def is_spm_gguf(path: str) -> bool:
    """Whether the GGUF file's vocabulary is llama.cpp's SPM (`tokenizer.ggml.model` llama)."""
    return weight_utils.gguf_field(weight_utils.open_gguf(path), "tokenizer.ggml.model") == "llama"


def _str_array(reader: Any, key: str) -> list[str] | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _num_array(reader: Any, key: str) -> list[Any] | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return np.concatenate([field.parts[i] for i in field.data]).tolist()


def _token_id(reader: Any, key: str, default: int | None, n: int) -> int | None:
    """llama.cpp: the file's id if in range, else the default (None if out of range too)."""
    value = weight_utils.gguf_field(reader, key)
    if value is not None and 0 <= int(value) < n:
        return int(value)
    return default if default is not None and 0 <= default < n else None


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every pair (a, b) of tokens whose concatenation is a token, highest score first.

    These are exactly the bigrams llama.cpp's SPM merge loop can apply (its pieces are
    single characters or tokens). Equal scores: the longer left part first, so that, as
    in llama.cpp, a run of equal-score merges grows the leftmost piece.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, token in enumerate(tokens):
        for k in range(len(token) - 1, 0, -1):
            left, right = token[:k], token[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], -k, i, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(path: str) -> Any:
    """A transformers PreTrainedTokenizerFast for an SPM GGUF vocabulary (see module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = weight_utils.open_gguf(path)
    tokens = _str_array(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata")
    n = len(tokens)
    scores = _num_array(reader, "tokenizer.ggml.scores") or [0.0] * n
    types = _num_array(reader, "tokenizer.ggml.token_type") or [_NORMAL] * n
    if len(scores) < n or len(types) < n:
        raise ValueError(f"{path}: fewer token scores or types than tokens")
    # llama.cpp names empty tokens so; the vocabulary then has no duplicates.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != n:
        raise ValueError(f"{path}: the SPM vocabulary has duplicate tokens")

    def flag(key: str, default: bool) -> bool:
        value = weight_utils.gguf_field(reader, key)
        return default if value is None else bool(value)

    add_space_prefix = flag("tokenizer.ggml.add_space_prefix", True)
    add_bos = flag("tokenizer.ggml.add_bos_token", True)
    add_eos = flag("tokenizer.ggml.add_eos_token", False)
    bos_id = _token_id(reader, "tokenizer.ggml.bos_token_id", 1, n)
    eos_id = _token_id(reader, "tokenizer.ggml.eos_token_id", 2, n)
    unk_id = _token_id(reader, "tokenizer.ggml.unknown_token_id", 0, n)
    pad_id = _token_id(reader, "tokenizer.ggml.padding_token_id", None, n)

    unk = tokens[unk_id] if unk_id is not None else None
    tk = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores), unk_token=unk,
                              fuse_unk=True, byte_fallback=True))
    replace = normalizers.Replace(" ", _SPACE)
    tk.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if add_space_prefix else replace
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(steps)

    # Control and unknown tokens are special (matched in text, skipped when decoding);
    # user-defined ones are matched in text and decoded as text, as in llama.cpp.
    added = []
    for i, t in enumerate(tokens):
        kind = types[i]
        if kind in (_CONTROL, _UNKNOWN) or i in (bos_id, eos_id, unk_id, pad_id):
            added.append(AddedToken(t, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            added.append(AddedToken(t, special=False, normalized=False))
    tk.add_tokens(added)

    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    single, pair, special = "$A:0", "$A:0 $B:1", []
    if add_bos and bos is not None:
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
        special.append((bos, bos_id))
    if add_eos and eos is not None:
        single, pair = f"{single} {eos}:0", pair.replace("$A:0", f"$A:0 {eos}:0").replace(
            "$B:1", f"$B:1 {eos}:1")
        special.append((eos, eos_id))
    tk.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(special)))

    chat_template = weight_utils.gguf_field(reader, "tokenizer.chat_template")
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=tokens[pad_id] if pad_id is not None else None,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )
