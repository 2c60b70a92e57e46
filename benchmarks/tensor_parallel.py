"""Tensor parallelism against one process on the same model (issue #38: TP = 2, "benchmark
row recorded with its honest ratio"). Writes benchmarks/results/tp-<timestamp>.json.

    python benchmarks/tensor_parallel.py                            # the 1B-shaped file, 2 rounds
    python benchmarks/tensor_parallel.py --model FILE --tp 2 --rounds 3

In turns, A B A B ...: (A) `LLM(MODEL)`, (B) `LLM(MODEL, tensor_parallel_size=N)`, each in
a fresh process with its engine core in its own process (the default). Each measures one
stream (one prompt of --input-len token ids, --output-len tokens out, greedy; decode
tokens/s from the time of a 1-token run subtracted) and a batch (--batch prompts at
once, output tokens/s over the batch's wall time), after one warm-up request. Both
setups split the machine's cores the same way pagellm does by default: A's one process
takes them all, B's ranks a share each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import RESULTS_DIR, describe_machine  # noqa: E402

DEFAULT_MODEL = "/work/models/l1b.gguf"


def measure(model: str, tp: int, input_len: int, output_len: int, batch: int) -> dict:
    """One setup in this process: one stream's decode tokens/s, a batch's output tokens/s."""
    from pagellm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, max_model_len=input_len + output_len + 16, seed=0)
    startup = time.perf_counter() - start
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [(i * 7919 + 13 * j) % (vocab - 1000) + 500 for i in range(input_len)]}
               for j in range(batch)]

    def run(reqs: list, max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate(reqs, params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in out)

    run(prompts[:1], 4)  # warm-up
    first, _ = run(prompts[:1], 1)
    whole, _ = run(prompts[:1], output_len + 1)
    batch_s, batch_tokens = run(prompts, output_len)
    llm.shutdown()
    return {"tp": tp, "startup_s": round(startup, 2),
            "single_decode_tok_s": round(output_len / (whole - first), 2),
            "batch_output_tok_s": round(batch_tokens / batch_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(measure(args.model, args.child, args.input_len, args.output_len,
                                            args.batch)), flush=True)
        return
    runs = []
    for round_ in range(args.rounds):
        for tp in (1, args.tp):
            cmd = [sys.executable, __file__, "--child", str(tp), "--model", args.model,
                   "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--batch", str(args.batch)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            result["round"] = round_
            runs.append(result)
            print(json.dumps(result), flush=True)
    summary = {}
    for key in ("single_decode_tok_s", "batch_output_tok_s"):
        one = statistics.median(r[key] for r in runs if r["tp"] == 1)
        many = statistics.median(r[key] for r in runs if r["tp"] == args.tp)
        summary[key] = {"tp1": one, f"tp{args.tp}": many, "ratio": round(many / one, 3)}
        print(f"{key}: TP=1 {one:.2f}, TP={args.tp} {many:.2f} ({many / one:.2f}x)")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"tp-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"machine": describe_machine(quick=True), "model": args.model, "args": vars(args),
                                "runs": runs, "summary": summary}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
