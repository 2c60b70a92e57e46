"""What a new user finds without reading the code (issue #34): an unknown endpoint's 404
names the API's endpoints, in OpenAI's error shape; the tokenizer's directory is logged at
every start and printed by `pagellm tokenizer`, so other tools' `--tokenizer` can use it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import API_KEY, ServerProcess, _free_port

ENDPOINTS = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
             "POST /tokenize")


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/nope"), ("GET", "/v2/models"),
                                              ("DELETE", "/nothing/here")])
def test_unknown_endpoint_404_names_the_endpoints(server: ServerProcess, method, path) -> None:
    r = httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {API_KEY}"},
                      json={}, timeout=30)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "NotFoundError" and err["code"] == 404 and err["param"] is None
    assert err["message"].startswith(f"Not Found: {method} {path} is not an endpoint of this server.")
    for endpoint in ENDPOINTS:
        assert endpoint in err["message"]
    assert "/ui" not in err["message"] and "/openapi.json" not in err["message"]


def test_openai_client_sees_the_endpoints_in_a_404(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(prompt="a cat")
    assert "POST /v1/chat/completions" in info.value.message


def _tokenizer_command(*args: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", "pagellm", "tokenizer", *args], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_tokenizer_command_prints_a_directory_transformers_loads(server: ServerProcess) -> None:
    from transformers import AutoTokenizer

    directory = _tokenizer_command()
    assert os.path.isabs(directory) and os.path.isfile(os.path.join(directory, "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(directory)
    text = "Hello, tokenizer directory!"
    served = httpx.post(server.url + "/tokenize", json={"prompt": text},
                        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    assert tok.encode(text) == served["tokens"]  # the server's own ids


def test_tokenizer_command_converts_into_a_fresh_cache(tmp_path) -> None:
    directory = _tokenizer_command(env={"PAGELLM_CACHE_DIR": str(tmp_path)})
    assert directory.startswith(str(tmp_path / "tokenizers") + os.sep)
    assert os.path.isfile(os.path.join(directory, "tokenizer_config.json"))
    assert _tokenizer_command(env={"PAGELLM_CACHE_DIR": str(tmp_path)}) == directory


def test_tokenizer_command_for_a_missing_model_is_one_error_line() -> None:
    out = subprocess.run([sys.executable, "-m", "pagellm", "tokenizer", "/no/such/model.gguf"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == "pagellm tokenizer: error: /no/such/model.gguf: no such model file or directory"


def test_serve_logs_the_tokenizer_directory(tmp_path) -> None:
    directory = _tokenizer_command()
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pagellm", "serve", "--port", str(port),
                                 "--max-model-len", "256", "--disable-ui"], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [line for line in log.read_text().splitlines() if "Tokenizer " in line]
    assert len(lines) == 1 and f"Tokenizer {directory} (for other tools' --tokenizer" in lines[0]
