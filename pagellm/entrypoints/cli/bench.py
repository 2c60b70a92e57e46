"""`pagellm bench {throughput,latency,serve}`: parser wiring only; the benchmarks live in
`pagellm.benchmarks` (each module has add_cli_args(parser) and main(args))."""

from __future__ import annotations

import argparse
import importlib

_BENCHMARKS = {
    "throughput": ("pagellm.benchmarks.throughput",
                   "Offline throughput of LLM.generate on a synthetic workload."),
    "latency": ("pagellm.benchmarks.latency", "End-to-end latency of generating one batch."),
    "serve": ("pagellm.benchmarks.serve",
              "Load-test an OpenAI-compatible server (pagellm, vLLM, llama.cpp)."),
}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="Benchmarks: throughput, latency, serve.")
    kinds = bench.add_subparsers(dest="bench_type", metavar="{throughput,latency,serve}")
    for name, (module_name, help_text) in _BENCHMARKS.items():
        module = importlib.import_module(module_name)
        p = kinds.add_parser(name, help=help_text, description=help_text)
        module.add_cli_args(p)
        p.set_defaults(func=module.main)
    bench.set_defaults(func=lambda args: bench.print_help() or 2)
