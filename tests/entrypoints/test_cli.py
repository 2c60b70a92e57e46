"""The `pagellm` command: generate and one-shot chat print the model's text; bad flags
fail with a message."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

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
