"""Every PAGELLM_* environment variable, typed and documented, read in one place.

Options a user sets routinely are EngineArgs fields instead; these are switches for
process layout, debugging and tuning.
"""

from __future__ import annotations

import os


def _bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off", "")


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


def _float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value is None or value == "" else float(value)


# OpenMP's wait policy, chosen for a machine shared with other programs (a laptop with a
# browser open). libgomp's default spins a waiting thread for ~300000 iterations (a few
# ms) before it sleeps: between the many small parallel regions of a decode step the
# threads never sleep, so a neighbour on one core stalls the thread that shares its core
# while the other spins, and throughput falls 3-6x instead of the 2x of one core lost.
# Passive waiting (sleep at once) measured 1.6x there instead of 3.1x, and no loss on a
# quiet machine with the engine core in its own process, where spinning takes the core
# the frontend needs; in-process it costs a quiet machine ~11% (benchmarks/contention.py,
# figures in benchmarks/README.md).
# libgomp reads these once, when torch loads it: they must be in the environment before
# `import torch`, in every process that computes (the engine core inherits them).
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
# Any of these set by the user means the user chose: pagellm then sets nothing.
_OPENMP_USER_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def apply_openmp_defaults() -> None:
    """Puts OPENMP_DEFAULTS into os.environ unless the user set a wait policy of their own.
    Called when pagellm is imported. If torch was imported first, this process keeps
    libgomp's default, but engine-core processes started from it still get these."""
    if not any(v in os.environ for v in _OPENMP_USER_VARS):
        os.environ.update(OPENMP_DEFAULTS)


def __getattr__(name: str):
    # Read lazily so tests and subprocesses see changes made after import.
    if name in _VARS:
        return _VARS[name]()
    raise AttributeError(name)


_VARS = {
    # Run the engine core in its own process for LLM (1) or in-process (0).
    "PAGELLM_ENABLE_MULTIPROCESSING": lambda: _bool("PAGELLM_ENABLE_MULTIPROCESSING", True),
    # Outputs handled per chunk by AsyncLLM's output handler before yielding to the loop.
    "PAGELLM_OUTPUT_PROC_CHUNK_SIZE": lambda: _int("PAGELLM_OUTPUT_PROC_CHUNK_SIZE", 128),
    # Seconds the client waits for an engine core to report ready.
    "PAGELLM_ENGINE_READY_TIMEOUT_S": lambda: _float("PAGELLM_ENGINE_READY_TIMEOUT_S", 600.0),
    # Where converted tokenizers and other caches live.
    "PAGELLM_CACHE_DIR": lambda: os.environ.get(
        "PAGELLM_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagellm")
    ),
    # Activations of GGUF linears on the quantized path: "float32" (default: exact weights
    # x float32 activations) or "q8" (opt-in, as llama.cpp: activations rounded to int8
    # per 32 values for decode-sized batches, integer dot products; faster, not exact).
    "PAGELLM_GGUF_ACTIVATIONS": lambda: os.environ.get("PAGELLM_GGUF_ACTIVATIONS", "float32"),
    # Cache a GGUF file's parsed config and dequantized weights under PAGELLM_CACHE_DIR.
    "PAGELLM_GGUF_CACHE": lambda: _bool("PAGELLM_GGUF_CACHE", True),
    # Torch intra-op threads in the engine core (0 = torch's default).
    "PAGELLM_NUM_THREADS": lambda: _int("PAGELLM_NUM_THREADS", 0),
    # Logging level of the pagellm logger.
    "PAGELLM_LOGGING_LEVEL": lambda: os.environ.get("PAGELLM_LOGGING_LEVEL", "INFO"),
    # Check the block pool's invariants after every scheduler step (tests, debugging).
    "PAGELLM_CHECK_INVARIANTS": lambda: _bool("PAGELLM_CHECK_INVARIANTS", False),
}
