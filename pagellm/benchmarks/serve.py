"""`pagellm bench serve`: a load generator for any OpenAI-compatible server (pagellm,
vLLM, llama.cpp). Random word prompts go out as streamed /v1/completions or
/v1/chat/completions requests (Poisson arrivals, optional concurrency cap); per request
it times the first token, the gaps between chunks and the end, and reports the aggregate."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np

from pagellm.benchmarks.datasets import (
    SampleRequest,
    add_dataset_args,
    dataset_lengths,
    resolve_lengths,
    text_requests,
)

_TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)


@dataclass
class RequestInput:
    url: str
    model: str
    prompt: str
    prompt_len: int
    output_len: int
    chat: bool
    ignore_eos: bool
    temperature: float
    extra_body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    """Prompt tokens: the server's usage figure, else the workload's estimate."""
    output_tokens: int = 0
    """Completion tokens: the server's usage figure, else the number of content chunks."""
    ttft: float = 0.0
    """Seconds from sending to the first non-empty content chunk."""
    itl: list[float] = field(default_factory=list)
    """Seconds between consecutive content chunks."""
    latency: float = 0.0
    """Seconds from sending to the end of the stream."""
    generated_text: str = ""
    error: str = ""


# -- one request ----------------------------------------------------------------------


def _payload(inp: RequestInput) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": inp.model,
        "max_tokens": inp.output_len,
        "temperature": inp.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inp.chat:
        body["messages"] = [{"role": "user", "content": inp.prompt}]
    else:
        body["prompt"] = inp.prompt
    if inp.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **inp.extra_body}


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(session: aiohttp.ClientSession, inp: RequestInput) -> RequestResult:
    """Streams one request and times it. Never raises: failures land in `.error`."""
    out = RequestResult(prompt_len=inp.prompt_len)
    chunks, usage = 0, None
    start = last = time.perf_counter()
    try:
        async with session.post(inp.url, json=_payload(inp), headers=inp.headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators and ': ping' comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])[:500]
                    return out
                usage = chunk.get("usage") or usage
                text = _chunk_text(chunk, inp.chat)
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                chunks += 1
                out.generated_text += text
        out.latency = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    if usage:
        out.output_tokens = int(usage.get("completion_tokens") or chunks)
        out.prompt_len = int(usage.get("prompt_tokens") or inp.prompt_len)
    else:
        out.output_tokens = chunks
    out.success = chunks > 0
    if not out.success:
        out.error = "the stream ended without any content"
    return out


# -- the run --------------------------------------------------------------------------


async def arrival_delays(num: int, rate: float, burstiness: float, seed: int) -> Any:
    """Yields request indices on schedule: gaps are Gamma(burstiness, 1/(rate*burstiness))
    (burstiness 1 = Poisson arrivals with mean rate `rate`); rate inf = all at once."""
    rng = np.random.default_rng(seed)
    for i in range(num):
        yield i
        if math.isinf(rate) or i == num - 1:
            continue
        await asyncio.sleep(float(rng.gamma(burstiness, 1.0 / (rate * burstiness))))


async def run_requests(
    inputs: list[RequestInput], rate: float, burstiness: float, max_concurrency: int | None,
    seed: int, show_progress: bool,
) -> tuple[list[RequestResult], float]:
    """Sends every input on the arrival schedule (at most `max_concurrency` in flight);
    returns the results in input order and the wall time of the whole run."""
    from tqdm.auto import tqdm

    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(inputs), disable=not show_progress)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=_TIMEOUT, connector=connector) as session:

        async def one(inp: RequestInput) -> RequestResult:
            if semaphore is None:
                result = await send_request(session, inp)
            else:
                async with semaphore:
                    result = await send_request(session, inp)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        async for i in arrival_delays(len(inputs), rate, burstiness, seed):
            tasks.append(asyncio.create_task(one(inputs[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    stats = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
             f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        stats[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def calculate_metrics(
    results: list[RequestResult], duration: float, percentiles: list[float]
) -> dict[str, Any]:
    """Aggregate figures over the successful requests (vLLM's field names)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    metrics.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    metrics.update(_stats("tpot", tpots, percentiles))
    metrics.update(_stats("itl", [g for r in ok for g in r.itl], percentiles))
    metrics.update(_stats("e2el", [r.latency for r in ok], percentiles))
    return metrics


def print_metrics(m: dict[str, Any], percentiles: list[float]) -> None:
    line = "=" * 50
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [
        ("Successful requests:", m["completed"]),
        ("Failed requests:", m["failed"]),
        ("Benchmark duration (s):", f"{m['duration']:.2f}"),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}"),
    ]
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{title:-^50}")
        for stat in ["mean", "median"] + [f"p{p:g}" for p in percentiles]:
            label = f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {name.upper()} (ms):"
            print(f"{label:<40}{m[f'{stat}_{name}_ms']:<10.2f}")
    print(line)


# -- CLI ------------------------------------------------------------------------------


SERVE_NUM_PROMPTS = 64
SERVE_INPUT_LEN = 256
"""`pagellm bench serve`'s default workload: 64 requests of 256 prompt tokens (128 out),
a couple of minutes against the default model on 2 cores. vLLM's defaults, 1000 x 1024,
take an hour there; pass `--num-prompts 1000 --random-input-len 1024` for them."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="Server URL, e.g. http://127.0.0.1:8000 "
                   "(default: http://HOST:PORT).")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions or /v1/chat/completions.")
    g.add_argument("--model", default=None, help="Model name to request (default: the first "
                   "id listed by GET /v1/models).")
    g.add_argument("--served-model-name", default=None, help="Name to request when --model is "
                   "the model's path (which then also serves as --tokenizer), as in vLLM.")
    g.add_argument("--backend", default="openai", choices=["openai", "vllm", "openai-chat"],
                   help="vLLM's spelling of the endpoint: openai-chat = /v1/chat/completions.")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY).")
    g.add_argument("--tokenizer", default=None, help="Tokenizer (HF dir, hub id or .gguf) used "
                   "to cut prompts to exactly --random-input-len tokens; without it, one "
                   "common word ~ one token.")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Mean requests per second (Poisson arrivals); inf = all at once.")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="Gamma shape of the arrival gaps (1 = Poisson).")
    load.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight.")
    load.add_argument("--ignore-eos", action="store_true", help="Send 'ignore_eos: true'.")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--extra-body", type=json.loads, default=None,
                      help="JSON object merged into every request body.")
    load.add_argument("--metric-percentiles", default="99", help="Comma-separated, e.g. 50,90,99.")
    load.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                      help="Accepted as in vLLM; TTFT, TPOT, ITL and E2EL are all reported.")
    load.add_argument("--disable-tqdm", action="store_true")
    add_dataset_args(parser, varied=True, seed=True, num_prompts=SERVE_NUM_PROMPTS,
                     input_len=SERVE_INPUT_LEN)
    out = parser.add_argument_group("results")
    out.add_argument("--save-result", action="store_true", help="Write the results as JSON.")
    out.add_argument("--result-dir", default=None, help="Directory of the JSON (default: cwd).")
    out.add_argument("--result-filename", default=None, help="File name of the JSON.")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags of `pagellm bench serve` (for callers that drive it from Python)."""
    parser = argparse.ArgumentParser(prog="pagellm bench serve")
    add_cli_args(parser)
    return parser.parse_args(argv)


async def fetch_model_id(base_url: str, headers: dict[str, str]) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.get(base_url + "/v1/models", headers=headers) as resp:
            resp.raise_for_status()
            models = (await resp.json())["data"]
    if not models:
        raise SystemExit(f"error: {base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


def build_inputs(args: argparse.Namespace, model: str, url: str,
                 headers: dict[str, str]) -> list[RequestInput]:
    tokenizer = None
    if args.tokenizer:
        from pagellm.model_executor.loader import load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(args.tokenizer))
    input_lens, output_lens = dataset_lengths(args)
    samples: list[SampleRequest] = text_requests(input_lens, output_lens, args.seed, tokenizer)
    return [
        RequestInput(url=url, model=model, prompt=str(s.prompt), prompt_len=s.prompt_len,
                     output_len=s.expected_output_len, chat="chat" in args.endpoint,
                     ignore_eos=args.ignore_eos, temperature=args.temperature,
                     extra_body=args.extra_body or {}, headers=headers)
        for s in samples
    ]


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark the flags describe; returns the metrics, the per-request lists
    and the settings (what --save-result writes)."""
    # 1. where to send, as whom, which model
    resolve_lengths(args, default_in=SERVE_INPUT_LEN)
    if not args.request_rate > 0:
        raise SystemExit(f"error: --request-rate must be > 0 (or inf), got {args.request_rate:g}")
    if args.backend == "openai-chat" and args.endpoint == "/v1/completions":
        args.endpoint = "/v1/chat/completions"
    if args.served_model_name and args.model and not args.tokenizer:
        args.tokenizer = args.model  # vLLM: --model names the model, --served-model-name the request
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.served_model_name or args.model or await fetch_model_id(base_url, headers)
    except aiohttp.ClientError as e:
        raise SystemExit(f"error: cannot reach the server at {base_url}: {e}") from None
    inputs = build_inputs(args, model, base_url + args.endpoint, headers)
    # 2. one short request first, so a misconfigured run fails fast with the server's error
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
        probe = RequestInput(**{**vars(inputs[0]), "output_len": min(inputs[0].output_len, 2)})
        check = await send_request(session, probe)
    if not check.success:
        raise SystemExit(f"error: the test request to {probe.url} failed: {check.error}")
    # 3. the timed run
    results, duration = await run_requests(inputs, args.request_rate, args.burstiness,
                                           args.max_concurrency, args.seed, not args.disable_tqdm)
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    metrics = calculate_metrics(results, duration, percentiles)
    print_metrics(metrics, percentiles)
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "num_prompts": len(inputs),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(benchmark(args))
    if args.save_result:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        name = args.result_filename or (
            f"openai-{rate}qps-{os.path.basename(result['model_id'])}-{result['date']}.json")
        path = os.path.join(args.result_dir or ".", name)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"Results written to {path}")
    return 0 if result["failed"] == 0 else 1
