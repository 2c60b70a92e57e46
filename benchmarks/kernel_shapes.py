"""Time pagellm's CPU kernels at a model's shapes, next to what they replace.

    python benchmarks/kernel_shapes.py                 # SmolLM2-135M's shapes, M = 16, 64, 256, 512
    python benchmarks/kernel_shapes.py --rows 64 --reps 100

Linears (random Q4_1 blocks of the model's q|k|v, o, gate|up and down shapes, M input
rows): `pg_gemm_batched` (ggml_gemm.c, what gguf_matmul runs for 9..BATCHED_MAX_ROWS rows),
the dequantized-tile path (16 MiB tiles + oneDNN, what it runs above), and torch's float32
linear on the dequantized weight (what the float32 weights path runs). Decode attention:
`pg_paged_decode` for 64 requests of 128-240 cached tokens. Sampling: the Sampler on
logits rows of the model's vocabulary (49152) through the C kernels (kernels/sampling.c)
and through the torch composition they replace, for the usual request settings. Each
figure is the minimum over --reps calls (the least disturbed by other work on a shared
machine).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np
import torch

from pagellm.attention.torch_backend import (
    KV_TYPE_CODES,
    Q8_KV_DTYPE,
    TorchAttentionBackend,
    _storage,
)
from pagellm.kernels import load_kernels
from pagellm.model_executor.layers.quantization import gguf as gguf_method
from pagellm.sample import ops as sample_ops
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import Sampler

Q4_1 = 3
LINEARS = {"q|k|v": (960, 576), "o": (576, 576), "gate|up": (3072, 576), "down": (576, 1536)}


def q4_1_blocks(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """n rows of k Q4_1 values: per 32 values a float16 scale and minimum, 16 nibble bytes."""
    blocks = n * k // 32
    d = (rng.random(blocks, dtype=np.float32) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    m = (-rng.random(blocks, dtype=np.float32) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    qs = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    return np.ascontiguousarray(np.concatenate([d, m, qs], 1).reshape(n, k // 32 * 20))


def best_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def linears(lib, rows: list[int], reps: int) -> None:
    rng = np.random.default_rng(0)
    print(f"{'M':>5} {'linear':>8} {'N x K':>11} {'batched ms':>11} {'tiles ms':>9} "
          f"{'f32 torch ms':>13} {'batched GFLOP/s':>16}")
    for m in rows:
        for name, (n, k) in LINEARS.items():
            data = q4_1_blocks(n, k, rng)
            group = [gguf_method.WeightGroup(Q4_1, data, 0, n)]
            dense = torch.empty(n, k)
            lib.pg_dequant_rows(Q4_1, data.ctypes.data, data.shape[1], k, None, 0, n, dense.data_ptr())
            x, y = torch.randn(m, k), torch.empty(m, n)

            def batched(data=data, n=n, k=k, m=m, x=x, y=y) -> None:
                lib.pg_gemm_batched(Q4_1, data.ctypes.data, data.shape[1], n, k, x.data_ptr(), k,
                                    m, y.data_ptr(), n)

            def tiles(group=group, n=n, x=x) -> None:
                saved = gguf_method.BATCHED_MAX_ROWS
                gguf_method.BATCHED_MAX_ROWS = 0  # force the tile path
                try:
                    gguf_method.gguf_matmul(group, x, n)
                finally:
                    gguf_method.BATCHED_MAX_ROWS = saved

            t_b = best_ms(batched, reps)
            t_t = best_ms(tiles, reps)
            t_f = best_ms(lambda x=x, dense=dense: torch.nn.functional.linear(x, dense), reps)
            print(f"{m:>5} {name:>8} {f'{n}x{k}':>11} {t_b:>11.3f} {t_t:>9.3f} {t_f:>13.3f} "
                  f"{2 * m * n * k / t_b / 1e6:>16.1f}")


def decode_attention(lib, reps: int) -> None:
    """One layer's decode attention over a float32 cache and over a q8_0 cache (the
    default `--kv-cache-dtype auto` of a GGUF model), the same keys and values."""
    b, h, kvh, d, bs = 64, 9, 3, 64, 16
    lens = np.random.default_rng(0).integers(128, 240, b)
    nb = b * 16
    table = torch.arange(nb).reshape(b, 16)[:, torch.randperm(16)].contiguous()
    lo, hi = torch.zeros(b, dtype=torch.long), torch.tensor(lens, dtype=torch.long)
    q, out = torch.randn(b, h, d), torch.empty(b, h, d)
    key, value = torch.randn(nb * bs, kvh, d), torch.randn(nb * bs, kvh, d)
    slots = torch.arange(nb * bs, dtype=torch.long)
    for dtype, name in ((torch.float32, "float32"), (Q8_KV_DTYPE, "q8_0")):
        k_cache, v_cache = TorchAttentionBackend.allocate_kv_cache(nb, bs, kvh, d, dtype, torch.device("cpu"))
        k_store, v_store = _storage(k_cache, v_cache)
        kv_type = KV_TYPE_CODES[dtype]
        lib.pg_write_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), nb * bs, kvh, d,
                        kv_type, k_store.data_ptr(), v_store.data_ptr(), nb, bs, slots.data_ptr())

        def run(kv_type=kv_type, k_store=k_store, v_store=v_store) -> None:
            rc = lib.pg_paged_decode(q.data_ptr(), q.stride(0), b, h, kvh, d, kv_type, k_store.data_ptr(),
                                     v_store.data_ptr(), nb, bs, table.data_ptr(), table.stride(0),
                                     lo.data_ptr(), hi.data_ptr(), int(hi.max()), d**-0.5, 0.0, out.data_ptr())
            if rc != 0:
                raise RuntimeError(f"pg_paged_decode returned {rc}")

        ms = best_ms(run, reps)
        flops = 4 * b * h * float(lens.mean()) * d
        print(f"decode attention, {name} cache, {b} requests x {h} heads ({kvh} KV) x {lens.mean():.0f} slots, "
              f"D={d}: {ms:.3f} ms per layer ({flops / ms / 1e6:.1f} GFLOP/s)")


SAMPLING = {
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.7, top_k 40, top_p 0.95": {"temperature": 0.7, "top_k": 40, "top_p": 0.95},
    "greedy, repetition 1.1, presence 0.5, frequency 0.5": {"penalties": True},
    "greedy, logprobs 5": {"logprobs": 5},
}


def sampling_metadata(rows: int, temperature: float = 0.0, top_p: float | None = None,
                      top_k: int | None = None, penalties: bool = False,
                      logprobs: int | None = None) -> SamplingMetadata:
    """Every row with the same settings; penalties over a 512-token prompt and 128 output
    tokens per row."""
    gen = torch.Generator().manual_seed(0)

    def full(value: float) -> torch.Tensor:
        return torch.full((rows,), value)

    return SamplingMetadata(
        temperature=full(temperature) if temperature else None, all_greedy=not temperature,
        all_random=bool(temperature), top_p=full(top_p) if top_p else None,
        top_k=torch.full((rows,), top_k, dtype=torch.int64) if top_k else None, min_p=None,
        generators={}, max_num_logprobs=logprobs, no_penalties=not penalties,
        presence_penalties=full(0.5) if penalties else None,
        frequency_penalties=full(0.5) if penalties else None,
        repetition_penalties=full(1.1) if penalties else None,
        prompt_token_ids=torch.randint(0, 49152, (rows, 512), generator=gen) if penalties else None,
        output_token_ids=[torch.randint(0, 49152, (128,), generator=gen).tolist() if penalties
                          else [] for _ in range(rows)],
    )


def sampling(reps: int) -> None:
    """The whole Sampler, C kernels against the torch composition (forced by making
    `_row_kernels` decline, as it does off CPU)."""
    print(f"{'rows':>5} {'settings':<52} {'torch ms':>9} {'C ms':>7}")
    row_kernels = sample_ops._row_kernels
    for rows in (1, 32):
        logits = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(1)) * 4
        for name, settings in SAMPLING.items():
            metadata = sampling_metadata(rows, **settings)
            run = functools.partial(Sampler().forward, logits, metadata)
            c_ms = best_ms(run, reps)
            sample_ops._row_kernels = lambda logits: None
            try:
                torch_ms = best_ms(run, reps)
            finally:
                sample_ops._row_kernels = row_kernels
            print(f"{rows:>5} {name:<52} {torch_ms:>9.2f} {c_ms:>7.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 512], help="Input rows M.")
    p.add_argument("--reps", type=int, default=40, help="Calls per figure (the minimum is kept).")
    args = p.parse_args()
    lib = load_kernels()
    if lib is None:
        raise SystemExit("pagellm's C kernels could not be built on this machine (no C compiler?)")
    print(f"torch threads: {torch.get_num_threads()}")
    linears(lib, args.rows, args.reps)
    decode_attention(lib, args.reps)
    sampling(min(args.reps, 10))


if __name__ == "__main__":
    main()
