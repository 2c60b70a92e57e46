"""The `pagellm` command: generate and one-shot chat print the model's text; bad flags
fail with a message."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import psutil
import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.arg_utils import EngineArgs


def _pagellm(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGELLM_ENABLE_MULTIPROCESSING": "0"}
    return subprocess.run([sys.executable, "-m", "pagellm", *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    llm = LLM(multiprocess_mode=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=12)
        gen = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].text
        chat = llm.chat([{"role": "user", "content": "Hi!"}], params, use_tqdm=False)[0].outputs[0].text
        return {"generate": gen, "chat": chat}
    finally:
        llm.shutdown()


def test_generate_prints_prompt_and_greedy_completion(reference) -> None:
    result = _pagellm("generate", "The capital of France is", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "The capital of France is" + reference["generate"] + "\n"


def test_chat_message_prints_the_reply(reference) -> None:
    result = _pagellm("chat", "--message", "Hi!", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == reference["chat"] + "\n"


def test_generate_with_its_engine_in_a_prestarted_process(reference) -> None:
    """With multiprocessing on (the default) the command starts the engine-core process
    before it reads the model's config and hands that process the config."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGELLM_ENABLE_MULTIPROCESSING": "1"}
    result = subprocess.run([sys.executable, "-m", "pagellm", "generate", "The capital of France is",
                             "--max-tokens", "12"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "The capital of France is" + reference["generate"] + "\n"


def test_a_model_that_does_not_exist_leaves_no_prestarted_engine() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGELLM_ENABLE_MULTIPROCESSING": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pagellm", "generate", "x", "--model",
                             "/tmp/does-not-exist/model.gguf"], stderr=subprocess.PIPE, text=True, env=env)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "pagellm generate: error:" in stderr and "does-not-exist" in stderr
    time.sleep(0.5)
    leftover = [p for p in psutil.process_iter(["cmdline"])
                if f"--parent-pid {proc.pid}" in " ".join(p.info["cmdline"] or [])]
    assert leftover == []


def test_bad_flag_values_are_rejected() -> None:
    result = _pagellm("generate", "x", "--dtype", "float8")
    assert result.returncode != 0
    assert "dtype must be one of auto, float32, bfloat16, float16; got 'float8'" in result.stderr


def test_a_chat_template_path_that_does_not_exist_is_refused() -> None:
    """A mistyped --chat-template path must not become the template text itself."""
    for cmd in (("serve",), ("chat", "--message", "Hi!")):
        result = _pagellm(*cmd, "--chat-template", "./no_such_template.jinja")
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.strip().endswith(
            "error: chat template './no_such_template.jinja' looks like a file path, but no such file exists"
        ), result.stderr[-2000:]


def test_swap_space_is_accepted_with_a_deprecation_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EngineArgs(swap_space=4)
    assert any(issubclass(w.category, DeprecationWarning) and "swap_space" in str(w.message) for w in caught)


def test_a_subcommand_module_that_fails_to_import_is_an_error(monkeypatch) -> None:
    from pagellm.entrypoints.cli import main as cli_main

    monkeypatch.setitem(cli_main._SUBCOMMANDS, "missing", "pagellm.entrypoints.cli.no_such_module")
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        cli_main.build_parser()


def _main_error(capsys, *argv: str) -> list[str]:
    """Runs the CLI in this process; returns stderr's lines of a parse-time error."""
    from pagellm.entrypoints.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_a_bad_sampling_flag_fails_before_torch_or_the_model_loads() -> None:
    code = ("import atexit, sys; atexit.register(lambda: print('torch loaded:', 'torch' in sys.modules, "
            "file=sys.stderr)); from pagellm.entrypoints.cli.main import main; main()")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code, "generate", "--max-tokens", "-1", "x"],
                            capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2
    assert lines[0].startswith("usage: pagellm generate ")
    assert lines[-2:] == ["pagellm generate: error: max_tokens must be at least 1, got -1.",
                          "torch loaded: False"]
    assert elapsed < 3.0


def test_generates_frontend_process_never_imports_torch(reference) -> None:
    """Start-up (issue #15): with the engine core in its own process (the default) only
    that process imports torch; the command's process parses, builds the config, loads
    the tokenizer and prints without it, and imports no serve or bench dependencies."""
    code = ("import atexit, sys; atexit.register(lambda: print('loaded:', [m for m in ('torch', "
            "'fastapi', 'uvicorn', 'starlette', 'aiohttp') if m in sys.modules], file=sys.stderr)); "
            "from pagellm.entrypoints.cli.main import main; main()")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGELLM_ENABLE_MULTIPROCESSING": "1"}
    result = subprocess.run([sys.executable, "-c", code, "generate", "The capital of France is",
                             "--max-tokens", "12"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "The capital of France is" + reference["generate"] + "\n"
    assert result.stderr.strip().splitlines()[-1] == "loaded: []"


def test_import_pagellm_and_its_public_names_stay_light() -> None:
    code = ("import sys; from pagellm import LLM, SamplingParams, EngineArgs, AsyncLLM; "
            "print([m for m in ('torch', 'transformers', 'fastapi', 'uvicorn', 'aiohttp') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
    # the server's process: its engine core imports torch, the HTTP side does not
    code = ("import sys; import pagellm.entrypoints.openai.api_server; "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_torch_build_has_gpu_reads_what_torch_reports() -> None:
    """Read from torch's version.py without importing torch; the same answer torch gives."""
    code = ("import sys; from pagellm.platforms import torch_build_has_gpu; "
            "before = torch_build_has_gpu(); loaded = 'torch' in sys.modules; import torch; "
            "print(before, loaded, torch.version.cuda is not None or torch.version.hip is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    before, loaded, truth = out.stdout.split()
    assert (before, loaded) == (truth, "False"), out.stderr[-2000:]


@pytest.mark.parametrize(("argv", "message"), [
    (("generate", "--temperature", "-1", "x"), "temperature must be non-negative, got -1.0."),
    (("chat", "--top-p", "0", "-m", "hi"), "top_p must be in (0, 1], got 0.0."),
    (("serve", "--max-num-seqs", "0"), "max_num_seqs must be a positive integer, got 0."),
    (("serve", "--max-logprobs", "-2"), "max_logprobs must be -1 (the vocabulary) or >= 0, got -2."),
    (("serve", "--max-n", "0"), "argument --max-n: must be >= 1, got 0"),
    (("serve", "--max-request-body-bytes", "lots"), "argument --max-request-body-bytes: not a whole number: 'lots'"),
    (("bench", "throughput", "--block-size", "0"), "block_size must be a positive integer, got 0."),
    (("generate", "--dtype", "float8", "x"),
     "dtype must be one of auto, float32, bfloat16, float16; got 'float8'."),
])
def test_sampling_and_engine_flags_are_checked_at_parse_time(capsys, argv, message) -> None:
    lines = _main_error(capsys, *argv)
    command = " ".join(a for a in argv[:2] if not a.startswith("-"))
    assert lines[0].startswith(f"usage: pagellm {command} ")
    assert lines[-1] == f"pagellm {command}: error: {message}"


def test_no_prefix_matching_and_each_subcommand_shows_its_own_usage(capsys) -> None:
    lines = _main_error(capsys, "generate", "x", "--max-token", "5")
    assert lines[0].startswith("usage: pagellm generate ")
    assert lines[-1] == "pagellm generate: error: unrecognized arguments: --max-token 5"
    lines = _main_error(capsys, "bench", "throughput", "--bogus")
    assert lines[0].startswith("usage: pagellm bench throughput ")
    assert lines[-1] == "pagellm bench throughput: error: unrecognized arguments: --bogus"
    lines = _main_error(capsys, "serve", "--prt=80")
    assert lines[0].startswith("usage: pagellm serve ")
    assert lines[-1] == "pagellm serve: error: unrecognized arguments: --prt=80"


def test_help_shows_defaults(capsys) -> None:
    from pagellm.entrypoints.cli.main import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-tokens MAX_TOKENS Most tokens to generate. (default: 128)" in text
    assert "--block-size BLOCK_SIZE" in text and "(default: 16)" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text
    assert "(default: None)" not in text  # where the help text says what None means
