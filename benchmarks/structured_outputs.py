"""Structured outputs: what a constraint costs a CPU decode step, and grammar compile times.

Runs the same batch twice in one engine (in-process, so each engine-core step is timed):
every row constrained by a JSON schema, then no row constrained, and compares the median
decode step (steps where every row decodes one token). The schema keeps every row
generating for the whole run (a string field of at least 400 characters), so both runs
decode the same number of steps at the same batch size. Then compiles the test suite's
random schemas (tests/structured_output/schemas.py) for the model's vocabulary and
reports the median and p99 compile time.

    python benchmarks/structured_outputs.py [--batch 32] [--steps 48] [--model M]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = "0"  # time the engine core's steps here
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

LONG_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400}, "done": {"type": "boolean"}},
    "required": ["story", "done"],
}


def decode_step_times(llm, batch: int, steps: int, constrained: bool) -> list[float]:
    from pagellm import SamplingParams
    from pagellm.sampling_params import StructuredOutputsParams

    core = llm.llm_engine.engine_core.engine_core
    times: list[float] = []
    step = core.step

    def timed_step():
        start = time.perf_counter()
        result = step()
        elapsed = time.perf_counter() - start
        so = core.scheduler
        if len(so.running) == batch and not so.waiting and result[1]:
            times.append(elapsed)
        return result

    core.step = timed_step
    try:
        params = [
            SamplingParams(
                temperature=0.8, seed=i, max_tokens=steps, ignore_eos=not constrained,
                structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA) if constrained else None,
            )
            for i in range(batch)
        ]
        prompts = [f"Write a long story about item {i} as JSON:" for i in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.step = step
    return times[1:]  # the first full-batch step still pays for the prefills' tail


def compile_times(llm) -> list[float]:
    from pagellm.sampling_params import StructuredOutputsParams
    from tests.structured_output.schemas import make_schemas

    manager = llm.llm_engine.engine_core.engine_core.structured_output_manager
    backend = manager._backend("xgrammar")
    backend.compiler.clear_cache()
    out = []
    for schema in make_schemas(64, seed=1):
        start = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=schema))
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=2, help="A/B pairs (constrained, unconstrained)")
    args = ap.parse_args()

    from pagellm import LLM

    llm = LLM(args.model, disable_log_stats=True, enable_prefix_caching=False)
    decode_step_times(llm, 4, 8, True)  # warm-up: loads the grammar backend and tokenizer
    rows = []
    for _ in range(args.repeat):
        for constrained in (True, False):
            t = decode_step_times(llm, args.batch, args.steps, constrained)
            rows.append((constrained, statistics.median(t) * 1000, len(t)))
    for constrained, ms, n in rows:
        print(f"batch {args.batch} {'json-schema' if constrained else 'unconstrained':14s} median decode step "
              f"{ms:7.2f} ms over {n} steps")
    c = statistics.median(ms for k, ms, _ in rows if k)
    u = statistics.median(ms for k, ms, _ in rows if not k)
    print(f"constrained / unconstrained: {c / u:.3f}x (target <= 1.15x)")
    ct = sorted(compile_times(llm))
    p99 = ct[min(len(ct) - 1, int(round(0.99 * (len(ct) - 1))))]
    print(f"compile time over {len(ct)} test schemas: median {statistics.median(ct) * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms, max {ct[-1] * 1000:.1f} ms")
    print(json.dumps({"batch": args.batch, "constrained_ms": c, "unconstrained_ms": u, "ratio": c / u,
                      "compile_median_ms": statistics.median(ct) * 1000, "compile_p99_ms": p99 * 1000}))


if __name__ == "__main__":
    main()
