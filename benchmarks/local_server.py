"""`pagellm serve` on loopback for the benchmark scripts (soak.py, restart.py): started on a
free port with the given flags, waited for until /health answers 200, stopped on exit.
Run from `benchmarks/` as a sibling module (`python benchmarks/<script>.py`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psutil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(model: str | None, flags: list[str], start_timeout: float = 300) -> Iterator[tuple[subprocess.Popen, str]]:
    """(the server process, its base URL) once /health is 200; SIGTERM and wait on exit."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pagellm", "serve", "--port", str(port), "--max-model-len", "1024",
           *(["--model", model] if model else []), *flags]
    server = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield server, url
    finally:
        server.terminate()
        server.wait(timeout=60)


def metric_sum(text: str, name: str) -> float:
    """The sum of every series of `pagellm:<name>` (all engines, all labels) in a
    /metrics text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((f"pagellm:{name}{{", f"pagellm:{name} ")))


def engine_pid(server_pid: int) -> int:
    """The pid of the (first) engine-core process under a `pagellm serve` process."""
    for p in psutil.Process(server_pid).children(recursive=True):
        if "pagellm.core.engine_core_proc" in p.cmdline():
            return p.pid
    raise RuntimeError("no engine-core process under the server")
