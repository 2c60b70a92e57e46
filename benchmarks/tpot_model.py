"""What median TTFT and TPOT a serving engine can reach at a given load, from a step-cost
model instead of a run: each step costs `fixed + per_decode * decodes + per_prompt *
prompt tokens`, requests arrive as a Poisson stream, and steps are scheduled the way
pagellm's scheduler does it (running decodes first, then prompt chunks up to the token
budget, first come first served, optionally at most `max_running` requests at once).

    python benchmarks/tpot_model.py                                   # the fitted costs
    python benchmarks/tpot_model.py --fixed-ms 28 --per-decode-ms 3.5  # a cheaper decode

Fit the three costs on the machine at hand (a batch-32 decode step and a 4096-token
prefill, see benchmarks/README.md); the model then answers "how far would making the
decode cheaper move TPOT" without building it.
"""

from __future__ import annotations

import argparse
from collections import deque

import numpy as np


def simulate(fixed: float, per_decode: float, per_prompt: float, rate: float, num_requests: int,
             input_len: int, output_len: int, budget: int, max_running: int, seed: int) -> tuple[float, float]:
    """Returns (median TTFT, median TPOT) in seconds for one seeded arrival sequence."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, num_requests)) if rate != float("inf") else np.zeros(num_requests)
    arrivals -= arrivals[0]
    waiting: deque[int] = deque()
    running: dict[int, list[int]] = {}  # request -> [prompt tokens computed, tokens generated]
    first_token: dict[int, float] = {}
    done: dict[int, float] = {}
    now, next_arrival = 0.0, 0
    while len(done) < num_requests:
        while next_arrival < num_requests and arrivals[next_arrival] <= now:
            waiting.append(next_arrival)
            next_arrival += 1
        if not waiting and not running:
            now = arrivals[next_arrival]
            continue
        decodes = [r for r, (computed, _) in running.items() if computed >= input_len]
        left = budget - len(decodes)
        chunks: list[tuple[int, int]] = []
        for r, (computed, _) in running.items():  # unfinished prompts first, then new ones
            if computed < input_len and left > 0:
                chunks.append((r, min(input_len - computed, left)))
                left -= chunks[-1][1]
        while waiting and left > 0 and len(running) < max_running:
            r = waiting.popleft()
            running[r] = [0, 0]
            chunks.append((r, min(input_len, left)))
            left -= chunks[-1][1]
        now += fixed + per_decode * len(decodes) + per_prompt * sum(n for _, n in chunks)
        for r in decodes:
            running[r][1] += 1
            if running[r][1] == output_len:
                done[r] = now
                del running[r]
        for r, n in chunks:
            running[r][0] += n
            if running[r][0] >= input_len:
                running[r][1] = 1
                first_token[r] = now
    ttft = np.array([first_token[i] - arrivals[i] for i in range(num_requests)])
    tpot = np.array([done[i] - first_token[i] for i in range(num_requests)]) / (output_len - 1)
    return float(np.median(ttft)), float(np.median(tpot))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fixed-ms", type=float, default=40.0, help="Cost of a step whatever it holds.")
    p.add_argument("--per-decode-ms", type=float, default=5.0, help="Cost of each decode token in a step.")
    p.add_argument("--per-prompt-ms", type=float, default=2.0, help="Cost of each prompt token in a step.")
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-running", type=int, default=10**9, help="Cap on requests running at once.")
    p.add_argument("--seeds", type=int, default=10, help="Arrival sequences averaged.")
    a = p.parse_args()
    results = [
        simulate(a.fixed_ms / 1e3, a.per_decode_ms / 1e3, a.per_prompt_ms / 1e3, a.request_rate, a.num_prompts,
                 a.input_len, a.output_len, a.max_num_batched_tokens, a.max_running, seed)
        for seed in range(a.seeds)
    ]
    ttft, tpot = np.mean(results, axis=0) * 1e3
    print(f"median TTFT {ttft:.0f} ms, median TPOT {tpot:.0f} ms (mean over {a.seeds} arrival sequences)")


if __name__ == "__main__":
    main()
