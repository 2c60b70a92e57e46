"""`pagellm bench latency`: wall time of generating one batch end to end (prompt of
--input-len random token ids, --output-len tokens each, greedy, ignore_eos), repeated
--num-iters times after --num-iters-warmup; prints the mean and percentiles."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from pagellm.benchmarks.datasets import token_requests
from pagellm.benchmarks.throughput import jsonable_args, make_llm, vocab_of, write_json
from pagellm.engine.arg_utils import EngineArgs

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=8, help="Requests per batch.")
    parser.add_argument("--input-len", type=int, default=32, help="Prompt tokens per request.")
    parser.add_argument("--output-len", type=int, default=128, help="Output tokens per request.")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="Untimed batches first.")
    parser.add_argument("--num-iters", type=int, default=30, help="Timed batches.")
    parser.add_argument("--output-json", default=None, help="Write the latencies as JSON here.")
    EngineArgs.add_cli_args(parser)


def measure(llm: Any, prompts: list[dict], params: Any, warmup: int, iters: int) -> list[float]:
    """Seconds per `generate` of the whole batch, `iters` times after `warmup` untimed runs.
    The prefix cache is reset before each run so every run computes the prompt."""
    latencies = []
    for i in range(warmup + iters):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if i >= warmup:
            latencies.append(time.perf_counter() - start)
    return latencies


def main(args: argparse.Namespace) -> int:
    from pagellm.sampling_params import SamplingParams

    if min(args.batch_size, args.input_len, args.output_len, args.num_iters) < 1:
        raise SystemExit("error: --batch-size, --input-len, --output-len, --num-iters must be >= 1")
    llm = make_llm(args)
    try:
        batch = token_requests([args.input_len] * args.batch_size,
                               [args.output_len] * args.batch_size, vocab_of(llm), args.seed)
        prompts = [{"prompt_token_ids": r.prompt} for r in batch]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        latencies = measure(llm, prompts, params, args.num_iters_warmup, args.num_iters)
    finally:
        llm.shutdown()
    values = np.percentile(latencies, PERCENTILES)
    percentiles = {str(p): float(v) for p, v in zip(PERCENTILES, values)}
    avg = float(np.mean(latencies))
    print(f"Avg latency: {avg:.4f} s")
    for p, v in percentiles.items():
        print(f"{p}% percentile latency: {v:.4f} s")
    if args.output_json:
        write_json(args.output_json, {
            "avg_latency": avg,
            "latencies": latencies,
            "percentiles": percentiles,
            "args": jsonable_args(args),
        })
    return 0
