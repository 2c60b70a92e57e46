"""Synthetic benchmark workloads: seeded random token-id prompts (offline benchmarks) and
random word prompts (serving benchmarks, portable to any server's tokenizer), plus the
shared `--random-*` / `--input-len` flags. Knows nothing about engines or HTTP."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Common English words; each is one token (with its leading space) in the BPE
# vocabularies of the Llama / SmolLM / Qwen families, so N words ~ N prompt tokens.
WORDS = (
    "the of and to in is that it for was on are as with his they at be this have from or "
    "one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would "
    "make like him into time has look two more write go see number no way could people my "
    "than first water been call who oil its now find long down day did get come made may part"
).split()


@dataclass
class SampleRequest:
    """One benchmark request: the prompt (token ids or text), its length in tokens
    (exact for token ids, approximate for text without a tokenizer) and how many
    tokens to generate."""

    prompt: list[int] | str
    prompt_len: int
    expected_output_len: int


# -- lengths --------------------------------------------------------------------------


def uniform_lengths(
    rng: np.random.Generator, num: int, low: int, high: int
) -> list[int]:
    """`num` integers uniform in [low, high] (inclusive), each at least 1."""
    if low > high:
        raise ValueError(f"length range is empty: [{low}, {high}]")
    return [max(1, int(x)) for x in rng.integers(low, high + 1, size=num)]


def ratio_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: lengths uniform in [len*(1-r), len*(1+r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    return int(length * (1 - range_ratio)), int(length * (1 + range_ratio))


# -- token-id prompts (offline) ------------------------------------------------------


def allowed_token_ids(vocab_size: int, special_ids: Sequence[int] = ()) -> np.ndarray:
    """Every id in [0, vocab_size) that is not a special token (BOS/EOS/chat markers)."""
    return np.setdiff1d(np.arange(vocab_size), np.asarray(list(special_ids), dtype=np.int64))


def token_requests(
    input_lens: Sequence[int], output_lens: Sequence[int], vocab: np.ndarray, seed: int
) -> list[SampleRequest]:
    """Random token-id prompts with the given lengths (ids drawn uniformly from `vocab`)."""
    rng = np.random.default_rng(seed + 1)  # not the lengths' stream: lengths stay independent
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        ids = rng.choice(vocab, size=n_in).tolist()
        requests.append(SampleRequest(prompt=ids, prompt_len=n_in, expected_output_len=n_out))
    return requests


def random_lengths(
    num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> tuple[list[int], list[int]]:
    """The 'random' dataset's lengths: input_len/output_len ± range_ratio, seeded."""
    rng = np.random.default_rng(seed)
    inputs = uniform_lengths(rng, num, *ratio_range(input_len, range_ratio))
    outputs = uniform_lengths(rng, num, *ratio_range(output_len, range_ratio))
    return inputs, outputs


def varied_lengths(
    num: int, min_in: int, max_in: int, min_out: int, max_out: int, seed: int
) -> tuple[list[int], list[int]]:
    """The 'varied' dataset's lengths: input uniform in [min_in, max_in], output uniform
    in [min_out, max_out], seeded."""
    rng = np.random.default_rng(seed)
    return uniform_lengths(rng, num, min_in, max_in), uniform_lengths(rng, num, min_out, max_out)


# -- text prompts (serving) -----------------------------------------------------------


def text_requests(
    input_lens: Sequence[int], output_lens: Sequence[int], seed: int, tokenizer: Any = None
) -> list[SampleRequest]:
    """Prompts of random common words, ~1 token per word. With a tokenizer the text is
    cut to exactly the requested number of tokens (as that tokenizer counts them)."""
    rng = np.random.default_rng(seed + 1)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=n_in)]
        text = " ".join(words)
        prompt_len = n_in
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)[:n_in]
            text = tokenizer.decode(ids)
            prompt_len = len(ids)
        requests.append(SampleRequest(prompt=text, prompt_len=prompt_len, expected_output_len=n_out))
    return requests


# -- CLI flags shared by the benchmarks ----------------------------------------------


def add_dataset_args(
    parser: argparse.ArgumentParser, *, varied: bool = True, seed: bool = True,
    num_prompts: int = 1000, input_len: int = 1024,
) -> None:
    """The workload flags (vLLM's names). `seed=False` where EngineArgs already adds
    --seed (the offline benchmarks seed the engine and the workload with it).
    `num_prompts` / `input_len`: the defaults shown (vLLM's: 1000 x 1024; resolve_lengths
    fills the length)."""
    g = parser.add_argument_group("workload")
    choices = ["random", "varied"] if varied else ["random"]
    g.add_argument("--dataset-name", choices=choices, default="random",
                   help="random: lengths len*(1±ratio); varied: uniform in [min, max].")
    g.add_argument("--num-prompts", type=int, default=num_prompts,
                   help=f"Number of requests (default {num_prompts}).")
    if seed:
        g.add_argument("--seed", type=int, default=0, help="Seed of the workload generator.")
    g.add_argument("--random-input-len", type=int, default=None,
                   help=f"Prompt tokens per request (default {input_len}). Alias: --input-len.")
    g.add_argument("--random-output-len", type=int, default=None,
                   help="Output tokens per request (default 128). Alias: --output-len.")
    g.add_argument("--input-len", type=int, default=None, help="Same as --random-input-len.")
    g.add_argument("--output-len", type=int, default=None, help="Same as --random-output-len.")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths uniform in [len*(1-r), len*(1+r)].")
    if varied:
        g.add_argument("--min-input-len", type=int, default=16)
        g.add_argument("--max-input-len", type=int, default=512)
        g.add_argument("--min-output-len", type=int, default=16)
        g.add_argument("--max-output-len", type=int, default=256)


def _merge_alias(args: argparse.Namespace, name: str, alias: str, default: int) -> int:
    value, alias_value = getattr(args, name), getattr(args, alias)
    if value is not None and alias_value is not None and value != alias_value:
        flag, alias_flag = "--" + name.replace("_", "-"), "--" + alias.replace("_", "-")
        raise SystemExit(
            f"error: {flag} ({value}) and {alias_flag} ({alias_value}) are the same option "
            "with different values; give one."
        )
    merged = value if value is not None else alias_value
    return default if merged is None else merged


def resolve_lengths(args: argparse.Namespace, default_in: int = 1024, default_out: int = 128) -> None:
    """Folds --input-len/--output-len into --random-input-len/--random-output-len (both
    spellings mean the same; different values are an error) and fills the defaults."""
    args.random_input_len = _merge_alias(args, "random_input_len", "input_len", default_in)
    args.random_output_len = _merge_alias(args, "random_output_len", "output_len", default_out)
    args.input_len, args.output_len = args.random_input_len, args.random_output_len
    if args.num_prompts < 1:
        raise SystemExit("error: --num-prompts must be at least 1")


def dataset_lengths(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """Input and output lengths of the workload the flags describe (after resolve_lengths)."""
    if getattr(args, "dataset_name", "random") == "varied":
        return varied_lengths(args.num_prompts, args.min_input_len, args.max_input_len,
                              args.min_output_len, args.max_output_len, args.seed)
    return random_lengths(args.num_prompts, args.random_input_len, args.random_output_len,
                          args.random_range_ratio, args.seed)
