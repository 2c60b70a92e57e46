"""pagellm's C kernels: every `*.c` file here, compiled together into one library with
the system's C compiler at first use and cached under
`<PAGELLM_CACHE_DIR>/kernels/<hash of sources, flags, CPU>/`. No build step at install.

- `ggml_cpu.c`: GGUF block-quantized weights x float32 activations (quantization/gguf.py)
- `ggml_gemm.c`: the same for many input rows: weight rows dequantized a cache-sized
  block at a time and used against every row (batched decode, prefill)
- `ggml_q8.c`: the same weights x int8-rounded activations (llama.cpp's way; the default
  for decode-sized steps where the CPU has AVX2: AVX-512 VNNI kernels chosen at run time)
- `ggml_i8gemm.c`: many input rows (a prompt's) x the same weights in int8: weight rows
  unpacked 16 at a time into a row-interleaved int8 tile, AVX-512 VNNI where present
- `amx_gemm.c`: the same products on AMX tiles in bfloat16 where the CPU has AMX-BF16:
  weight rows dequantized 32 at a time into bfloat16 tiles, summed in float32
- `dense_f32.c`: float32 weights read in place from torch's oneDNN-packed copy, for a
  few input rows (layers/linear.py)
- `paged_attention.c`: one-token decode attention over the paged KV cache, and the
  cache write (attention/torch_backend.py)
- `layer_ops.c`: the small per-layer ops in one pass each: residual add + RMSNorm,
  per-head q/k RMSNorm, rotary embedding of q and k in place, SiLU- and GELU-and-mul,
  mixture-of-experts routing (layers/layernorm.py, rotary_embedding.py, activation.py,
  models/llama.py, layers/fused_moe.py)
- `sampling.c`: the next token of each logits row: greedy argmax, random draws with
  top-k / top-p, the repetition / frequency / presence penalties, and logprobs
  (sample/ops.py)
- `decode_step.c`: a decoder stack over a few single-token decodes in one call, made of
  the kernels above (models/fused_decode.py), all in one OpenMP region
- `team.c`: the barrier that region's threads meet at between kernels (team.h: how a
  kernel is written as a share of a team's work)
- `shm_collectives.c`: the all-reduce, gather and broadcast of tensor-parallel ranks on
  one machine through shared memory (model_executor/parallel_state.py)

`load_kernels()` returns the loaded library, or None where no compiler is found or the
build fails (logged once); callers then take their torch paths (GGUF files are
dequantized at load).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any

from pagellm import envs
from pagellm.logger import init_logger

logger = init_logger(__name__)

_DIR = os.path.dirname(__file__)
_SOURCES = sorted(os.path.join(_DIR, n) for n in os.listdir(_DIR) if n.endswith(".c"))
_HEADERS = sorted(os.path.join(_DIR, n) for n in os.listdir(_DIR) if n.endswith(".h"))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def simd_flags_available() -> bool:
    """Whether the SIMD build of the library gets AVX2 (x86 with AVX2, FMA and F16C): the
    condition of the int8-activation kernels (ggml_q8.c) and the AVX2 paths."""
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= _cpu_flags()


def _compile_flags(simd: bool) -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c11", "-fno-math-errno"]
    if not simd:
        return [*flags, "-DPG_NO_SIMD"]
    if simd_flags_available():
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if "avx_vnni" in _cpu_flags():  # 8-bit dot products in one instruction (ggml_q8.c)
            flags.append("-mavxvnni")
    return flags


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.cache
def build_key(compiler: str | None = None, flags: tuple[str, ...] | None = None) -> str:
    """The hash of the kernels' sources, compiler, flags and CPU that names a build (the
    SIMD build's by default): what the library computes, and how it lays out repacked
    weights, can change only with it."""
    compiler = compiler or find_compiler() or ""
    flags = list(flags) if flags is not None else _compile_flags(True)
    described = " ".join([compiler, *flags, *sorted(_cpu_flags())]).encode()
    return hashlib.sha256(_sources() + described).hexdigest()[:16]


@functools.cache
def _sources() -> bytes:
    """The C sources and headers, concatenated."""
    source = b""
    for path in [*_SOURCES, *_HEADERS]:
        with open(path, "rb") as f:
            source += f.read()
    return source


@functools.cache
def load_kernels(simd: bool = True) -> ctypes.CDLL | None:
    """The compiled kernel library (built once per source/flags/CPU, then cached).
    `simd=False` builds the portable C paths only (tests check both builds)."""
    compiler = find_compiler()
    if compiler is None:
        logger.warning(
            "No C compiler (cc/gcc/clang) found: GGUF weights are dequantized to float32 at "
            "load instead of running quantized, and attention takes its torch path (more "
            "memory, slower single-stream decode)"
        )
        return None
    flags = _compile_flags(simd)
    key = build_key(compiler, tuple(flags))
    out_dir = os.path.join(envs.PAGELLM_CACHE_DIR, "kernels", key)
    lib_path = os.path.join(out_dir, "pagellm_kernels.so")
    if not os.path.isfile(lib_path):
        start = time.perf_counter()
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:  # a read-only cache: build for this process only
            out_dir = tempfile.mkdtemp(prefix="pagellm-kernels-")
            logger.warning("Cannot write the kernel cache (%s); building in %s", e, out_dir)
            lib_path = os.path.join(out_dir, "pagellm_kernels.so")
        tmp = f"{lib_path}.tmp-{os.getpid()}"
        cmd = [compiler, *flags, *_SOURCES, "-o", tmp]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
            os.replace(tmp, lib_path)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning(
                "Building pagellm's C kernels failed (%s); GGUF weights are dequantized to "
                "float32 at load and attention takes its torch path instead: %s",
                " ".join(cmd), detail.strip()[-2000:]
            )
            return None
        logger.info("Compiled pagellm's C kernels once in %.1f s (%s)",
                    time.perf_counter() - start, lib_path)
    # torch is imported first, so the library binds to torch's OpenMP runtime (same
    # soname) and shares its thread pool.
    import torch  # noqa: F401

    lib = ctypes.CDLL(lib_path)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pg_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64]
    lib.pg_gemm.restype = ctypes.c_int
    lib.pg_gemm_batched.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64]
    lib.pg_gemm_batched.restype = ctypes.c_int
    lib.pg_dequant_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr]
    lib.pg_dequant_rows.restype = ctypes.c_int
    lib.pg_repack_k_r16.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
    lib.pg_repack_k_r16.restype = ctypes.c_int
    lib.pg_repack_r16.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
    lib.pg_repack_r16.restype = ctypes.c_int
    lib.pg_attn_isa512.argtypes = []
    lib.pg_attn_isa512.restype = ctypes.c_int
    lib.pg_type_supported.argtypes = [ctypes.c_int]
    lib.pg_type_supported.restype = ctypes.c_int
    lib.pg_q8_supported.argtypes = [ctypes.c_int]
    lib.pg_q8_supported.restype = ctypes.c_int
    lib.pg_quantize_q8.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr]
    lib.pg_quantize_q8.restype = None
    lib.pg_gemm_q8.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr, i64]
    lib.pg_gemm_q8.restype = ctypes.c_int
    lib.pg_q8_isa.restype = ctypes.c_int
    lib.pg_head_q8.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr]
    lib.pg_head_q8.restype = ctypes.c_int
    lib.pg_head_bounds.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
    lib.pg_head_bounds.restype = ctypes.c_int
    lib.pg_i8gemm_supported.argtypes = [ctypes.c_int]
    lib.pg_i8gemm_supported.restype = ctypes.c_int
    lib.pg_i8gemm_fast.restype = ctypes.c_int
    lib.pg_gemm_i8.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64]
    lib.pg_gemm_i8.restype = ctypes.c_int
    lib.pg_amx_ready.restype = ctypes.c_int
    lib.pg_amx_supported.argtypes = [ctypes.c_int, i64]
    lib.pg_amx_supported.restype = ctypes.c_int
    lib.pg_gemm_amx.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64]
    lib.pg_gemm_amx.restype = ctypes.c_int
    lib.pg_gemm_amx_gated.argtypes = [ctypes.c_int, ptr, i64, ctypes.c_int, ptr, i64, i64, i64,
                                      ptr, i64, i64, ctypes.c_int, ptr, i64]
    lib.pg_gemm_amx_gated.restype = ctypes.c_int
    lib.pg_amx_weights_bf16.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
    lib.pg_amx_weights_bf16.restype = ctypes.c_int
    lib.pg_paged_decode.argtypes = [ptr, i64, i64, i64, i64, i64, ctypes.c_int, ptr, ptr, i64,
                                    i64, ptr, i64, ptr, ptr, i64, ctypes.c_float, ctypes.c_float,
                                    ptr]
    lib.pg_paged_decode.restype = ctypes.c_int
    lib.pg_paged_decode_ready.argtypes = [ctypes.c_int, i64, i64]
    lib.pg_paged_decode_ready.restype = ctypes.c_int
    lib.pg_paged_prefill_ready.argtypes = [i64]
    lib.pg_paged_prefill_ready.restype = ctypes.c_int
    lib.pg_paged_prefill.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ptr,
                                     ptr, i64, ptr, i64, i64, ctypes.c_float, ctypes.c_float, ptr]
    lib.pg_paged_prefill.restype = ctypes.c_int
    lib.pg_write_kv.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int, ptr, ptr, i64,
                                i64, ptr]
    lib.pg_write_kv.restype = None
    f32 = ctypes.c_float
    lib.pg_add_rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, f32, ptr, i64]
    lib.pg_add_rms_norm.restype = None
    lib.pg_rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr]
    lib.pg_rope.restype = None
    lib.pg_silu_and_mul.argtypes = [ptr, i64, i64, i64, ptr, i64]
    lib.pg_silu_and_mul.restype = None
    lib.pg_gelu_tanh_and_mul.argtypes = [ptr, i64, i64, i64, ptr, i64]
    lib.pg_gelu_tanh_and_mul.restype = None
    lib.pg_head_rms_norm.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, f32]
    lib.pg_head_rms_norm.restype = None
    lib.pg_moe_route.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, ptr]
    lib.pg_moe_route.restype = None
    lib.pg_argmax_rows.argtypes = [ptr, i64, i64, i64, ptr]
    lib.pg_argmax_rows.restype = None
    lib.pg_sample_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr]
    lib.pg_sample_rows.restype = ctypes.c_int
    lib.pg_apply_penalties.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr]
    lib.pg_apply_penalties.restype = ctypes.c_int
    lib.pg_logprobs_rows.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr]
    lib.pg_logprobs_rows.restype = ctypes.c_int
    lib.pg_shm_post.argtypes = [ptr, i64, i64, ptr, ptr, i64]
    lib.pg_shm_post.restype = None
    lib.pg_shm_wait.argtypes = [ptr, i64, i64, i64]
    lib.pg_shm_wait.restype = ctypes.c_int
    lib.pg_shm_sum_f32.argtypes = [ptr, i64, i64, i64, ptr]
    lib.pg_shm_sum_f32.restype = None
    lib.pg_decode_layers.argtypes = [ptr, i64, ptr, ptr, ptr]
    lib.pg_decode_layers.restype = ctypes.c_int
    lib.pg_struct_layout.argtypes = [i64, ptr, i64, ctypes.POINTER(ctypes.c_char_p)]
    lib.pg_struct_layout.restype = i64
    lib.pg_team_check.argtypes = [i64, i64]
    lib.pg_team_check.restype = i64
    lib.pg_f32_blocked_matches.argtypes = [ptr, i64, i64, i64, i64, ptr]
    lib.pg_f32_blocked_matches.restype = ctypes.c_int
    lib.pg_gemm_f32_blocked.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, ptr, i64]
    lib.pg_gemm_f32_blocked.restype = ctypes.c_int
    lib.pg_f32_blocked_tiles.argtypes = [i64]
    lib.pg_f32_blocked_tiles.restype = ctypes.c_int
    # ctypes keeps each function it looked up in the library object's dict: those are
    # exactly the ones declared above (a return type only counts too)
    ctypes.c_int.in_dll(lib, "pg_amx_on").value = int(envs.PAGELLM_AMX)
    declared = {name: (fn.argtypes or [], fn.restype) for name, fn in vars(lib).items()
                if name.startswith("pg_")}
    check_bindings(declared, c_signatures(_sources().decode(errors="replace")))
    return lib


_C_RESTYPES = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
               "double": ctypes.c_double, "pointer": ctypes.c_void_p}
"""C return types of the exported functions -> their ctypes restype."""


def c_signatures(source: str) -> dict[str, tuple[str, int]]:
    """The exported (non-static) `pg_*` functions defined in C `source`: name -> (return
    type, 'pointer' for any pointer; number of parameters). A plain reading of the
    definitions, which the kernels keep to: one return type word, no function-pointer
    parameters."""
    source = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    source = re.sub(r"//[^\n]*", " ", source)
    out = {}
    for ret, name, params in re.findall(r"(?:^|\n)([A-Za-z_][\w \t*]*?)\b(pg_\w+)\s*\(([^()]*)\)\s*\{", source):
        words = ret.split()
        if "static" in words:
            continue
        params = params.strip()
        ret = "pointer" if "*" in "".join(words) else words[-1]
        out[name] = (ret, 0 if params in ("", "void") else params.count(",") + 1)
    return out


def check_bindings(bound: dict[str, tuple[Any, Any]], signatures: dict[str, tuple[str, int]]) -> None:
    """Raises naming every bound function whose ctypes declaration (argtypes, [] where
    none were given, restype) disagrees with its C definition in parameter count or
    return type: ctypes would pass the arguments anyway and the kernel read garbage."""
    problems = []
    for name, (argtypes, restype) in sorted(bound.items()):
        if name not in signatures:
            problems.append(f"{name}: declared in Python, not defined in the C sources")
            continue
        ret, count = signatures[name]
        if len(argtypes) != count:
            problems.append(f"{name}: {len(argtypes)} argtypes, the C function takes {count}")
        if ret not in _C_RESTYPES or _C_RESTYPES[ret] is not restype:
            problems.append(f"{name}: restype {getattr(restype, '__name__', restype)}, the C function returns {ret}")
    if problems:
        raise RuntimeError("pagellm's C kernel bindings disagree with the sources: " + "; ".join(problems))
