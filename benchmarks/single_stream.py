"""One conversation's decode speed, pagellm and llama-bench in turns.

    python benchmarks/single_stream.py --model llama-3.2-1b --llama-bench $B/llama-bench
    python benchmarks/single_stream.py --model llama-3.1-8b --tokens 40 --rounds 6 --llama-bench ...

On a shared machine the speed drifts 20-30% within minutes, so one run of each engine
compares two moments, not two engines. Here one live `LLM()` (pagellm's default: the
engine core in its own process) and llama-bench take turns, round after round: pagellm
generates --tokens greedy tokens after a 128-token prompt (its rate: the median decode
step of the request), then `llama-bench -p 0 -n TOKENS -r 1` runs on the same file with
compare.py's best settings (one thread per physical core, llama.cpp's batch sizes) in the
user's own environment (compare.system_env). Prints each round and the median of the
rounds' ratios; without --llama-bench, pagellm's rounds alone.

`--prompt N` measures prompt processing instead (the prompt workload P): pagellm prefills
an N-token prompt of its own each round (prompt tokens / the time to the first token,
max_tokens 1), llama-bench runs `-p N -n 0`.

    python benchmarks/single_stream.py --model llama-3.2-1b --prompt 512 --rounds 6 --llama-bench ...

`--llama-bench-args` passes more flags to it: ik_llama.cpp's llama-bench with its run-time
repack is `--llama-bench $IK/llama-bench --llama-bench-args='-rtr 1'`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from typing import Any

import compare

PROMPT = [1 + (i * 7) % 1000 for i in range(128)]


def pagellm_round(engine: Any, request_id: str, tokens: int) -> float:
    """Decode tok/s of one request: 1 / the median step after the first two."""
    from pagellm import SamplingParams

    engine.add_request(request_id, {"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return 1 / statistics.median(steps[2:])


def pagellm_prompt_round(engine: Any, request_id: str, tokens: int, round_: int) -> float:
    """Prompt tok/s of one request: its own prompt (no prefix-cache hit), one output token."""
    from pagellm import SamplingParams

    prompt = [1 + (i * 7 + 13 * round_) % 1000 + 1000 * (i % 3) for i in range(tokens)]
    engine.add_request(request_id, {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, temperature=0))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / (time.perf_counter() - start)


def llama_bench_round(llama_bench: str, model: str, tokens: int, prompt: int = 0,
                      extra: tuple[str, ...] = ()) -> float:
    cmd = [llama_bench, "-m", model, *compare.llamacpp_threads()[:2], *compare.LLAMACPP_BATCH,
           "-p", str(prompt), "-n", "0" if prompt else str(tokens), "-r", "1", "-o", "json", *extra]
    out = subprocess.run(cmd, env=compare.system_env(), capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[-1]["avg_ts"])


def run(model: str, tokens: int, rounds: int, llama_bench: str | None, prompt: int = 0,
        extra: tuple[str, ...] = ()) -> dict[str, Any]:
    from pagellm import LLM

    if tokens < 4:
        raise ValueError(f"--tokens {tokens}: at least 4 (the first two steps are not counted)")
    engine = LLM(model, max_model_len=max(1024, prompt + 16)).llm_engine
    pagellm_round(engine, "warm-up", 4)
    if prompt:
        pagellm_prompt_round(engine, "warm-up-prompt", prompt, rounds)
    ours, peer = [], []
    for r in range(rounds):
        ours.append(pagellm_prompt_round(engine, f"round-{r}", prompt, r) if prompt
                    else pagellm_round(engine, f"round-{r}", tokens))
        line = f"round {r}: pagellm {ours[-1]:.2f} tok/s"
        if llama_bench:
            peer.append(llama_bench_round(llama_bench, model, tokens, prompt, extra))
            line += f"  llama-bench {peer[-1]:.2f}  ratio {ours[-1] / peer[-1]:.3f}"
        print(line, flush=True)
    result = {"model": model, "tokens": tokens, "prompt": prompt, "pagellm": ours, "llama_bench": peer or None,
              "median_ratio": statistics.median(a / b for a, b in zip(ours, peer)) if peer else None}
    print(f"median pagellm {statistics.median(ours):.2f} tok/s"
          + (f", llama-bench {statistics.median(peer):.2f}, median ratio {result['median_ratio']:.3f}"
             if peer else ""))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="a GGUF path, 'default', or a synthetic shape (llama-3.2-1b, llama-3.1-8b)")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--llama-bench", default=None, help="llama-bench binary (else pagellm alone)")
    p.add_argument("--prompt", type=int, default=0,
                   help="measure prompt processing of this many tokens instead of decode")
    p.add_argument("--llama-bench-args", default="",
                   help="more llama-bench flags, e.g. '-rtr 1' for ik_llama.cpp's run-time repack")
    args = p.parse_args()
    run(compare.resolve_model(args.model), args.tokens, args.rounds, args.llama_bench, args.prompt,
        tuple(args.llama_bench_args.split()))


if __name__ == "__main__":
    main()
