"""A bounded soak test of `pagellm serve` on loopback: a steady Poisson request rate for a
fixed time, then a per-minute table of requests sent / completed / failed, p50 and p99 TTFT
and TPOT, and the server's resident memory (server + engine-core processes), plus open
file descriptors and threads at the start and the end. Stops by itself.

    python benchmarks/soak.py --minutes 10 --rate 2 [--model M] [-- extra serve flags]

It starts its own server (on a free port, with the default model unless --model), so it
measures a fresh process; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import psutil
from local_server import local_server


@dataclass
class Minute:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _resources(pid: int) -> tuple[float, int, int]:
    """(RSS MiB, open fds, threads) summed over the server and its engine processes."""
    rss = fds = threads = 0
    for p in _tree(pid):
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
            threads += p.num_threads()
        except psutil.NoSuchProcess:
            pass
    return rss / 2**20, fds, threads


async def _one(client: httpx.AsyncClient, minute: Minute, max_tokens: int, rng: random.Random) -> None:
    body = {"prompt": f"Tell me about item {rng.randint(0, 10**6)}.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.7, "stream": True}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                minute.failed += 1
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    minute.failed += 1
                    return
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    tokens += 1
    except httpx.HTTPError:
        minute.failed += 1
        return
    minute.completed += 1
    if first is not None:
        minute.ttft.append(first - start)
        if tokens > 1:
            minute.tpot.append((last - first) / (tokens - 1))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def soak(url: str, pid: int, minutes: float, rate: float, max_tokens: int, seed: int) -> list[Minute]:
    rng = random.Random(seed)
    table = [Minute() for _ in range(int(minutes + 0.999))]
    start = time.monotonic()
    end = start + minutes * 60
    tasks = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        next_sample = start
        while (now := time.monotonic()) < end:
            minute = table[min(int((now - start) // 60), len(table) - 1)]
            if now >= next_sample:
                minute.rss_mib.append(_resources(pid)[0])
                next_sample = now + 5
            minute.sent += 1
            tasks.append(asyncio.ensure_future(_one(client, minute, max_tokens, rng)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_flags", nargs="*", help="extra flags for pagellm serve (after --)")
    args = ap.parse_args()

    with local_server(args.model, args.serve_flags) as (server, url):
        # one request to warm up before the clock starts
        httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120)
        before = _resources(server.pid)
        table = asyncio.run(soak(url, server.pid, args.minutes, args.rate, args.max_tokens, args.seed))
        after = _resources(server.pid)

    print(f"soak: {args.minutes:g} min at {args.rate:g} req/s, {args.max_tokens} tokens each, {url}")
    print("minute  sent  done  failed  TTFT p50/p99 (ms)  TPOT p50/p99 (ms)  RSS MiB (mean)")
    for i, m in enumerate(table):
        rss = statistics.mean(m.rss_mib) if m.rss_mib else float("nan")
        print(f"{i + 1:6d} {m.sent:5d} {m.completed:5d} {m.failed:7d}  {_pct(m.ttft, .5) * 1e3:7.0f} / "
              f"{_pct(m.ttft, .99) * 1e3:7.0f}   {_pct(m.tpot, .5) * 1e3:7.1f} / {_pct(m.tpot, .99) * 1e3:7.1f}"
              f"   {rss:8.1f}")
    sent = sum(m.sent for m in table)
    done = sum(m.completed for m in table)
    failed = sum(m.failed for m in table)
    print(f"total: sent {sent}, completed {done}, failed {failed}")
    print(f"start: RSS {before[0]:.1f} MiB, {before[1]} fds, {before[2]} threads; "
          f"end: RSS {after[0]:.1f} MiB, {after[1]} fds, {after[2]} threads")
    warm = [statistics.mean(m.rss_mib) for m in table[1:] if m.rss_mib]
    if len(warm) >= 2:
        print(f"RSS growth after the first minute: {(warm[-1] - warm[0]) / warm[0] * 100:+.1f}%")


if __name__ == "__main__":
    main()
