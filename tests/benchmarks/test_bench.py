"""`pagellm bench throughput|latency|serve` and benchmarks/compare.py, run as a user runs
them (subprocesses, tiny workloads): every JSON field is written, token counts are exact,
the --input-len / --random-input-len aliases agree or fail, workloads are seeded."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from pagellm.benchmarks import datasets, latency, serve, throughput
from tests.utils import import_benchmark

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}

THROUGHPUT_FIELDS = ("elapsed_time", "num_requests", "total_num_tokens", "total_output_tokens",
                     "total_prompt_tokens", "requests_per_second", "tokens_per_second",
                     "output_tokens_per_second", "args")
SERVE_FIELDS = (
    "date", "base_url", "endpoint", "model_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")),
    "input_lens", "output_lens", "ttfts", "itls", "e2els", "generated_texts", "errors",
)


def pagellm_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm", *args], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _parser(add) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add(p)
    return p


# -- workloads and flags (no model) ----------------------------------------------------


def test_random_lengths_follow_range_ratio_and_seed() -> None:
    ins, outs = datasets.random_lengths(200, 100, 50, 0.2, seed=3)
    assert all(80 <= n <= 120 for n in ins) and all(40 <= n <= 60 for n in outs)
    assert len(set(ins)) > 10  # really varied
    assert (ins, outs) == datasets.random_lengths(200, 100, 50, 0.2, seed=3)
    assert datasets.random_lengths(3, 16, 8, 0.0, seed=0) == ([16] * 3, [8] * 3)


def test_varied_lengths_stay_in_bounds() -> None:
    ins, outs = datasets.varied_lengths(500, 16, 512, 16, 256, seed=0)
    assert min(ins) >= 16 and max(ins) <= 512 and min(outs) >= 16 and max(outs) <= 256
    assert max(ins) - min(ins) > 300


def test_token_prompts_avoid_special_ids() -> None:
    vocab = datasets.allowed_token_ids(50, special_ids=[0, 1, 2])
    reqs = datasets.token_requests([30] * 20, [4] * 20, vocab, seed=0)
    ids = {t for r in reqs for t in r.prompt}
    assert ids.isdisjoint({0, 1, 2}) and max(ids) < 50
    assert all(len(r.prompt) == r.prompt_len == 30 for r in reqs)


def test_text_prompts_have_requested_word_count() -> None:
    reqs = datasets.text_requests([5, 12], [3, 4], seed=0)
    assert [len(str(r.prompt).split()) for r in reqs] == [5, 12]
    assert [r.expected_output_len for r in reqs] == [3, 4]


@pytest.mark.parametrize("add", [throughput.add_cli_args, serve.add_cli_args])
def test_input_len_is_an_alias_of_random_input_len(add) -> None:
    parser = _parser(add)
    for argv in (["--input-len", "16"], ["--random-input-len", "16"],
                 ["--input-len", "16", "--random-input-len", "16"]):
        args = parser.parse_args(["--output-len", "8", *argv])
        datasets.resolve_lengths(args)
        assert (args.random_input_len, args.random_output_len) == (16, 8)
    args = parser.parse_args(["--input-len", "16", "--random-input-len", "17"])
    with pytest.raises(SystemExit, match="--random-input-len"):
        datasets.resolve_lengths(args)


def test_serve_defaults_suit_a_small_machine_and_throughput_keeps_vllms() -> None:
    args = _parser(serve.add_cli_args).parse_args([])
    datasets.resolve_lengths(args, default_in=serve.SERVE_INPUT_LEN)
    assert (args.num_prompts, args.random_input_len, args.random_output_len) == (64, 256, 128)
    args = _parser(throughput.add_cli_args).parse_args([])
    datasets.resolve_lengths(args)
    assert (args.num_prompts, args.random_input_len, args.random_output_len) == (1000, 1024, 128)


def test_varied_dataset_flags() -> None:
    args = _parser(throughput.add_cli_args).parse_args(
        ["--dataset-name", "varied", "--num-prompts", "50", "--min-input-len", "4",
         "--max-input-len", "8", "--min-output-len", "2", "--max-output-len", "3"])
    datasets.resolve_lengths(args)
    ins, outs = datasets.dataset_lengths(args)
    assert len(ins) == 50 and set(ins) <= set(range(4, 9)) and set(outs) == {2, 3}


def test_latency_flags_parse() -> None:
    args = _parser(latency.add_cli_args).parse_args(["--batch-size", "3", "--num-iters", "2"])
    assert (args.batch_size, args.num_iters, args.input_len) == (3, 2, 32)


def test_cli_rejects_conflicting_lengths_before_loading() -> None:
    res = pagellm_cli("bench", "throughput", "--num-prompts", "2", "--input-len", "16",
                      "--random-input-len", "32", timeout=120)
    assert res.returncode != 0
    assert "--random-input-len (32) and --input-len (16)" in res.stderr


# -- offline benchmarks ----------------------------------------------------------------


def test_bench_throughput_json(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    res = pagellm_cli("bench", "throughput", "--num-prompts", "4", "--random-input-len", "16",
                      "--random-output-len", "8", "--output-json", str(out), "--disable-tqdm")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "output tokens/s" in res.stdout
    data = json.loads(out.read_text())
    assert set(THROUGHPUT_FIELDS) <= set(data)
    assert data["num_requests"] == 4
    assert data["total_prompt_tokens"] == 64 and data["total_output_tokens"] == 32
    assert data["total_num_tokens"] == 96
    assert data["output_tokens_per_second"] == pytest.approx(32 / data["elapsed_time"])
    assert data["args"]["random_input_len"] == 16 and data["args"]["num_prompts"] == 4


def test_bench_latency_json(tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    res = pagellm_cli("bench", "latency", "--batch-size", "2", "--input-len", "8",
                      "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1",
                      "--output-json", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert len(data["latencies"]) == 2
    assert set(data["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert data["avg_latency"] == pytest.approx(float(np.mean(data["latencies"])))


# -- serving benchmark against a real `pagellm serve` -----------------------------------


@pytest.fixture(scope="module")
def server_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pagellm", "serve", "--port", str(port),
                             "--max-model-len", "512"], env=ENV, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}"
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_pagellm(server_url: str, tmp_path: Path, endpoint: str) -> None:
    num, out_len = (4, 8) if endpoint == "/v1/completions" else (2, 4)
    res = pagellm_cli("bench", "serve", "--base-url", server_url, "--endpoint", endpoint,
                      "--num-prompts", str(num), "--random-input-len", "32",
                      "--random-output-len", str(out_len), "--ignore-eos", "--request-rate", "20",
                      "--save-result", "--result-dir", str(tmp_path), "--result-filename",
                      "r.json", "--disable-tqdm")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Successful requests:" in res.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(SERVE_FIELDS) <= set(data)
    assert data["completed"] == num and data["failed"] == 0
    assert data["output_lens"] == [out_len] * num  # from the usage chunk, exact with ignore_eos
    assert data["total_output_tokens"] == num * out_len
    assert all(0 < t <= e for t, e in zip(data["ttfts"], data["e2els"]))
    assert all(len(gaps) >= 1 for gaps in data["itls"])
    if endpoint == "/v1/completions":  # word prompts: one token per word for this tokenizer
        assert data["input_lens"] == [32] * num


# -- compare.py -------------------------------------------------------------------------


def test_compare_quick_writes_table(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "benchmarks/compare.py", "--quick", "--systems", "pagellm,vllm",
         "--results-dir", str(tmp_path)],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert {"cpu_model", "logical_cores", "ram_gib", "torch_version", "matmul_gflops_fp32",
            "matmul_gflops_bf16", "copy_bandwidth_gbs", "read_bandwidth_gbs"} <= set(data["machine"])
    assert data["machine"]["read_bandwidth_gbs"] > 0
    rows = {(r["system"], r["workload"]): r for r in data["rows"]}
    assert set(rows) == {(s, w) for s in ("pagellm", "vllm") for w in ("W", "V", "S", "P")}
    # a pagellm run that failed is a row with its error as the note: say it
    assert [(key, r["note"]) for key, r in rows.items() if key[0] == "pagellm" and r["output_tokens"] is None] == []
    w = rows[("pagellm", "W")]
    assert w["output_tokens"] == 4 * 8 and w["prompt_tokens"] == 4 * 16
    assert w["ratio_to_pagellm"] == 1.0 and w["output_tokens_per_s"] > 0
    assert w["peak_rss_mb"] > 50 and w["peak_pss_mb"] > 50 and w["startup_s"] > 0
    assert w["decode_tokens_per_s"] is None and len(w["runs"]) == 1
    assert rows[("pagellm", "V")]["output_tokens"] > 0
    s = rows[("pagellm", "S")]  # one request, timed per token
    assert s["output_tokens"] == 16 and s["prompt_tokens"] == 16
    assert s["decode_tokens_per_s"] > 0 and 0 < s["ttft_s"] < s["elapsed_s"]
    assert s["weight_bytes_per_token"] == data["weight_bytes"]["bytes_per_token"] > 0
    assert s["read_bandwidth_share"] == pytest.approx(
        s["weight_bytes_per_token"] * s["decode_tokens_per_s"] / (data["machine"]["read_bandwidth_gbs"] * 1e9))
    assert w["read_bandwidth_share"] is None  # batched: no single-stream decode rate
    p = rows[("pagellm", "P")]  # one 64-token prompt, one output token
    assert (p["prompt_tokens"], p["output_tokens"]) == (64, 1) and p["decode_tokens_per_s"] is None
    assert p["prompt_tokens_per_s"] == pytest.approx(64 / p["ttft_s"]) and p["read_bandwidth_share"] is None
    assert rows[("vllm", "W")]["note"].startswith("skipped")
    assert 0 < data["machine_share"]["W"]["share"]
    # the limit is the faster matmul of the two dtypes (bfloat16 on AMX CPUs)
    machine, share = data["machine"], data["machine_share"]["W"]
    faster = "bf16" if machine["matmul_gflops_bf16"] > machine["matmul_gflops_fp32"] else "fp32"
    assert share["matmul_dtype"] == faster and f"peak {faster} matmul" in res.stdout
    assert "vs pagellm" in res.stdout and "peak PSS MiB" in res.stdout and "of read bw" in res.stdout


_FAKE_LLAMA_BENCH = """#!/usr/bin/env python3
import json, sys
a = sys.argv
val = lambda f, d: int(a[a.index(f) + 1]) if f in a else d
p, n, d = val("-p", 512), val("-n", 128), val("-d", 0)
pg = [int(x) for x in a[a.index("-pg") + 1].split(",")] if "-pg" in a else None
ts = {"pp": 400.0, "tg": 100.0}
tests = []
if p:
    tests.append({"n_prompt": p, "n_gen": 0, "n_depth": d, "avg_ts": ts["pp"], "avg_ns": int(p / ts["pp"] * 1e9)})
if n:
    tests.append({"n_prompt": 0, "n_gen": n, "n_depth": d, "avg_ts": ts["tg"], "avg_ns": int(n / ts["tg"] * 1e9)})
if pg:
    t = pg[0] / ts["pp"] + pg[1] / ts["tg"]
    tests.append({"n_prompt": pg[0], "n_gen": pg[1], "n_depth": d, "avg_ts": sum(pg) / t, "avg_ns": int(t * 1e9)})
print(json.dumps(tests))
"""


def test_compare_single_stream_repeats_both_pagellm_paths(tmp_path: Path) -> None:
    """S through pagellm's quantized and float32 paths and llama-bench (a stand-in script
    with llama-bench's JSON), two rounds each in a-b-a-b order: medians and every run."""
    bench = tmp_path / "llama-bench"
    bench.write_text(_FAKE_LLAMA_BENCH)
    bench.chmod(0o755)
    res = subprocess.run(
        [sys.executable, "benchmarks/compare.py", "--quick", "--workloads", "S",
         "--systems", "pagellm,pagellm-f32,llamacpp-bench", "--llama-bench", str(bench),
         "--repeat", "2", "--results-dir", str(tmp_path)],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    order = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("running ")]
    assert order == ["pagellm", "pagellm-f32", "llamacpp-bench"] * 2
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert data["repeat"] == 2
    rows = {r["system"]: r for r in data["rows"]}
    assert rows["pagellm"]["details"]["llm_kwargs"] == {}
    assert rows["pagellm-f32"]["note"] == "quantization=none"
    assert rows["pagellm-f32"]["details"]["llm_kwargs"] == {"quantization": "none"}
    for name in ("pagellm", "pagellm-f32"):
        r = rows[name]
        assert len(r["runs"]) == 2 and r["output_tokens"] == 16
        assert r["output_tokens_per_s"] == pytest.approx(
            sum(x["output_tokens_per_s"] for x in r["runs"]) / 2)
        assert r["peak_pss_mb"] > 50 and r["decode_tokens_per_s"] > 0
    lb = rows["llamacpp-bench"]  # 16 in at 400 tok/s, 16 out at 100 tok/s
    assert lb["output_tokens_per_s"] == pytest.approx(16 / (16 / 400 + 16 / 100), rel=1e-3)
    assert lb["decode_tokens_per_s"] == 100.0 and lb["ttft_s"] == pytest.approx(0.04)
    assert lb["startup_s"] is None and "tg16 @ d16" in lb["note"]
    assert lb["settings"].startswith("llama-bench -t ") and "-b 2048 -ub 512 -r 5" in lb["settings"]
    assert rows["pagellm-f32"]["settings"].startswith('LLM(**{"quantization": "none"}')
    assert "median of 2 runs" in res.stdout
    # of read bw: the file's blocks for the quantized path and llama.cpp, float32 for pagellm-f32
    weights, read = data["weight_bytes"], data["machine"]["read_bandwidth_gbs"] * 1e9
    assert rows["pagellm"]["weight_bytes_per_token"] == lb["weight_bytes_per_token"] == weights["bytes_per_token"]
    assert rows["pagellm-f32"]["weight_bytes_per_token"] == weights["float32_bytes_per_token"]
    assert lb["read_bandwidth_share"] == pytest.approx(weights["bytes_per_token"] * 100.0 / read)
    for name in ("pagellm", "pagellm-f32"):
        r = rows[name]
        assert r["read_bandwidth_share"] == pytest.approx(
            r["weight_bytes_per_token"] * r["decode_tokens_per_s"] / read)


def test_compare_prompt_workload(tmp_path: Path) -> None:
    """P (one 64-token prompt, one output token, quick): pagellm's TTFT and prompt tok/s,
    and llama-bench's `-p 64 -n 0` (a stand-in at 400 prompt tok/s), the ratio on prompt
    tok/s."""
    bench = tmp_path / "llama-bench"
    bench.write_text(_FAKE_LLAMA_BENCH)
    bench.chmod(0o755)
    res = subprocess.run(
        [sys.executable, "benchmarks/compare.py", "--quick", "--workloads", "P",
         "--systems", "pagellm,llamacpp-bench", "--llama-bench", str(bench), "--results-dir", str(tmp_path)],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == {"pagellm", "llamacpp-bench"} and data["workloads"]["P"]["input_range"] == [64, 64]
    p = rows["pagellm"]
    assert (p["workload"], p["prompt_tokens"], p["output_tokens"]) == ("P", 64, 1)
    assert 0 < p["ttft_s"] <= p["elapsed_s"] and p["prompt_tokens_per_s"] == pytest.approx(64 / p["ttft_s"])
    assert p["decode_tokens_per_s"] is None and p["read_bandwidth_share"] is None
    assert p["ratio_to_pagellm"] == 1.0
    lb = rows["llamacpp-bench"]
    assert lb["details"]["commands"][0][-4:] == ["-p", "64", "-n", "0"] and len(lb["details"]["commands"]) == 1
    assert lb["ttft_s"] == pytest.approx(64 / 400) and lb["prompt_tokens_per_s"] == pytest.approx(400)
    assert lb["ratio_to_pagellm"] == pytest.approx(400 / p["prompt_tokens_per_s"])
    assert lb["note"] == "llama-bench: pp64" and lb["output_tokens"] == 1
    assert "prompt tok/s" in res.stdout


def test_compare_active_rows_start_with_spinning_openmp_threads(tmp_path: Path) -> None:
    """pagellm-f32-active runs the float32 path with OMP_WAIT_POLICY=ACTIVE in its
    process's environment from launch (libgomp reads it when torch loads); the default
    row keeps pagellm's PASSIVE."""
    res = subprocess.run(
        [sys.executable, "benchmarks/compare.py", "--quick", "--workloads", "S",
         "--systems", "pagellm-f32,pagellm-f32-active", "--results-dir", str(tmp_path)],
        env={k: v for k, v in ENV.items() if k != "OMP_WAIT_POLICY"}, cwd=ROOT,
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (path,) = tmp_path.glob("*.json")
    rows = {r["system"]: r for r in json.loads(path.read_text())["rows"]}
    active, default = rows["pagellm-f32-active"], rows["pagellm-f32"]
    assert active["settings"].startswith('OMP_WAIT_POLICY=ACTIVE LLM(**{"quantization": "none"}')
    assert active["details"]["omp_wait_policy"] == "ACTIVE"
    assert default["details"]["omp_wait_policy"] == "PASSIVE"
    assert active["output_tokens"] == default["output_tokens"] == 16


_FAKE_BATCHED_BENCH = """#!/usr/bin/env python3
import json, sys
a = sys.argv
val = lambda f: int(a[a.index(f) + 1])
pp, tg, pl = val("-npp"), val("-ntg"), val("-npl")
assert val("-c") >= pl * (pp + tg) and "jsonl" in a
t_pp, t_tg = pl * pp / 500.0, pl * tg / 50.0
print("some log line", file=sys.stderr)
print(json.dumps({"n_kv_max": val("-c"), "n_batch": val("-b"), "n_ubatch": val("-ub"), "pp": pp,
                  "tg": tg, "pl": pl, "t_pp": t_pp, "speed_pp": 500.0, "t_tg": t_tg, "speed_tg": 50.0,
                  "t": t_pp + t_tg, "speed": pl * (pp + tg) / (t_pp + t_tg)}))
"""


def test_compare_llamacpp_batched_runs_fixed_length_workloads(tmp_path: Path) -> None:
    """llama-batched-bench (a stand-in with its JSONL line) on W and S: B x TG over its
    total time, its flags on the row; V (varied lengths) is skipped."""
    bench = tmp_path / "llama-batched-bench"
    bench.write_text(_FAKE_BATCHED_BENCH)
    bench.chmod(0o755)
    res = subprocess.run(
        [sys.executable, "benchmarks/compare.py", "--quick", "--systems", "llamacpp-batched",
         "--llama-batched-bench", str(bench), "--llamacpp-args=-ub 256",
         "--results-dir", str(tmp_path)],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (path,) = tmp_path.glob("*.json")
    rows = {r["workload"]: r for r in json.loads(path.read_text())["rows"]}
    w = rows["W"]  # 4 sequences x (16 in at 500 tok/s, 8 out at 50 tok/s)
    assert w["output_tokens"] == 32 and w["prompt_tokens"] == 64
    assert w["output_tokens_per_s"] == pytest.approx(32 / (64 / 500 + 32 / 50), rel=1e-4)
    assert w["decode_tokens_per_s"] is None and w["startup_s"] is None
    assert w["settings"].startswith("llama-batched-bench -c 96 -t ")
    assert "-b 2048 -ub 512 -ub 256 -npp 16 -ntg 8 -npl 4" in w["settings"]
    s = rows["S"]
    assert s["decode_tokens_per_s"] == 50.0 and s["ttft_s"] == pytest.approx(16 / 500)
    assert rows["V"]["note"].startswith("skipped: one prompt length")
    assert "llama-batched-bench -c 96" in res.stdout


def test_peer_settings_best_and_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The best-settings rows carry the documented env and flags; the *-default rows only
    what the workload needs."""
    compare = import_benchmark("compare")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    args = compare.parse_args(["--model", "m.gguf", "--vllm-venv", str(tmp_path),
                               "--llama-server", "/bin/llama-server"])
    env, removed = compare.vllm_env(args, "vllm")
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and removed == ()
    assert str(tmp_path / "lib" / "libiomp5.so") in env["LD_PRELOAD"].split(":")
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=0" in compare.vllm_settings(env, "LLM()")
    env, removed = compare.vllm_env(args, "vllm-default")
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "4"} and removed == ("VLLM_CPU_KVCACHE_SPACE",)
    assert "vLLM's defaults otherwise" in compare.vllm_settings(env, "LLM()", best=False)
    log = "INFO x\nOpenMP thread binding info: \n\tlocal_world_size=1, reserve_cpu_num=0\n" \
          "\tlocal_rank=0, core ids=[0, 1]\n\treserved_cpus=[]\nINFO y"
    assert compare.vllm_log_lines(log) == ["OpenMP thread binding info:", "local_world_size=1, "
                                           "reserve_cpu_num=0", "local_rank=0, core ids=[0, 1]",
                                           "reserved_cpus=[]"]
    cores = str(compare.physical_cores())
    cmd, slots, _, settings = compare.llamacpp_server_command(args, 8000, 100, 64)
    assert slots == 64 and settings.startswith("llama-server -np 64 -c 6400 ")
    assert cmd[cmd.index("-t") + 1] == cores and cmd[cmd.index("-tb") + 1] == cores
    assert cmd[cmd.index("-b") + 1] == "2048" and cmd[cmd.index("-ub") + 1] == "512"
    cmd, _, _, settings = compare.llamacpp_server_command(args, 8000, 100, 64, best=False)
    assert "-t" not in cmd and "-b" not in cmd and "llama.cpp's defaults" in settings
    assert "vllm-default" not in compare.parse_args(["--model", "m"]).systems.split(",")


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_and_read_bandwidth_share(tmp_path: Path, tied: bool) -> None:
    """Weight bytes per decoded token of a tiny synthetic GGUF, counted here from each
    tensor's values and its type's block size: every tensor once but the embedding, of
    which one row, unless the head is tied to it (no output.weight: then all of it); and
    the share of the read bandwidth a decode rate takes."""
    import gguf

    from pagellm.benchmarks.synthetic_gguf import SHAPES, write_llama_gguf

    compare = import_benchmark("compare")
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(str(path), SHAPES["tiny"], "q4_k_m", tied=tied)
    shape = SHAPES["tiny"]
    h = shape["hidden"]

    def size(t) -> int:  # bytes of a tensor from its element count and type
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        return int(t.n_elements) // block * type_size

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert ("output.weight" in tensors) is not tied
    embd = tensors.pop("token_embd.weight")
    assert int(embd.n_elements) == shape["vocab"] * h
    block, type_size = gguf.GGML_QUANT_SIZES[embd.tensor_type]
    row = h // block * type_size
    expected = sum(size(t) for t in tensors.values()) + (size(embd) if tied else row)
    expected_f32 = 4 * (sum(int(t.n_elements) for t in tensors.values()) + (shape["vocab"] * h if tied else h))
    weights = compare.weight_bytes(str(path))
    assert weights["bytes_per_token"] == expected and weights["float32_bytes_per_token"] == expected_f32
    assert weights["tied_head"] is tied and weights["embedding_row_bytes"] == row
    assert weights["embedding_bytes"] == size(embd) and weights["file_bytes"] == path.stat().st_size
    assert compare.bandwidth_share(2e9, 10.0, 40.0) == 0.5

    Row = compare.Row
    rows = [Row("pagellm", "S", decode_tokens_per_s=50.0, details={"quantization": "gguf"}),
            Row("pagellm-f32", "S", decode_tokens_per_s=20.0, details={"quantization": None}),
            Row("llamacpp-bench", "S", decode_tokens_per_s=80.0), Row("hf", "S", decode_tokens_per_s=5.0),
            Row("vllm", "S", decode_tokens_per_s=30.0), Row("pagellm", "W", decode_tokens_per_s=50.0,
                                                           details={"quantization": "gguf"}),
            Row("pagellm", "P", details={"quantization": "gguf"})]
    compare.fill_bandwidth_shares(rows, weights, 25.0)
    got = [(r.weight_bytes_per_token, r.read_bandwidth_share) for r in rows]
    assert got[0] == (expected, pytest.approx(expected * 50 / 25e9))
    assert got[1] == (expected_f32, pytest.approx(expected_f32 * 20 / 25e9))
    assert got[2] == (expected, pytest.approx(expected * 80 / 25e9))
    assert got[3] == (expected_f32, pytest.approx(expected_f32 * 5 / 25e9))
    assert got[4:] == [(None, None)] * 3  # vLLM's dtype is its own; W and P are not decode rows


def test_resolve_model_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--model default / a synthetic shape name (written once under the cache dir) / a path."""
    from pagellm.model_executor.loader import default_model_path

    compare = import_benchmark("compare")
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    assert compare.resolve_model(None) == compare.resolve_model("default") == default_model_path()
    assert compare.resolve_model("some/model.gguf") == "some/model.gguf"
    path = Path(compare.resolve_model("tiny"))
    assert path == tmp_path / "synthetic" / "tiny-q4_k_m.gguf" and path.stat().st_size > 0
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left
    mtime = path.stat().st_mtime_ns
    assert compare.resolve_model("tiny") == str(path) and path.stat().st_mtime_ns == mtime
    assert compare.weight_bytes(str(path))["tied_head"] is False


def test_compare_run_order_and_medians() -> None:
    compare = import_benchmark("compare")
    assert compare.run_order(["a", "b"], 3, "abab") == ["a", "b"] * 3
    assert compare.run_order(["a", "b"], 3, "abba") == ["a", "b", "b", "a", "a", "b"]
    outs = [{"output_tokens": 256, "prompt_tokens": 128, "elapsed_s": e, "ready_time": 5.0,
             "launch_time": 1.0, "tree_peak_rss_mb": m, "tree_peak_pss_mb": m / 2,
             "decode_tokens_per_s": d, "ttft_s": 0.1} for e, m, d in ((2.0, 300, 150.0), (4.0, 500, 70.0),
                                                                       (2.56, 400, 110.0))]
    row = compare.make_row("pagellm", "S", outs)
    assert row.output_tokens_per_s == 100.0 and row.decode_tokens_per_s == 110.0
    assert row.peak_rss_mb == 500 and row.peak_pss_mb == 250 and row.startup_s == 4.0
    assert [r["output_tokens_per_s"] for r in row.runs] == [128.0, 64.0, 100.0]


def test_compare_serve_writes_table(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "benchmarks/compare_serve.py", "--systems", "pagellm,pagellm-f32,llamacpp",
         "--num-prompts", "3", "--input-len", "16", "--output-len", "4",
         "--request-rates", "10,inf", "--pagellm-args", "--max-model-len 256",
         "--results-dir", str(tmp_path)],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (path,) = tmp_path.glob("serve-*.json")
    data = json.loads(path.read_text())
    assert data["settings"]["num_prompts"] == 3 and "matmul_gflops_fp32" in data["machine"]
    pagellm_rows = [r for r in data["rows"] if r["system"] == "pagellm"]
    assert [r["request_rate"] for r in pagellm_rows] == [10.0, "inf"]
    for r in pagellm_rows:
        assert r["completed"] == 3 and r["failed"] == 0 and r["ratio_to_pagellm"] == 1.0
        assert r["settings"] == "pagellm serve --max-model-len 256"
        assert r["output_throughput"] > 0 and r["median_ttft_ms"] > 0 and r["startup_s"] > 0
        assert r["peak_rss_mb"] > 50
    f32_rows = [r for r in data["rows"] if r["system"] == "pagellm-f32"]
    assert [(r["request_rate"], r["completed"]) for r in f32_rows] == [(10.0, 3), ("inf", 3)]
    assert f32_rows[0]["settings"] == "pagellm serve --max-model-len 256 --quantization none"
    assert data["rows"][-1] == {"system": "llamacpp", "note": "skipped: pass --llama-server or --llamacpp-venv"}
    assert "TPOT p50 ms" in res.stdout


def test_tpot_model_matches_hand_counted_schedules() -> None:
    """benchmarks/tpot_model.py on loads small enough to count by hand."""
    simulate = import_benchmark("tpot_model").simulate
    args = dict(fixed=0.01, per_decode=0.002, per_prompt=0.001, input_len=100, output_len=5, max_running=10**9, seed=0)
    # one request: a 0.11 s prefill step yields the first token, then 4 decode steps of 0.012 s
    ttft, tpot = simulate(rate=float("inf"), num_requests=1, budget=2048, **args)
    assert ttft == pytest.approx(0.11) and tpot == pytest.approx(0.012)
    # two at once, budget 150: step 1 = 100 + 50 prompt tokens (0.16 s, first token of #0),
    # step 2 = #0's decode + #1's last 50 (0.062 s, first token of #1), then 3 steps of two
    # decodes (0.014 s; #0 done) and #1's last one alone (0.012 s)
    ttft, tpot = simulate(rate=float("inf"), num_requests=2, budget=150, **args)
    assert ttft == pytest.approx((0.16 + 0.222) / 2)
    assert tpot == pytest.approx(((0.062 + 3 * 0.014) / 4 + (3 * 0.014 + 0.012) / 4) / 2)
    # a cap of one running request serves them one after the other
    _, tpot_capped = simulate(rate=float("inf"), num_requests=2, budget=2048, **{**args, "max_running": 1})
    assert tpot_capped == pytest.approx(0.012)
