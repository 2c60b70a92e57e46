"""Every PAGELLM_* environment variable, typed and documented, read in one place.

Options a user sets routinely are EngineArgs fields instead; these are switches for
process layout, debugging and tuning.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TypeVar

T = TypeVar("T", int, float)


def _bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off", "")


def _number(name: str, default: T, kind: type[T], what: str) -> T:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return kind(value)  # type: ignore[call-arg]
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {value!r}.") from None


def _int(name: str, default: int) -> int:
    return _number(name, default, int, "an integer")


def _float(name: str, default: float) -> float:
    return _number(name, default, float, "a number")


# OpenMP's wait policy, chosen for a machine shared with other programs (a laptop with a
# browser open). libgomp's default spins a waiting thread for ~300000 iterations (a few
# ms) before it sleeps: between the many small parallel regions of a decode step the
# threads never sleep, so a neighbour on one core stalls the thread that shares its core
# while the other spins, and throughput falls 3-6x instead of the 2x of one core lost.
# Passive waiting (sleep at once) measured 1.6x there instead of 3.1x, and no loss on a
# quiet machine with the engine core in its own process, where spinning takes the core
# the frontend needs; in-process it costs a quiet machine ~11% (benchmarks/contention.py,
# figures in benchmarks/README.md).
# libgomp reads these once, when torch loads it. They apply to pagellm's own compute
# processes only, never to the user's os.environ nor to programs the user's process
# starts: engine-core processes get them in the environment of their Popen (compute_env;
# what an engine-core process starts, e.g. the kernels' compiler, inherits it), and an
# in-process engine core sets them around its own `import torch` when it is the first to
# load torch (import_torch_with_openmp_defaults). `import pagellm` sets nothing.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
# Any of these set by the user means the user chose: pagellm then sets nothing.
_OPENMP_USER_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_torch_import_lock = threading.Lock()


def openmp_defaults() -> dict[str, str]:
    """What pagellm adds to a compute process's environment: OPENMP_DEFAULTS, or nothing
    when os.environ sets any of OMP_WAIT_POLICY, GOMP_SPINCOUNT, KMP_BLOCKTIME."""
    if any(v in os.environ for v in _OPENMP_USER_VARS):
        return {}
    return dict(OPENMP_DEFAULTS)


def compute_env() -> dict[str, str]:
    """The environment of a pagellm compute process (an engine-core process it spawns): a
    copy of os.environ plus openmp_defaults(). os.environ itself is not changed."""
    return {**os.environ, **openmp_defaults()}


def import_torch_with_openmp_defaults() -> None:
    """Imports torch with openmp_defaults() in os.environ, then removes what it added, so
    this process's libgomp takes pagellm's wait policy while os.environ (and every program
    started from it later) stays as the user left it. For an engine core that computes in
    this process; call it before anything there imports torch. If torch is already
    imported, libgomp has read its settings: nothing changes, and it does nothing."""
    with _torch_import_lock:
        if "torch" in sys.modules:
            return
        added = {k: v for k, v in openmp_defaults().items() if k not in os.environ}
        os.environ.update(added)
        try:
            import torch  # noqa: F401
        finally:
            for k in added:
                os.environ.pop(k, None)


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
    # Seconds an idle HTTP keep-alive connection stays open (vLLM's
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE; uvicorn's timeout_keep_alive).
    "PAGELLM_HTTP_TIMEOUT_KEEP_ALIVE": lambda: _int("PAGELLM_HTTP_TIMEOUT_KEEP_ALIVE", 5),
    # Seconds the client waits for an engine core to report ready.
    "PAGELLM_ENGINE_READY_TIMEOUT_S": lambda: _float("PAGELLM_ENGINE_READY_TIMEOUT_S", 600.0),
    # Seconds an engine core may go with work waiting and no progress (no step finished,
    # no model layer run) or without a heartbeat before the frontend treats it as hung
    # (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S); 0: no watchdog. The engine argument
    # engine_iteration_timeout_s, when given, replaces it.
    "PAGELLM_ENGINE_ITERATION_TIMEOUT_S": lambda: _float("PAGELLM_ENGINE_ITERATION_TIMEOUT_S", 60.0),
    # Seconds the head waits without a heartbeat (or any output) from an engine core on
    # another node (--headless) before it counts the core lost (hung, or its network gone):
    # its requests fail with 503 and the rank is served again once its node has started a
    # new core. Heartbeats come every 0.25 s. A core that dies closes its connection, which
    # the head notices within 0.25 s whatever this is; a core on the head's own machine is
    # watched through its process.
    "PAGELLM_REMOTE_ENGINE_TIMEOUT_S": lambda: _float("PAGELLM_REMOTE_ENGINE_TIMEOUT_S", 10.0),
    # SO_SNDBUF of the server's connections (bytes; Linux doubles it): what a client that
    # stops reading can leave in the kernel before its stream blocks. 0: the kernel's
    # autotuning (up to net.ipv4.tcp_wmem's maximum, 4 MiB by default).
    "PAGELLM_HTTP_SEND_BUFFER_BYTES": lambda: _int("PAGELLM_HTTP_SEND_BUFFER_BYTES", 131072),
    # Tokens a streamed request may hold waiting for its consumer (an HTTP client that
    # reads slowly or not at all) before it is aborted in the engine, its KV freed, and
    # its stream ended with an error; 0: no limit.
    "PAGELLM_STREAM_BUFFER_TOKENS": lambda: _int("PAGELLM_STREAM_BUFFER_TOKENS", 1024),
    # Where converted tokenizers and other caches live.
    "PAGELLM_CACHE_DIR": lambda: os.environ.get(
        "PAGELLM_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagellm")
    ),
    # Activations of GGUF linears on the quantized path, when set: replaces
    # EngineArgs.gguf_activations' "auto" ("float32": exact weights x float32 activations;
    # "q8": rounded to int8 per 32 values for decode-sized steps, integer dot products, as
    # llama.cpp; "auto": q8 where the CPU has the int8 kernels). Unset: "" (the engine
    # argument decides).
    "PAGELLM_GGUF_ACTIVATIONS": lambda: os.environ.get("PAGELLM_GGUF_ACTIVATIONS", ""),
    # Repack GGUF linears at load for the int8 decode kernels, where they run (q8
    # activations, AVX-512 VNNI): Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 and Q8_0 sixteen rows at a time;
    # off keeps the file's layout (A/B runs).
    "PAGELLM_GGUF_REPACK": lambda: _bool("PAGELLM_GGUF_REPACK", True),
    # Products of 32 rows or more that take the int8 GEMM (long prompt chunks, steps of
    # many decodes) run on AMX tiles in bfloat16 where the CPU has AMX-BF16; off keeps
    # the int8 GEMM (A/B runs).
    "PAGELLM_AMX": lambda: _bool("PAGELLM_AMX", True),
    # Cache a GGUF file's parsed config and dequantized weights under PAGELLM_CACHE_DIR.
    "PAGELLM_GGUF_CACHE": lambda: _bool("PAGELLM_GGUF_CACHE", True),
    # Torch intra-op threads in the engine core (0 = torch's default).
    "PAGELLM_NUM_THREADS": lambda: _int("PAGELLM_NUM_THREADS", 0),
    # Logging level of the pagellm logger.
    "PAGELLM_LOGGING_LEVEL": lambda: os.environ.get("PAGELLM_LOGGING_LEVEL", "INFO"),
    # Check the block pool's invariants after every scheduler step (tests, debugging).
    "PAGELLM_CHECK_INVARIANTS": lambda: _bool("PAGELLM_CHECK_INVARIANTS", False),
}
