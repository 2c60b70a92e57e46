"""`pagellm tokenizer [MODEL]`: prints the directory a Hugging Face tokenizer loads from
for a model, for other tools' `--tokenizer` (lm-evaluation-harness, benchmarks).

For a GGUF file that is the loader's cache of the vocabulary converted to a fast tokenizer
(made now if it is missing); for a Hugging Face checkpoint, its own directory. No engine
starts.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def _is_tokenizer_dir(path: Any) -> bool:
    return isinstance(path, str) and os.path.isfile(os.path.join(path, "tokenizer_config.json"))


def tokenizer_directory(model_path: str, tokenizer: str | None = None, loaded: Any = None) -> str:
    """The directory of `model_path`'s tokenizer (`tokenizer`, when given, as the loader
    takes it). `loaded`: the tokenizer already loaded for it, to spare a second load.

    A tokenizer loaded from a directory names it in `name_or_path`; the loader reads a
    GGUF vocabulary from its cache directory once it has converted it there, so a
    tokenizer converted just now is loaded once more, from the cache."""
    from pagellm.model_executor import weight_utils
    from pagellm.model_executor.loader import load_tokenizer, resolve_model_path

    source = resolve_model_path(tokenizer) if tokenizer and tokenizer != model_path else model_path
    if not weight_utils.is_gguf(source):
        return os.path.abspath(source if os.path.isdir(source) else os.path.dirname(source))
    for tok in (loaded, None, None):
        tok = tok if tok is not None else load_tokenizer(model_path, tokenizer)
        if _is_tokenizer_dir(getattr(tok, "name_or_path", None)):
            return os.path.abspath(tok.name_or_path)
    raise ValueError(f"{source}: the tokenizer does not load from a directory")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="Print the directory of a model's tokenizer (for other tools' --tokenizer).")
    p.add_argument("model_tag", nargs="?", default=None, help="Model (default: SmolLM2-135M-Instruct).")
    p.add_argument("--tokenizer", default=None, help="A tokenizer other than the model's, as serve takes it.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagellm.model_executor.loader import resolve_model_path

    model_path = resolve_model_path(args.model_tag)
    print(tokenizer_directory(model_path, args.tokenizer))
    return 0
