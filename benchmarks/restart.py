"""How fast `pagellm serve --restart-engine-on-failure` recovers from `kill -9` of its
engine core, or (--signal STOP) from a core stopped by SIGSTOP, which the hang watchdog
must find (--engine-iteration-timeout-s, default 60: pass a shorter one after --): it starts its own server (loopback, a free port, the default model unless
--model), keeps a few streams running, kills the engine-core process --kills times, and
prints per kill: the time until every in-flight stream has its 503 error event, the time
until /health is a plain 200 again, and whether the next request succeeds. Stops by itself.

    python benchmarks/restart.py --kills 5 [--model M] [-- extra serve flags]
    python benchmarks/restart.py --kills 3 --signal STOP -- --engine-iteration-timeout-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time

import httpx
from local_server import engine_pid, local_server, metric_sum


async def _stream_until_error(client: httpx.AsyncClient) -> float | None:
    """Streams one long completion; returns when its error event arrived (None if it ended
    without one)."""
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and "error" in json.loads(line[6:]):
                return time.monotonic()
    return None


async def _health_is_plain_200(client: httpx.AsyncClient) -> bool:
    try:
        r = await client.get("/health")
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.content == b""


async def one_kill(client: httpx.AsyncClient, server_pid: int, streams: int, sig: signal.Signals) -> dict:
    tasks = [asyncio.create_task(_stream_until_error(client)) for _ in range(streams)]
    await asyncio.sleep(1.0)  # the streams are decoding
    pid = engine_pid(server_pid)
    killed = time.monotonic()
    os.kill(pid, sig)
    errors = await asyncio.gather(*tasks)
    failed_within = max((t - killed for t in errors if t is not None), default=float("nan"))
    while not await _health_is_plain_200(client):
        await asyncio.sleep(0.05)
    healthy = time.monotonic() - killed
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8})
    return {"streams_failed": sum(t is not None for t in errors), "failed_within_s": failed_within,
            "health_200_s": healthy, "next_request": r.status_code}


async def run(url: str, server_pid: int, kills: int, streams: int, sig: signal.Signals) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        rows = []
        for i in range(kills):
            row = await one_kill(client, server_pid, streams, sig)
            rows.append(row)
            print(f"kill {i + 1}: {row['streams_failed']}/{streams} streams got their 503 within "
                  f"{row['failed_within_s']:.2f} s; /health 200 after {row['health_200_s']:.1f} s; "
                  f"next request {row['next_request']}", flush=True)
        metrics = (await client.get("/metrics")).text
        restarts = metric_sum(metrics, "engine_restarts_total")
        print(f"pagellm:engine_restarts_total = {restarts:g}")
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--streams", type=int, default=4, help="streams in flight at each kill")
    ap.add_argument("--model", default=None)
    ap.add_argument("--signal", choices=["KILL", "STOP"], default="KILL",
                    help="KILL: a death; STOP: a hang, found by the watchdog")
    ap.add_argument("serve_flags", nargs="*", help="extra flags for pagellm serve (after --)")
    args = ap.parse_args()
    with local_server(args.model, ["--restart-engine-on-failure", *args.serve_flags]) as (server, url):
        sig = signal.Signals["SIG" + args.signal]
        rows = asyncio.run(run(url, server.pid, args.kills, args.streams, sig))
        times = [r["health_200_s"] for r in rows]
        print(f"SIG{args.signal} -> /health 200: median {statistics.median(times):.1f} s, max {max(times):.1f} s "
              f"over {len(times)} kills; every stream failed within {max(r['failed_within_s'] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
