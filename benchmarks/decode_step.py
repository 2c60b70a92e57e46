"""Decode steps through the one-region stack (pagellm/kernels/decode_step.c: every kernel of
the step a share of one OpenMP team) against the module path (each kernel a parallel
region of its own, woken and put to sleep again), in one process, alternating.

    python benchmarks/decode_step.py                          # default model, GGUF and float32
    python benchmarks/decode_step.py --quantization none --rows 1 32 64 --rounds 12
    python benchmarks/decode_step.py --rows 0 8 --prompt 128  # mixed steps: a prompt joins each

For each weight path and batch size: `--rows` requests of 128 random prompt tokens are
prefilled, then decode steps run in blocks of 4, the stack and the module path taking
turns (A/B, B/A, ...), so both see the same machine load and nearly the same contexts.
With `--prompt N` a new request of N prompt tokens (one output token) joins every
measured step: the stack attends its rows as decodes over the cache, the module path with
SDPA. The table gives the median ms per step of each and their ratio. On decode steps
both paths run the same kernels and give the same logits
(tests/model_executor/test_fused_ops.py), so the difference is the parallel regions'
wake-ups, plus the module path's Python per layer.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagellm import LLM, SamplingParams
from pagellm.attention.torch_backend import ROW_ATTENTION_MAX_ROWS


def measure(llm: LLM, rows: int, rounds: int, steps: int, prompt: int) -> dict[str, list[float]]:
    engine = llm.llm_engine
    decoder = engine.engine_core.engine_core.model_runner.model.model  # in-process core
    rng = random.Random(rows)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=0)
    ids = [f"r{rows}-{i}" for i in range(rows)]
    for rid in ids:
        tokens = [rng.randrange(100, 40000) for _ in range(128)]
        engine.add_request(rid, {"prompt_token_ids": tokens}, params)
    for _ in range(3):  # the prefill, then warm decode steps
        engine.step()
    stack = decoder.fused_decode
    if stack is None or ROW_ATTENTION_MAX_ROWS < rows + prompt:
        engine.abort_request(ids)
        raise SystemExit(f"the one-region stack does not take {rows + prompt} rows of this model")
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    made = 0
    times: dict[str, list[float]] = {"stack": [], "modules": []}
    try:
        for r in range(rounds):
            for name in ("stack", "modules") if r % 2 == 0 else ("modules", "stack"):
                decoder.fused_decode = stack if name == "stack" else None
                start = time.perf_counter()
                for _ in range(steps):
                    if prompt:  # a new request whose whole prompt joins this step
                        made += 1
                        ids_p = [rng.randrange(100, 40000) for _ in range(prompt)]
                        engine.add_request(f"p{rows}-{made}", {"prompt_token_ids": ids_p}, one)
                    engine.step()
                times[name].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        decoder.fused_decode = stack
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Default: pagellm's default model.")
    p.add_argument("--quantization", nargs="+", default=["gguf", "none"],
                   help="Weight paths: gguf (blocks kept), none (float32).")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=10, help="A/B rounds (default: 10)")
    p.add_argument("--steps", type=int, default=4, help="Steps per turn (default: 4)")
    p.add_argument("--prompt", type=int, default=0,
                   help="Tokens of a new prompt that joins every measured step (a mixed "
                        "step: its rows attended as decodes over the cache); default 0")
    args = p.parse_args()
    results = []
    for quantization in args.quantization:
        kwargs = {} if args.model is None else {"model": args.model}
        llm = LLM(quantization=quantization, multiprocess_mode=False,
                  max_num_seqs=max(args.rows) + 1, **kwargs)
        # a first forward builds the stack (a run with --rows 0 has no other before timing)
        llm.generate([{"prompt_token_ids": [101, 102, 103]}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
        for rows in args.rows:
            times = measure(llm, rows, args.rounds, args.steps, args.prompt)
            results.append((quantization, rows, times))
        del llm
    print("| weights | decode rows | prompt rows | stack ms/step | module path ms/step | stack / module path |")
    print("| --- | --- | --- | --- | --- | --- |")
    for quantization, rows, times in results:
        stack, modules = (statistics.median(times[k]) for k in ("stack", "modules"))
        print(f"| {quantization} | {rows} | {args.prompt} | {stack:.1f} | {modules:.1f} "
              f"| {stack / modules:.2f} |")


if __name__ == "__main__":
    main()
