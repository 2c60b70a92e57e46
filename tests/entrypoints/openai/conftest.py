"""A real `pagellm serve` process on 127.0.0.1 and a free port, for the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

API_KEY = "sk-pagellm-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *extra: str, new_session: bool = False, stderr: Any = None, wait: bool = True):
        """`new_session`: the server leads a process group of its own (a test signals the
        group); `stderr`: where its log goes (default: the test's); `wait`: until it
        serves (else the test calls wait_serving)."""
        self.api_key = API_KEY
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagellm", "serve", "--port", str(self.port), "--api-key", API_KEY,
               "--max-model-len", "1024", *extra]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                     start_new_session=new_session, stderr=stderr)
        if wait:
            self.wait_serving(240)

    def wait_serving(self, within: float) -> None:
        """Until /health answers 200; the server stopped and RuntimeError if it exits first
        or does not answer `within` seconds."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not start")

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def metric(self, prefix: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.startswith(prefix))

    def wait_running(self, n: int, within: float = 60) -> None:
        """Until `n` requests run in the engine(s), or fail: the requests a test sent may
        all have finished before it looked (asserting beats looping forever)."""
        deadline = time.monotonic() + within
        while (running := self.metric("pagellm:num_requests_running")) < n:
            if time.monotonic() > deadline:
                waiting = self.metric("pagellm:num_requests_waiting")
                finished = self.metric("pagellm:request_success_total")
                raise AssertionError(f"{running:g} of {n} requests running after {within} s "
                                     f"({waiting:g} waiting, {finished:g} finished)")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    srv.stop()
