"""`pagellm bench throughput`: offline throughput of `LLM.generate` over a synthetic
workload (random or varied token-id prompts, greedy, ignore_eos). Prints requests/s and
tokens/s; `--output-json` writes them with the arguments. Uses only the public API."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagellm.benchmarks.datasets import (
    SampleRequest,
    add_dataset_args,
    allowed_token_ids,
    dataset_lengths,
    resolve_lengths,
    token_requests,
)
from pagellm.engine.arg_utils import EngineArgs


@dataclass
class ThroughputResult:
    elapsed_time: float
    num_requests: int
    total_prompt_tokens: int
    total_output_tokens: int
    total_num_tokens: int
    requests_per_second: float
    tokens_per_second: float
    """Prompt + output tokens per second."""
    output_tokens_per_second: float


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser, varied=True, seed=False)
    parser.add_argument("--output-json", default=None, help="Write the results as JSON here.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    EngineArgs.add_cli_args(parser)


def make_llm(args: argparse.Namespace) -> Any:
    from pagellm.entrypoints.llm import LLM

    return LLM(**vars(EngineArgs.from_cli_args(args)))


def vocab_of(llm: Any) -> Any:
    """Token ids a random prompt may use: the tokenizer's vocabulary minus special tokens."""
    tokenizer = llm.get_tokenizer()
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return allowed_token_ids(len(tokenizer), sorted(special))


def run_requests(llm: Any, requests: list[SampleRequest], use_tqdm: bool = False) -> ThroughputResult:
    """Generates every request in one `LLM.generate` call (greedy, ignore_eos, max_tokens =
    its expected output length) and counts the tokens actually produced."""
    from pagellm.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True)
        for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    return ThroughputResult(
        elapsed_time=elapsed,
        num_requests=len(outputs),
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        total_num_tokens=total,
        requests_per_second=len(outputs) / elapsed,
        tokens_per_second=total / elapsed,
        output_tokens_per_second=output_tokens / elapsed,
    )


def print_result(result: ThroughputResult) -> None:
    print(
        f"Throughput: {result.requests_per_second:.2f} requests/s, "
        f"{result.tokens_per_second:.2f} total tokens/s, "
        f"{result.output_tokens_per_second:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {result.total_prompt_tokens}")
    print(f"Total num output tokens:  {result.total_output_tokens}")
    print(f"Elapsed time:             {result.elapsed_time:.2f} s")


def jsonable_args(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags, minus what JSON cannot hold (the subcommand's function)."""
    out = {}
    for key, value in vars(args).items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def main(args: argparse.Namespace) -> int:
    # 1. workload lengths (the aliases must agree before anything loads)
    resolve_lengths(args)
    input_lens, output_lens = dataset_lengths(args)
    # 2. engine and prompts (random ids over the non-special vocabulary)
    llm = make_llm(args)
    try:
        requests = token_requests(input_lens, output_lens, vocab_of(llm), args.seed)
        # 3. one timed generate over all requests
        result = run_requests(llm, requests, use_tqdm=not args.disable_tqdm)
    finally:
        llm.shutdown()
    print_result(result)
    if args.output_json:
        write_json(args.output_json, {**asdict(result), "args": jsonable_args(args)})
    return 0
