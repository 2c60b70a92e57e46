"""Start-up time of the `pagellm` command (issue #15), median of --runs fresh processes:

* `generate`: launch -> first byte of the completion on stdout (`pagellm generate PROMPT
  --max-tokens 8`, run unbuffered so the print is not held back until exit; the command
  prints once all tokens are generated, so this bounds the time to the first token from
  above) and launch -> exit;
* `serve`: launch -> first 200 from /health (a free loopback port), then SIGTERM -> exit;
* the floor no pagellm change removes: `python -c pass` and `python -c "import torch"`
  (the engine-core process imports torch before it can load the model).

    python benchmarks/startup.py [--runs 5] [--cmd pagellm] [--skip serve] [-- extra engine flags]

Runs the pagellm on PYTHONPATH / installed, with warm caches (one untimed run first).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

PROMPT = "The capital of France is"


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def time_python(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())
    return time.perf_counter() - start


def time_generate(cmd: list[str], max_tokens: int, flags: list[str]) -> tuple[float, float]:
    """(launch -> first stdout byte, launch -> exit) of one `generate`."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, "generate", PROMPT, "--max-tokens", str(max_tokens), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(),
    )
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    first_at = time.perf_counter() - start
    rest = proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise SystemExit(f"generate failed (exit {proc.returncode})")
    if not (first + rest).decode().startswith(PROMPT):
        raise SystemExit(f"unexpected output: {(first + rest)!r}")
    return first_at, time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_serve(cmd: list[str], flags: list[str], timeout: float = 120) -> tuple[float, float]:
    """(launch -> first /health 200, SIGTERM -> exit) of one `serve`."""
    port = _free_port()
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, "serve", "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
    )
    url = f"http://127.0.0.1:{port}/health"
    try:
        while True:
            if proc.poll() is not None or time.perf_counter() - start > timeout:
                raise SystemExit(f"serve did not answer /health (exit {proc.returncode})")
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.01)
        ready = time.perf_counter() - start
    finally:
        stop = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return ready, time.perf_counter() - stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=int, default=5, help="Timed runs of each command (median shown)."
    )
    parser.add_argument(
        "--cmd",
        default=f"{shlex.quote(sys.executable)} -m pagellm",
        help="How to launch pagellm, e.g. 'pagellm' for the console script.",
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--skip", action="append", default=[], choices=["generate", "serve", "floor"]
    )
    parser.add_argument("flags", nargs="*", help="Extra engine flags for both commands (after --).")
    args = parser.parse_args()
    cmd = shlex.split(args.cmd)

    rows: list[tuple[str, list[float]]] = []
    if "floor" not in args.skip:
        rows.append(("python -c pass", [time_python("pass") for _ in range(args.runs)]))
        rows.append(
            ("python -c 'import torch'", [time_python("import torch") for _ in range(args.runs)])
        )
    if "generate" not in args.skip:
        time_generate(cmd, args.max_tokens, args.flags)  # warm the caches
        runs = [time_generate(cmd, args.max_tokens, args.flags) for _ in range(args.runs)]
        rows.append(
            (f"generate --max-tokens {args.max_tokens}: first output byte", [r[0] for r in runs])
        )
        rows.append(("generate: exit", [r[1] for r in runs]))
    if "serve" not in args.skip:
        runs = [time_serve(cmd, args.flags) for _ in range(args.runs)]
        rows.append(("serve: first /health 200", [r[0] for r in runs]))
        rows.append(("serve: SIGTERM -> exit", [r[1] for r in runs]))

    print(
        f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, {args.runs} runs, cmd: {args.cmd}"
    )
    print(f"{'phase':<44} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, values in rows:
        print(
            f"{name:<44} {statistics.median(values):>9.2f} {min(values):>7.2f} {max(values):>7.2f}"
        )


if __name__ == "__main__":
    main()
