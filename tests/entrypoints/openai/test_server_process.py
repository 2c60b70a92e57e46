"""`pagellm serve` as a process, on a tiny model: it stops cleanly on SIGTERM, takes its
port before loading the model, answers to several served names, reports start-up
errors in one line, and --disable-log-stats leaves no half-filled metrics."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest

from pagellm.engine.arg_utils import EngineArgs
from tests.entrypoints.openai.conftest import ServerProcess


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("llama")


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "pagellm", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _ipc_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "pagellm-*")))


def test_sigterm_shuts_the_engine_down(model) -> None:
    before = _ipc_dirs()
    srv = ServerProcess(model, "--max-model-len", "256", "--served-model-name", "tiny", "other-name",
                        "--disable-log-requests")
    try:
        engines = [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
                   if "engine_core_proc" in " ".join(p.cmdline())]
        assert len(engines) == 1
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.api_key}"}) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "other-name"]
            r = http.post("/v1/completions", json={"model": "other-name", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "other-name"
            tok = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
            assert tok["token_strs"] == ["hello", "Ġworld"] and len(tok["tokens"]) == 2
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0  # was -15: killed before the engine shut down
        psutil.wait_procs(engines, timeout=10)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engines)
        assert _ipc_dirs() <= before  # the engine's socket directory is gone too
    finally:
        srv.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_the_whole_group_drains(model, tmp_path, sig) -> None:
    """Ctrl-C in a terminal and `kill -- -PGID` signal the server's process group, systemd's
    stop the whole control group (the engine core too): under 4 streams every stream still
    gets its tokens, the server exits 0 and logs no error (the core leaves the signal to
    its frontend, which drains and then stops it)."""
    log = open(tmp_path / "server.log", "w+")
    srv = ServerProcess(model, "--max-model-len", "256", "--shutdown-timeout", "60", new_session=True, stderr=log)
    engines = [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
               if "engine_core_proc" in " ".join(p.cmdline())]
    body = {"prompt": "Hello", "max_tokens": 250, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}

    def stream() -> int:
        tokens = 0
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {srv.api_key}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event  # (the text itself may say "error")
                    tokens = event["usage"]["completion_tokens"] if event.get("usage") else tokens
        return tokens

    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream) for _ in range(4)]
            srv.wait_running(4)
            os.killpg(srv.proc.pid, sig)
            for p in engines:  # as systemd's control-group stop reaches every process
                p.send_signal(sig)
            assert [f.result() for f in futures] == [250] * 4
        assert srv.proc.wait(timeout=60) == 0
        psutil.wait_procs(engines, timeout=10)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engines)
        log.seek(0)
        text = log.read()
        assert " ERROR " not in text and "died" not in text, text[-2000:]
    finally:
        srv.stop()
        log.close()


def test_port_in_use_fails_before_the_model_loads(model) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        result = _serve(model, "--port", str(port))
    assert result.returncode == 2 and time.monotonic() - start < 20
    assert result.stderr.strip().splitlines()[-1] == (
        f"pagellm serve: error: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "Loaded" not in result.stderr  # the model was never loaded


@pytest.mark.parametrize(("env", "message"), [
    ({"PAGELLM_STREAM_BUFFER_TOKENS": "lots"}, "PAGELLM_STREAM_BUFFER_TOKENS must be an integer, got 'lots'."),
    ({"PAGELLM_HTTP_SEND_BUFFER_BYTES": "-1"}, "PAGELLM_HTTP_SEND_BUFFER_BYTES must be >= 0, got -1."),
    ({"PAGELLM_ENGINE_ITERATION_TIMEOUT_S": "0.2"},
     "PAGELLM_ENGINE_ITERATION_TIMEOUT_S must be 0 (no watchdog) or at least 1 second, got 0.2."),
])
def test_bad_reliability_knobs_fail_before_the_model_loads(model, monkeypatch, env, message) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = _serve(model, "--port", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"pagellm serve: error: {message}"
    assert "Loaded" not in result.stderr


def test_engine_startup_error_is_one_line(model) -> None:
    result = _serve(model, "--num-gpu-blocks-override", "4", "--max-model-len", "512", "--port", "0")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pagellm serve: error: Engine core initialization failed: ValueError: "
                           "The KV cache holds 48 tokens (3 blocks of 16), fewer than one sequence of "
                           "max_model_len=512"), last
    assert "Traceback" not in result.stderr.split("Engine core initialization failed")[-1]


def test_disable_log_stats_leaves_no_stale_metrics(model) -> None:
    srv = ServerProcess(model, "--max-model-len", "256", "--disable-log-stats")
    try:
        assert not [k for k in srv.metrics() if k.startswith(("pagellm:", "vllm:"))]
    finally:
        srv.stop()


def test_vllm_flag_spellings() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["-dp", "2", "-tp", "1", "--max-model-len", "32K", "--served-model-name", "a", "b"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.data_parallel_size, engine_args.max_model_len) == (2, 32768)
    assert engine_args.served_model_names == ["a", "b"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", "lots"])


def test_bench_serve_input_errors_are_one_line() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for flags, message in ((["--request-rate", "0"], "error: --request-rate must be > 0 (or inf), got 0"),
                           ([], "error: cannot reach the server at http://127.0.0.1:9: ")):
        result = subprocess.run([sys.executable, "-m", "pagellm", "bench", "serve", "--port", "9",
                                 "--num-prompts", "2", *flags], capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 1 and result.stderr.strip().startswith(message), result.stderr
        assert "Traceback" not in result.stderr


def test_closing_a_merged_stream_early_closes_every_part() -> None:
    """merge_generators (several prompts in one request): leaving early must close each
    prompt's generator cleanly, after its drain task has stopped."""
    import asyncio

    from pagellm.entrypoints.openai.serving_engine import merge_generators

    closed = []

    async def part(i: int):
        try:
            for k in range(100):
                yield k
                await asyncio.sleep(0.01)
        finally:
            closed.append(i)

    async def main() -> None:
        merged = merge_generators([part(0), part(1)])
        async for _ in merged:
            break
        await merged.aclose()  # raised "aclose(): asynchronous generator is already running"

    asyncio.run(main())
    assert sorted(closed) == [0, 1]
