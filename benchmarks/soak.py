"""A bounded soak test of `pagellm serve` on loopback: a steady Poisson request rate for a
fixed time, then a table per period (a minute unless --period) of requests sent / completed
/ failed, p50 and p99 TTFT and TPOT, and the server's resident memory (server + engine-core
processes), KV cache use, the longest waiting queue, open file descriptors and threads.
Stops by itself.

    python benchmarks/soak.py --minutes 10 --rate 2 [--model M] [-- extra serve flags]

--mix sends a fixed proportion of request kinds instead of streamed completions only
(MIX below: plain, streamed, structured, tool call, n=2, aborted by the client after a few
tokens, over-long prompt), checks each answer (JSON that fits the schema, a call of the
tool, two choices), and with --kill-at / --stop-at (minutes from the start) sends SIGKILL /
SIGSTOP to the engine core then; the server runs with --restart-engine-on-failure, and
--engine-iteration-timeout-s 10 so the hang watchdog finds a stopped core. Failures are
counted by cause: `fault` (a 503 or error event inside a fault's window, from the signal
until /health is 200 again plus 5 s), `refused` (the over-long prompts' 400, by design)
and anything else by its status and message.

    python benchmarks/soak.py --mix --minutes 60 --period 10 --rate R --kill-at 20 --stop-at 40

It starts its own server (on a free port, with the default model unless --model), so it
measures a fresh process; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import psutil
from local_server import engine_pid, local_server, metric_sum

MIX = {"plain": 20, "stream": 25, "structured": 10, "tool": 10, "n2": 10, "abort": 15, "overlong": 10}
"""Request kinds of --mix and their weights (percent)."""

CITIES = ["Paris", "London", "Tokyo", "Lima", "Oslo", "Cairo"]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"]}}}


@dataclass
class Period:
    sent: int = 0
    completed: int = 0
    failures: Counter = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    kv_perc: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)


@dataclass
class Outcome:
    """What one request did: `ok`, or the failure's cause; `error` says it was a 503 or an
    error event (a fault's signature), to be judged against the fault windows."""

    cause: str = "ok"
    error: bool = False
    ttft: float | None = None
    tpot: float | None = None
    end: float = 0.0


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


async def _gauges(client: httpx.AsyncClient) -> tuple[float, float]:
    """(KV cache use in percent, requests waiting) from /metrics, summed over engines."""
    try:
        text = (await client.get("/metrics", timeout=10)).text
    except httpx.HTTPError:
        return float("nan"), float("nan")
    return metric_sum(text, "kv_cache_usage_perc") * 100, metric_sum(text, "num_requests_waiting")


async def _read_stream(resp: httpx.Response, out: Outcome, start: float, stop_after: int | None,
                       choice_text: str) -> int:
    """Reads an SSE stream: TTFT and TPOT of choice 0, failure on an error event; stops
    reading (closing the connection: the client's abort) after `stop_after` chunks.
    Returns the number of choices seen."""
    first = last = None
    tokens = chunks = 0
    choices = set()
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            chunk = json.loads(line[6:])
        except json.JSONDecodeError:  # an event cut off mid-line (seen once, cause unknown)
            out.cause = f"malformed event: {line[:60]!r}"
            return len(choices)
        if "error" in chunk:
            out.cause, out.error = f"error event {chunk['error'].get('code')}: {chunk['error'].get('message', '')[:60]}", True
            return len(choices)
        for c in chunk.get("choices", []):
            choices.add(c["index"])
            if c["index"] == 0 and choice_text(c):
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += 1
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            break
    if first is not None:
        out.ttft = first - start
        if tokens > 1 and stop_after is None:
            out.tpot = (last - first) / (tokens - 1)
    return len(choices)


def _completion_text(c: dict) -> str:
    return c.get("text") or ""


def _chat_text(c: dict) -> str:
    return (c.get("delta") or {}).get("content") or ""


def _request(kind: str, rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    item = rng.randint(0, 10**6)
    if kind == "plain":
        return "/v1/completions", {"prompt": f"Describe item {item}.", "max_tokens": 32, "temperature": 0.7}
    if kind == "stream":
        return "/v1/completions", {"prompt": f"Tell me about item {item}.", "max_tokens": max_tokens,
                                   "ignore_eos": True, "temperature": 0.7, "stream": True}
    if kind == "structured":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Invent a person number {item}: their name and age."}],
            "max_tokens": 64, "temperature": 0.7,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    if kind == "tool":
        city = rng.choice(CITIES)
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"What is the weather in {city}?"}],
            "tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 64, "temperature": 0.7}
    if kind == "n2":
        return "/v1/completions", {"prompt": f"Name item {item}.", "max_tokens": 24, "n": 2,
                                   "temperature": 0.9, "ignore_eos": True, "stream": True}
    if kind == "abort":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Tell a long story {item}."}],
                                        "max_tokens": 400, "ignore_eos": True, "stream": True}
    if kind == "overlong":
        return "/v1/completions", {"prompt": "word " * 1200 + f"{item}", "max_tokens": 8}
    raise ValueError(kind)


def _check(kind: str, body: dict) -> str:
    """'ok', or what is wrong with a non-streamed answer."""
    choice = body["choices"][0]
    if kind == "structured" and choice["finish_reason"] == "stop":
        try:
            person = json.loads(choice["message"]["content"])
        except json.JSONDecodeError:
            return "invalid JSON"
        if set(person) != {"name", "age"} or not isinstance(person["age"], int):
            return "JSON off the schema"
    if kind == "tool":
        calls = choice["message"].get("tool_calls") or []
        if not calls or calls[0]["function"]["name"] != "get_weather":
            return f"no tool call (finish_reason {choice['finish_reason']})"
    return "ok"


async def _one(client: httpx.AsyncClient, kind: str, body: dict, path: str) -> Outcome:
    out = Outcome()
    start = time.perf_counter()
    try:
        if not body.get("stream"):
            r = await client.post(path, json=body)
            if kind == "overlong":
                if r.status_code == 400 and "maximum context length" in r.text:
                    out.cause = "refused"
                else:
                    out.cause, out.error = f"overlong got {r.status_code}", r.status_code == 503
            elif r.status_code != 200:
                out.cause, out.error = f"status {r.status_code}: {r.text[:60]}", r.status_code == 503
            else:
                out.cause = _check(kind, r.json())
        else:
            async with client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    out.cause, out.error = f"status {resp.status_code}: {resp.text[:60]}", resp.status_code == 503
                else:
                    text = _chat_text if path.endswith("chat/completions") else _completion_text
                    seen = await _read_stream(resp, out, start, 8 if kind == "abort" else None, text)
                    if out.cause == "ok" and kind == "n2" and seen != 2:
                        out.cause = f"n=2 gave {seen} choices"
    except httpx.HTTPError as e:
        out.cause, out.error = f"{type(e).__name__}", True
    out.end = time.monotonic()
    return out


@dataclass
class Faults:
    """Signals to the engine core at given times, and the windows they open: from the
    signal until /health is 200 again, plus a margin."""

    at: list[tuple[float, signal.Signals]]
    windows: list[tuple[float, float]] = field(default_factory=list)
    margin_s: float = 5.0

    def caused(self, start: float, end: float) -> bool:
        return any(start <= w_end and end >= w_start for w_start, w_end in self.windows)

    async def run(self, client: httpx.AsyncClient, server_pid: int, t0: float) -> None:
        for when, sig in sorted(self.at):
            await asyncio.sleep(max(0.0, t0 + when - time.monotonic()))
            pid = engine_pid(server_pid)
            fired = time.monotonic()
            os.kill(pid, sig)
            self.windows.append((fired, float("inf")))
            await asyncio.sleep(1.0)
            while True:
                try:
                    r = await client.get("/health", timeout=5)
                    if r.status_code == 200 and r.content == b"" and engine_pid(server_pid) != pid:
                        break
                except (httpx.HTTPError, RuntimeError):
                    pass
                await asyncio.sleep(0.2)
            back = time.monotonic()
            self.windows[-1] = (fired, back + self.margin_s)
            print(f"[{(fired - t0) / 60:5.1f} min] SIG{sig.name[3:]} to engine core {pid}: /health 200 on a new "
                  f"core after {back - fired:.1f} s", flush=True)


async def soak(url: str, pid: int, minutes: float, period_min: float, rate: float, max_tokens: int,
               seed: int, mix: bool, faults: Faults) -> list[Period]:
    rng = random.Random(seed)
    kinds, weights = list(MIX), list(MIX.values())
    table = [Period() for _ in range(int(minutes / period_min + 0.999))]
    start = time.monotonic()
    end = start + minutes * 60
    pending: list[tuple[Period, float, asyncio.Future]] = []

    def period(t: float) -> Period:
        return table[min(int((t - start) // (period_min * 60)), len(table) - 1)]

    async def sample() -> None:
        while time.monotonic() < end:
            p = period(time.monotonic())
            rss, fds, threads = _resources(pid)
            kv, waiting = await _gauges(client)
            p.rss_mib.append(rss)
            p.fds.append(fds)
            p.threads.append(threads)
            p.kv_perc.append(kv)
            p.waiting.append(waiting)
            await asyncio.sleep(5)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        background = [asyncio.ensure_future(sample()), asyncio.ensure_future(faults.run(client, pid, start))]
        while (now := time.monotonic()) < end:
            kind = rng.choices(kinds, weights)[0] if mix else "stream"
            path, body = _request(kind, rng, max_tokens)
            p = period(now)
            p.sent += 1
            pending.append((p, now, asyncio.ensure_future(_one(client, kind, body, path))))
            await asyncio.sleep(rng.expovariate(rate))
        outcomes = await asyncio.gather(*(f for _, _, f in pending))
        await asyncio.gather(*background)
    for (p, sent_at, _), out in zip(pending, outcomes):
        if out.cause == "ok":
            p.completed += 1
            if out.ttft is not None:
                p.ttft.append(out.ttft)
            if out.tpot is not None:
                p.tpot.append(out.tpot)
        elif out.error and faults.caused(sent_at, out.end):
            p.failures["fault"] += 1
        else:
            p.failures[out.cause] += 1
    return table


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--period", type=float, default=1.0, help="minutes per table row")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens of a streamed completion")
    ap.add_argument("--mix", action="store_true", help="the request kinds of MIX instead of streams only")
    ap.add_argument("--kill-at", type=float, action="append", default=[], help="minute to SIGKILL the engine core")
    ap.add_argument("--stop-at", type=float, action="append", default=[], help="minute to SIGSTOP the engine core")
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_flags", nargs="*", help="extra flags for pagellm serve (after --)")
    args = ap.parse_args()

    flags = list(args.serve_flags)
    if args.mix or args.kill_at or args.stop_at:
        flags = ["--restart-engine-on-failure", "--engine-iteration-timeout-s", "10", *flags]
    faults = Faults([(m * 60, signal.SIGKILL) for m in args.kill_at] + [(m * 60, signal.SIGSTOP) for m in args.stop_at])
    with local_server(args.model, flags) as (server, url):
        # one request to warm up before the clock starts
        httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120)
        before = _resources(server.pid)
        table = asyncio.run(soak(url, server.pid, args.minutes, args.period, args.rate, args.max_tokens,
                                 args.seed, args.mix, faults))
        time.sleep(10)  # idle: every request has ended
        idle_kv, idle_waiting = asyncio.run(_idle_gauges(url))
        after = _resources(server.pid)

    what = "the mix " + " ".join(f"{k} {w}%" for k, w in MIX.items()) if args.mix else f"{args.max_tokens}-token streams"
    print(f"soak: {args.minutes:g} min at {args.rate:g} req/s of {what}, {url}, serve flags {flags}")
    print(f"{'period':>6} {'sent':>5} {'done':>5} {'failed':>6}  TTFT p50/p99 ms   TPOT p50/p99 ms  "
          f"RSS MiB  KV % max  wait max  fds  threads  failures by cause")
    for i, p in enumerate(table):
        causes = ", ".join(f"{c} {n}" for c, n in p.failures.most_common()) or "-"
        print(f"{i + 1:6d} {p.sent:5d} {p.completed:5d} {sum(p.failures.values()):6d}  "
              f"{_pct(p.ttft, .5) * 1e3:6.0f} / {_pct(p.ttft, .99) * 1e3:6.0f}  "
              f"{_pct(p.tpot, .5) * 1e3:6.1f} / {_pct(p.tpot, .99) * 1e3:6.1f}  {_mean(p.rss_mib):7.1f}  "
              f"{max(p.kv_perc, default=float('nan')):7.1f}  {max(p.waiting, default=float('nan')):7.0f}  "
              f"{max(p.fds, default=0):4d}  {max(p.threads, default=0):6d}  {causes}")
    total = Counter()
    for p in table:
        total.update(p.failures)
    print(f"total: sent {sum(p.sent for p in table)}, completed {sum(p.completed for p in table)}, "
          f"failed {sum(total.values())} ({', '.join(f'{c} {n}' for c, n in total.most_common()) or 'none'})")
    print(f"start: RSS {before[0]:.1f} MiB, {before[1]} fds, {before[2]} threads; "
          f"end: RSS {after[0]:.1f} MiB, {after[1]} fds, {after[2]} threads; idle: KV {idle_kv:.1f}%, "
          f"{idle_waiting:.0f} waiting")
    warm = [_mean(p.rss_mib) for p in table[1:] if p.rss_mib]
    if len(warm) >= 2:
        print(f"RSS growth after the first period: {(warm[-1] - warm[0]) / warm[0] * 100:+.1f}%")


async def _idle_gauges(url: str) -> tuple[float, float]:
    async with httpx.AsyncClient(base_url=url) as client:
        return await _gauges(client)


if __name__ == "__main__":
    main()
