"""Every script in examples/ runs and prints what it says, so none can rot: the offline
ones on their own, the `openai` clients against a `pagellm serve` process, and the
data-parallel server script with a client against it."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.conftest import ServerProcess, _free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(script: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_every_example_is_tested() -> None:
    tested = {"offline_inference.py", "chat.py", "async_streaming.py", "openai_completion_client.py",
              "openai_chat_client.py", "data_parallel_server.sh"}
    assert {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")} == tested


def test_offline_inference() -> None:
    out = _run("offline_inference.py")
    prompts = re.findall(r"^Prompt: '(.*)'$", out, re.MULTILINE)
    assert prompts == ["Hello, my name is", "The president of the United States is",
                       "The capital of France is", "The future of AI is"]
    assert len(re.findall(r"^Generated text: '.+'$|^Generated text: \".+\"$", out, re.MULTILINE)) == 4
    assert "Prompt: 'The capital of France is'\nGenerated text: ' Paris." in out


def test_chat() -> None:
    out = _run("chat.py")
    assert out.startswith("Assistant: ")
    assert "User: What is the capital of France?\nAssistant: " in out
    assert "User: Name a prime number larger than 10.\nAssistant: " in out
    assert "Paris" in out


def test_async_streaming() -> None:
    out = _run("async_streaming.py")
    # deltas of both requests, each finishing once, then the joined texts
    assert out.count("[req-0] finished: length") == 1 and out.count("[req-1] finished: length") == 1
    deltas = {rid: "" for rid in ("req-0", "req-1")}
    for rid, delta in re.findall(r"^\[(req-\d)\] ('.*'|\".*\")$", out, re.MULTILINE):
        deltas[rid] += ast.literal_eval(delta)  # the script printed each delta's repr()
    assert f"\nThe capital of France is{deltas['req-0']}\n" in out
    assert f"\nOnce upon a time{deltas['req-1']}" in out
    assert deltas["req-0"].startswith(" Paris")


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    srv.stop()


def _client_env(url: str, api_key: str) -> dict[str, str]:
    return {"OPENAI_BASE_URL": url + "/v1", "OPENAI_API_KEY": api_key}


def test_openai_completion_client(server) -> None:
    out = _run("openai_completion_client.py", _client_env(server.url, server.api_key)).splitlines()
    assert out[0] == "Model: SmolLM2-135M-Instruct"
    completion = ast.literal_eval(re.fullmatch(r"Completion: (.*)", out[1]).group(1))
    assert completion.startswith(" Paris")
    assert out[2] == "Usage: 5 prompt + 16 completion tokens"
    assert "\n".join(out[3:]) == "Streamed: " + completion  # streamed equals unstreamed


def _check_chat_client(out: str) -> None:
    lines = out.split("\nStreamed: ")
    assert len(lines) == 2 and lines[0].startswith("Assistant: ")
    assert "Paris" in lines[0]
    assert lines[0].removeprefix("Assistant: ") + "\n" == lines[1]  # streamed equals unstreamed


def test_openai_chat_client(server) -> None:
    _check_chat_client(_run("openai_chat_client.py", _client_env(server.url, server.api_key)))


@pytest.mark.slow  # two engine-core processes, each loading the model
def test_data_parallel_server_script() -> None:
    port, key = _free_port(), "sk-example"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PORT": str(port)}
    proc = subprocess.Popen(["bash", str(EXAMPLES / "data_parallel_server.sh"), "--max-model-len", "1024",
                             "--api-key", key], env=env)
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
        _check_chat_client(_run("openai_chat_client.py", _client_env(url, key)))
        metrics = httpx.get(url + "/metrics").text
        assert 'engine="0"' in metrics and 'engine="1"' in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=30)
