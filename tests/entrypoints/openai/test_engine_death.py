"""Killing the engine-core process behind a running server: /health turns 503 and
requests fail fast with an OpenAI error instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil


def test_dead_engine_gives_503_fast(server) -> None:
    engines = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "engine_core_proc" in " ".join(p.cmdline())]
    assert len(engines) == 1
    headers = {"Authorization": f"Bearer {server.api_key}"}
    with httpx.Client(base_url=server.url, timeout=30, headers=headers) as http:
        assert http.get("/health").status_code == 200
        os.kill(engines[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while http.get("/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start = time.monotonic()
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        assert r.status_code == 503
        assert "engine" in r.json()["error"]["message"].lower()
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "stream": True})
        assert r.status_code in (500, 503)
        assert time.monotonic() - start < 2
