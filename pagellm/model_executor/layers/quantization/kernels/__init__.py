"""The GGUF CPU kernels (`ggml_cpu.c`), compiled with the system's C compiler at first
use and cached under `<PAGELLM_CACHE_DIR>/kernels/<hash of source, flags, CPU>/`.

`load_kernels()` returns the loaded library, or None where no compiler is found or the
build fails (logged once); callers then dequantize weights at load instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import time

from pagellm import envs
from pagellm.logger import init_logger

logger = init_logger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "ggml_cpu.c")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compile_flags(simd: bool) -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c11", "-fno-math-errno"]
    if not simd:
        return [*flags, "-DPG_NO_SIMD"]
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= _cpu_flags():
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags


def _find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.cache
def load_kernels(simd: bool = True) -> ctypes.CDLL | None:
    """The compiled kernel library (built once per source/flags/CPU, then cached).
    `simd=False` builds the portable C paths only (tests check both builds)."""
    compiler = _find_compiler()
    if compiler is None:
        logger.warning(
            "No C compiler (cc/gcc/clang) found: GGUF weights are dequantized to float32 at "
            "load instead of running quantized (more memory, slower single-stream decode)"
        )
        return None
    flags = _compile_flags(simd)
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(
        source + " ".join([compiler, *flags, *sorted(_cpu_flags())]).encode()
    ).hexdigest()[:16]
    out_dir = os.path.join(envs.PAGELLM_CACHE_DIR, "kernels", key)
    lib_path = os.path.join(out_dir, "ggml_cpu.so")
    if not os.path.isfile(lib_path):
        start = time.perf_counter()
        os.makedirs(out_dir, exist_ok=True)
        tmp = f"{lib_path}.tmp-{os.getpid()}"
        cmd = [compiler, *flags, _SOURCE, "-o", tmp]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
            os.replace(tmp, lib_path)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning(
                "Building the GGUF CPU kernels failed (%s); GGUF weights are dequantized to "
                "float32 at load instead: %s", " ".join(cmd), detail.strip()[-2000:]
            )
            return None
        logger.info("Compiled the GGUF CPU kernels once in %.1f s (%s)",
                    time.perf_counter() - start, lib_path)
    # torch is imported first, so the library binds to torch's OpenMP runtime (same
    # soname) and shares its thread pool.
    import torch  # noqa: F401

    lib = ctypes.CDLL(lib_path)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pg_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64]
    lib.pg_gemm.restype = ctypes.c_int
    lib.pg_dequant_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr]
    lib.pg_dequant_rows.restype = ctypes.c_int
    lib.pg_type_supported.argtypes = [ctypes.c_int]
    lib.pg_type_supported.restype = ctypes.c_int
    lib.pg_simd_level.restype = ctypes.c_int
    return lib
