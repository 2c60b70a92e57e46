"""Data parallelism over loopback TCP against the same ranks in one server (issue #38's
target: head + headless >= 0.95x the output tokens/s of `pagellm serve MODEL -dp 2`).
Writes benchmarks/results/dp-loopback-<timestamp>.json.

    python benchmarks/dp_loopback.py                  # default model, 2 rounds
    python benchmarks/dp_loopback.py --rounds 3 --model /work/models/l1b.gguf
    python benchmarks/dp_loopback.py --b ray          # B: the ranks as Ray actors instead

In turns, A B A B ...: (A) one server, `pagellm serve MODEL -dp 2`; (B) a head,
`pagellm serve MODEL -dp 2 --data-parallel-size-local 1 --data-parallel-address 127.0.0.1
--data-parallel-rpc-port P`, and a `--headless` node for rank 1, over loopback TCP. Once
/health is a plain 200 (every rank serving), one warm-up request per rank, then the same
batch against both: --num-prompts requests at once on /v1/completions, fixed token-id
prompts of --input-len ids (seeded, non-special vocabulary), --output-len tokens out
(ignore_eos, temperature 0); output tokens/s over the batch's wall time. Then SIGTERM and
wait. Both "nodes" of B share this machine, so every engine core runs --threads threads
(PAGELLM_NUM_THREADS; default: half the cores, what A's two ranks get by themselves).
With --b ray, B is `pagellm serve MODEL -dp 2 --data-parallel-backend ray`: the server
starts a local Ray cluster (usage stats off, loopback addresses) and its two ranks as Ray
actors, which connect to it over loopback TCP; B's start-up includes Ray's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import RESULTS_DIR, describe_machine, free_port, free_port_pair, system_env  # noqa: E402

DP = 2
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""B with --b ray: Ray reports no usage, and its nodes take the loopback address."""
TARGET = 0.95
"""B's output tokens/s over A's that issue #38 asks for (the median of the rounds)."""


@dataclass
class Run:
    """One setup started, measured and stopped."""

    setup: str  # "A" (one server, -dp 2) or "B" (head + headless over loopback)
    round: int
    startup_s: float = 0.0  # launch to /health 200 with every rank serving
    wall_s: float = 0.0  # the batch: first request sent to last response read
    output_tokens: int = 0
    output_tok_s: float = 0.0
    failed: int = 0
    requests_per_rank: dict[str, float] = field(default_factory=dict)  # the batch's, from /metrics
    exit_codes: dict[str, int | None] = field(default_factory=dict)  # process -> status after SIGTERM
    log_problems: list[str] = field(default_factory=list)  # ERROR / Traceback lines of the logs
    commands: list[list[str]] = field(default_factory=list)


def commands(args: argparse.Namespace, setup: str, http_port: int) -> dict[str, list[str]]:
    """name -> command line of each process of `setup`; the server ("head") comes last."""
    serve = [sys.executable, "-m", "pagellm", "serve", args.model, "-dp", str(DP), *args.pagellm_args.split()]
    http = ["--host", "127.0.0.1", "--port", str(http_port)]
    if setup == "A":
        return {"head": [*serve, *http]}
    if args.b == "ray":
        return {"head": [*serve, *http, "--data-parallel-backend", "ray", "--data-parallel-rpc-port",
                         str(free_port_pair())]}
    rpc = ["--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
           "--data-parallel-rpc-port", str(free_port_pair())]
    return {"node": [*serve, "--headless", "--data-parallel-start-rank", "1", *rpc],
            "head": [*serve, *http, *rpc]}


def build_prompts(args: argparse.Namespace) -> list[list[int]]:
    """--num-prompts token-id prompts of --input-len ids, the same for every run."""
    from pagellm.benchmarks.datasets import allowed_token_ids, token_requests
    from pagellm.model_executor.loader import load_tokenizer

    tok = load_tokenizer(args.model)
    special = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
    vocab = allowed_token_ids(len(tok), sorted(special))
    n = args.num_prompts
    return [r.prompt for r in token_requests([args.input_len] * n, [args.output_len] * n, vocab, args.seed)]


def wait_healthy(url: str, procs: dict[str, subprocess.Popen], timeout: float) -> None:
    """Until GET /health is a plain 200: every rank's core accepted and serving."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} during start-up")
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200 and r.content == b"":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not healthy within {timeout:.0f} s")


def successes_per_rank(url: str) -> dict[str, float]:
    """rank -> finished requests, from the server's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "pagellm:request_success_total":
                rank = s.labels.get("engine", "0")
                counts[rank] = counts.get(rank, 0.0) + s.value
    return counts


async def run_batch(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, int]:
    """All prompts at once; (wall seconds, output tokens, failed requests)."""
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(prompt: list[int]) -> int | None:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            return r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
        wall = time.perf_counter() - start
    ok = [r for r in results if isinstance(r, int)]
    return wall, sum(ok), len(results) - len(ok)


def measure(url: str, run: Run, args: argparse.Namespace, prompts: list[list[int]]) -> None:
    """1. one warm-up request per rank (the balancer alternates); 2. the batch, timed."""
    for i in range(DP):
        r = httpx.post(url + "/v1/completions", timeout=300,
                       json={"prompt": prompts[i][:16], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
    before = successes_per_rank(url)
    run.wall_s, run.output_tokens, run.failed = asyncio.run(run_batch(url, prompts, args.output_len))
    run.output_tok_s = run.output_tokens / run.wall_s
    after = successes_per_rank(url)
    run.requests_per_rank = {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}


def stop(procs: dict[str, subprocess.Popen]) -> dict[str, int | None]:
    """SIGTERM the server first, then the node; wait for each (kill after 60 s)."""
    codes: dict[str, int | None] = {}
    for name in ("head", "node"):
        proc = procs.get(name)
        if proc is None:
            continue
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            codes[name] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes[name] = None  # did not stop on SIGTERM
    return codes


def log_problems(logs: dict[str, Path]) -> list[str]:
    lines = []
    for name, path in logs.items():
        for line in path.read_text(errors="replace").splitlines():
            if "ERROR" in line or "Traceback" in line or "CRITICAL" in line:
                lines.append(f"{name}: {line.strip()[:300]}")
    return lines[:40]


def run_setup(args: argparse.Namespace, setup: str, rnd: int, prompts: list[list[int]], tmp: Path) -> Run:
    """Starts `setup`'s processes (the node before the head), measures, stops them."""
    run = Run(setup=setup, round=rnd)
    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    cmds = commands(args, setup, http_port)
    run.commands = list(cmds.values())
    extra = {"PAGELLM_NUM_THREADS": str(args.threads)} if args.threads > 0 else {}
    if setup == "B" and args.b == "ray":
        extra.update(RAY_ENV)
    env = system_env(extra or None)
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: tmp / f"{setup}{rnd}-{name}.log" for name in cmds}
    launch = time.monotonic()
    try:
        for name, cmd in cmds.items():
            with open(logs[name], "w") as out:
                procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_healthy(url, procs, args.startup_timeout)
        run.startup_s = time.monotonic() - launch
        measure(url, run, args, prompts)
    except Exception as e:
        tails = "\n".join(f"--- {n}:\n{p.read_text(errors='replace')[-1500:]}" for n, p in logs.items())
        raise RuntimeError(f"{setup} round {rnd}: {e}\n{tails}") from e
    finally:
        run.exit_codes = stop(procs)
        run.log_problems = log_problems(logs)
    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model file (default: pagellm's default GGUF).")
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs, run in turns.")
    p.add_argument("--num-prompts", type=int, default=32, help="Requests sent at once.")
    p.add_argument("--input-len", type=int, default=128, help="Prompt token ids per request.")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (ignore_eos).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // DP),
                   help="PAGELLM_NUM_THREADS of every engine core, in A and B (0: unset, each "
                        "setup's own default; B's two nodes then each take every core).")
    p.add_argument("--b", choices=["headless", "ray"], default="headless",
                   help="Setup B: a head and a --headless node, or one server whose ranks are Ray actors.")
    p.add_argument("--pagellm-args", default="", help="Extra `pagellm serve` flags, for every process.")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    if args.model is None:
        from pagellm.model_executor.loader import default_model_path

        args.model = default_model_path()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = describe_machine(quick=True)
    prompts = build_prompts(args)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="pagellm-dp-loopback-") as tmp_name:
        for rnd in range(args.rounds):
            for setup in ("A", "B"):
                print(f"round {rnd + 1}: {setup} ...", flush=True)
                runs.append(run_setup(args, setup, rnd, prompts, Path(tmp_name)))
                r = runs[-1]
                print(f"  {r.output_tok_s:.1f} out tok/s ({r.output_tokens} tokens in {r.wall_s:.2f} s, "
                      f"{r.failed} failed, per rank {r.requests_per_rank}, start-up {r.startup_s:.1f} s, "
                      f"exit {r.exit_codes})", flush=True)
    ratios = [b.output_tok_s / a.output_tok_s
              for a, b in zip(runs[0::2], runs[1::2], strict=True)]
    print(f"\n{'round':>5} {'A out tok/s':>12} {'B out tok/s':>12} {'B / A':>6}")
    for rnd, (a, b, ratio) in enumerate(zip(runs[0::2], runs[1::2], ratios, strict=True)):
        print(f"{rnd + 1:>5} {a.output_tok_s:>12.1f} {b.output_tok_s:>12.1f} {ratio:>6.3f}")
    median = statistics.median(ratios)
    print(f"median B / A: {median:.3f} (target >= {TARGET}: {'met' if median >= TARGET else 'not met'})")
    for r in runs:
        for line in r.log_problems:
            print(f"  log, {r.setup} round {r.round + 1}: {line}")
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"dp-loopback-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    settings = {k: getattr(args, k) for k in ("model", "rounds", "num_prompts", "input_len", "output_len",
                                              "seed", "threads", "b", "pagellm_args")}
    path.write_text(json.dumps({"date": datetime.now().isoformat(timespec="seconds"), "machine": machine,
                                "settings": settings, "ratios": ratios, "median_ratio": median,
                                "target": TARGET, "runs": [asdict(r) for r in runs]}, indent=2) + "\n")
    print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
