"""pagellm's throughput on a quiet machine and beside one CPU-bound neighbour
(`python -c "while True: pass"`, one core), for OpenMP thread settings given as
environment overrides. Every run is its own `pagellm bench throughput` subprocess, so
the settings are in the environment before torch (and libgomp) starts.

    python benchmarks/contention.py                   # before (libgomp's default spin) vs after
    python benchmarks/contention.py --rounds 3 --num-prompts 16 --input-len 64 --output-len 32
    python benchmarks/contention.py --setting passive=OMP_WAIT_POLICY=PASSIVE --setting after=

Settings run in turn within each round (A/B/A/B...), quiet then busy. The table gives the
median output tokens/s of each setting quiet and busy and the slowdown busy/quiet; the
machine's 1-minute load before each run is printed too, so a disturbed run shows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# "before": libgomp's default with no OMP_WAIT_POLICY (spin ~300000 iterations, a few ms,
# before sleeping), which is what pagellm ran with before it chose a policy itself.
# "after": pagellm's own choice (no override).
DEFAULT_SETTINGS = ("before=GOMP_SPINCOUNT=300000", "after=")


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    """`name=VAR=value,VAR=value` (or `name=` for no overrides) -> (name, env)."""
    name, _, rest = text.partition("=")
    env = {}
    for item in filter(None, rest.split(",")):
        var, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--setting {text!r}: expected VAR=value, got {item!r}")
        env[var] = value
    return name, env


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs so far, from /proc/stat (steal counts as busy)."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_until_quiet(max_busy: float, max_wait_s: float) -> float:
    """Waits (up to max_wait_s) for a 2-second window in which the CPUs are at most
    max_busy % busy; returns the last window's busy %."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, t0 = _cpu_jiffies()
        time.sleep(2.0)
        b1, t1 = _cpu_jiffies()
        busy = 100.0 * (b1 - b0) / max(t1 - t0, 1)
        if busy <= max_busy or time.monotonic() > deadline:
            return busy


def measured(run: Callable[[], float]) -> tuple[float, float]:
    """(output tokens/s, others' share of the machine during the run in %): the CPU time
    the whole machine spent minus what this script's children (the benchmark, its
    engine core, the neighbour) spent."""
    hz = os.sysconf("SC_CLK_TCK")
    busy0, total0 = _cpu_jiffies()
    mine0, start = _children_cpu_s(), time.monotonic()
    tps = run()
    busy1, total1 = _cpu_jiffies()
    mine = _children_cpu_s() - mine0
    elapsed = time.monotonic() - start
    others = max((busy1 - busy0) / hz - mine, 0.0)
    return tps, 100.0 * others / (elapsed * (os.cpu_count() or 1))


def run_once(env_overrides: dict[str, str], args: argparse.Namespace) -> float:
    """One `pagellm bench throughput` in a fresh process; returns output tokens/s."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "GOMP_", "KMP_")) and k != "PAGELLM_NUM_THREADS"}
    env.update(env_overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "pagellm", "bench", "throughput", "--disable-tqdm",
               "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--output-json", out.name,
               *args.engine_args]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=None if args.verbose else subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())["output_tokens_per_second"]


def run_beside_neighbour(env: dict[str, str], args: argparse.Namespace) -> float:
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let it settle on a core
        return run_once(env, args)
    finally:
        neighbour.kill()
        neighbour.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--setting", action="append", default=None,
                        help="name=VAR=value,... (repeatable); default: before and after")
    parser.add_argument("--rounds", type=int, default=3, help="A/B/A... rounds (default: 3)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-others", type=float, default=10.0,
                        help="Wait for other programs to use at most this %% of the CPUs before "
                             "a run, and run again if they used more during it (default: 10)")
    parser.add_argument("--retries", type=int, default=2, help="Runs again at most this often (default: 2)")
    parser.add_argument("--max-wait", type=float, default=120.0,
                        help="Seconds to wait for quiet before running anyway (default: 120)")
    parser.add_argument("--verbose", action="store_true", help="Show the runs' logs.")
    parser.add_argument("engine_args", nargs="*", help="Extra flags for bench throughput (after --).")
    args = parser.parse_args()

    settings = [parse_setting(s) for s in (args.setting or DEFAULT_SETTINGS)]
    results: dict[tuple[str, str], list[float]] = {}
    others_seen: list[float] = []
    for r in range(args.rounds):
        for name, env in settings:
            for condition in ("quiet", "busy"):
                run = run_once if condition == "quiet" else run_beside_neighbour
                for _ in range(args.retries + 1):
                    before = wait_until_quiet(args.max_others, args.max_wait)
                    tps, others = measured(lambda run=run, env=env: run(env, args))
                    print(f"round {r + 1} {name:>10} {condition:>5}: {tps:7.1f} out tok/s "
                          f"(others: {before:.0f}% of the CPUs before, {others:.0f}% during)", flush=True)
                    if others <= args.max_others:
                        break
                    print("  others used the machine during the run: again", flush=True)
                results.setdefault((name, condition), []).append(tps)
                others_seen.append(others)

    print(f"\n{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out; "
          f"median of {args.rounds}; {os.cpu_count()} CPUs; other programs used "
          f"{statistics.median(others_seen):.0f}% (median), {max(others_seen):.0f}% (most) of "
          "the CPUs during the kept runs")
    print(f"| setting | env | quiet out tok/s | busy out tok/s | busy slowdown | quiet vs {settings[0][0]} |")
    print("| --- | --- | --- | --- | --- | --- |")
    base_quiet = statistics.median(results[(settings[0][0], "quiet")])
    for name, env in settings:
        quiet = statistics.median(results[(name, "quiet")])
        busy = statistics.median(results[(name, "busy")])
        env_text = " ".join(f"{k}={v}" for k, v in env.items()) or "(pagellm's default)"
        print(f"| {name} | `{env_text}` | {quiet:.1f} | {busy:.1f} | {quiet / busy:.2f}x "
              f"| {quiet / base_quiet:.2f} |")


if __name__ == "__main__":
    main()
