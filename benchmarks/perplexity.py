"""Perplexity of pagellm on a text file, by llama.cpp's protocol (llama-perplexity), for
each GGUF activation path, and optionally llama.cpp's own figure on the same file.

    python benchmarks/perplexity.py                         # default model, both paths
    python benchmarks/perplexity.py --llama-perplexity $B/llama-perplexity
    python benchmarks/perplexity.py --model llama-3.2-1b --activations q8 --ctx 256

The protocol of llama.cpp's tools/perplexity/perplexity.cpp (`perplexity()`, without
--ppl-stride): the text is tokenized whole (with BOS first when the vocabulary adds one),
cut into floor(tokens / ctx) chunks of ctx tokens (at least 2 chunks), the first token of
each chunk replaced by BOS when the vocabulary adds one; every chunk is read from an
empty cache and scored on its second half only: the logits at positions ctx/2 .. ctx-2
against the tokens at ctx/2+1 .. ctx-1 (ctx/2 - 1 tokens a chunk; the first half is
context). Perplexity = exp(mean negative log-likelihood over every scored token).

pagellm side: the model as the engine loads it (EngineArgs: the file's blocks kept
quantized) with `gguf_activations` float32 (exact) or q8 (int8 activations, llama.cpp's
scheme, which pagellm applies to decode rows only), on a paged KV cache without the
engine. So that q8 measures the decode path, each chunk is read one token per step as a
decode, up to 8 chunks in lockstep (each step one decode row per chunk). Both paths read
the same chunks; the table gives their perplexities, the ratio, and how often their
top-1 tokens agree. llama.cpp's figure comes from `llama-perplexity -m MODEL -f TEXT -c
CTX -t <physical cores>` ("Final estimate: PPL = X +/- Y"); it tokenizes with its own
tokenizer and keeps its KV cache in float16. Writes benchmarks/results/perplexity-<time>.json.
"""

from __future__ import annotations

import argparse
import math
import platform
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import cpu_model, physical_cores, resolve_model, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = ROOT / "tests" / "data" / "public_domain_english.txt"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
LOCKSTEP = 8
"""Chunks read together, one decode row each per step."""
BLOCK_SIZE = 16
ACTIVATIONS = ("float32", "q8", "q8x2")
RESULT_KEYS = ("date", "model", "model_name", "text", "text_chars", "ctx", "add_bos", "tokens",
               "chunks", "scored_tokens", "pagellm", "q8_over_float32", "q8_over_float32_se",
               "top1_agreement",
               "llama_perplexity", "machine")
"""The keys of the JSON, in order."""
LLAMA_BOS_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                 "midm-2.0", "lfm2", "jina-v5-nano")
"""GGUF `tokenizer.ggml.pre` values for which llama.cpp adds BOS when the file does not
say (src/llama-vocab.cpp)."""


# -- text ------------------------------------------------------------------------------


def adds_bos(model_path: str, tokenizer: Any) -> bool:
    """Whether the vocabulary adds BOS, as llama.cpp decides (llama_vocab_get_add_bos):
    a GGUF's `tokenizer.ggml.add_bos_token` when present, else its default for the
    vocabulary type (SentencePiece `llama`: yes; BPE: only for the Llama-3-style
    pre-tokenizers). Other models: their tokenizer's own setting."""
    from pagellm.model_executor.weight_utils import gguf_field, is_gguf, open_gguf

    if tokenizer.bos_token_id is None:
        return False
    if not is_gguf(model_path):
        return bool(getattr(tokenizer, "add_bos_token", False))
    reader = open_gguf(model_path)
    explicit = gguf_field(reader, "tokenizer.ggml.add_bos_token")
    if explicit is not None:
        return bool(explicit)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    return kind == "llama" or (kind == "gpt2" and gguf_field(reader, "tokenizer.ggml.pre") in LLAMA_BOS_PRE)


def make_chunks(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: floor(len / ctx) windows of ctx tokens, the first token
    of each replaced by `bos` (None: kept). Fewer than 2 x ctx tokens is an error there."""
    if ctx < 4 or ctx % 2:
        raise ValueError(f"--ctx must be an even number >= 4, got {ctx}")
    if len(ids) < 2 * ctx:
        raise ValueError(f"the text tokenizes to {len(ids)} tokens; a context of {ctx} needs at least {2 * ctx}")
    chunks = [list(ids[i * ctx:(i + 1) * ctx]) for i in range(len(ids) // ctx)]
    if bos is not None:
        for c in chunks:
            c[0] = bos
    return chunks


def scored_per_chunk(ctx: int) -> int:
    """Tokens scored in each chunk: positions ctx/2 .. ctx-2 predict the next token."""
    return ctx - ctx // 2 - 1


# -- pagellm ---------------------------------------------------------------------------


class LockstepReader:
    """Up to LOCKSTEP sequences read one token per step on a paged KV cache, each step one
    decode row per sequence (the few lines of tests/utils.py's PagedRunner this needs:
    block tables, slot mapping, attention metadata)."""

    def __init__(self, model: Any, model_config: Any, attn_backend: type, ctx: int,
                 kv_dtype: Any = None) -> None:
        import torch

        self.model, self.ctx = model, ctx
        self.blocks_per_seq = -(-ctx // BLOCK_SIZE)
        num_blocks = LOCKSTEP * self.blocks_per_seq
        kvh, d = model_config.num_kv_heads, model_config.head_dim

        def layer_cache() -> tuple[Any, Any]:
            k, v = attn_backend.allocate_kv_cache(num_blocks, BLOCK_SIZE, kvh, d,
                                                  kv_dtype or model_config.torch_dtype, torch.device("cpu"))
            return k.zero_(), v.zero_()

        self.kv_caches = [layer_cache() for _ in range(model_config.num_layers)]
        self.builder = attn_backend.get_builder_cls()(
            BLOCK_SIZE, torch.device("cpu"), sliding_window=getattr(model, "sliding_window", None))

    def step(self, tokens: list[int], pos: int, logits: bool) -> Any:
        """Token `tokens[i]` of sequence i at position `pos` (each sequence's cache holds
        positions < pos); the logits [n, vocab] when asked."""
        import torch

        from pagellm.attention.backend import CommonAttentionMetadata, set_forward_context

        n, bs = len(tokens), BLOCK_SIZE
        table = torch.arange(n * self.blocks_per_seq, dtype=torch.long).view(n, self.blocks_per_seq)
        slots = [int(table[i, pos // bs]) * bs + pos % bs for i in range(n)]
        t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        common = CommonAttentionMetadata(
            num_reqs=n, num_actual_tokens=n, query_start_loc=t(list(range(n + 1))),
            seq_lens=t([pos + 1] * n), block_table=table, slot_mapping=t(slots),
            query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=[pos + 1] * n,
            max_query_len=1, max_seq_len=pos + 1, block_size=bs)
        with torch.inference_mode(), set_forward_context(self.builder.build(common), self.kv_caches):
            hidden = self.model(t(tokens), t([pos] * n))
            return self.model.compute_logits(hidden) if logits else None


def load_model(model_path: str, activations: str, ctx: int) -> tuple[Any, Any, type, Any]:
    """The model as the engine builds it from EngineArgs (quantization detected: a GGUF's
    blocks stay quantized), with `gguf_activations` = `activations`, and the KV cache
    dtype the engine would give it (`kv_cache_dtype` auto)."""
    import torch

    from pagellm.attention import get_attn_backend
    from pagellm.attention.backend import cache_torch_dtype
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.model_executor.loader import get_model

    config = EngineArgs(model=model_path, gguf_activations=activations,
                        max_model_len=max(ctx, 16)).create_engine_config()
    backend = get_attn_backend(config.attention_config.backend)
    model = get_model(config.model_config, torch.device("cpu"), backend)
    model.eval()
    return model, config.model_config, backend, cache_torch_dtype(config.cache_config.cache_dtype)


def pagellm_scores(model_path: str, chunks: list[list[int]], activations: str) -> dict[str, Any]:
    """Negative log-likelihood and argmax of every scored token of every chunk (chunk
    order, then position), read by pagellm with `activations`, and the figures."""
    import torch

    ctx = len(chunks[0])
    first = ctx // 2
    model, mc, backend, kv_dtype = load_model(model_path, activations, ctx)
    quant = getattr(model.lm_head, "quant_method", None)
    reader = LockstepReader(model, mc, backend, ctx, kv_dtype)
    nll = torch.zeros(len(chunks), ctx - 1 - first, dtype=torch.float64)
    top = torch.zeros(len(chunks), ctx - 1 - first, dtype=torch.long)
    start = time.perf_counter()
    for lo in range(0, len(chunks), LOCKSTEP):
        group = chunks[lo:lo + LOCKSTEP]
        for pos in range(ctx - 1):  # the last token is only a target
            logits = reader.step([c[pos] for c in group], pos, logits=pos >= first)
            if logits is None:
                continue
            target = torch.tensor([c[pos + 1] for c in group])
            logp = torch.log_softmax(logits.double(), -1)
            nll[lo:lo + len(group), pos - first] = -logp[torch.arange(len(group)), target]
            top[lo:lo + len(group), pos - first] = logits.argmax(-1)
    seconds = time.perf_counter() - start
    fused = getattr(model.model, "fused_decode", None)
    mean = nll.mean().item()
    return {"perplexity": math.exp(mean), "mean_nll": mean, "scored_tokens": nll.numel(),
            "seconds": seconds, "tokens_per_s": len(chunks) * (ctx - 1) / seconds,
            "quantization": mc.quantization, "gguf_activations": mc.gguf_activations,
            "kv_cache_dtype": str(kv_dtype).removeprefix("torch.").replace("int8", "q8_0"),
            "q8_head": bool(getattr(quant, "q8_activations", False)),
            "q8_decode_stack": bool(fused is not None and getattr(fused, "q8", False)),
            "_top": top, "_nll": nll}


# -- llama.cpp -------------------------------------------------------------------------


FINAL_RE = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
CHUNKS_RE = re.compile(r"calculating perplexity over (\d+) chunks")


def parse_llama_perplexity(text: str) -> dict[str, Any]:
    """(perplexity, its +/- and the chunk count) from llama-perplexity's log."""
    final = FINAL_RE.search(text)
    if not final:
        raise RuntimeError(f"no 'Final estimate' line in llama-perplexity's output: {text[-800:]}")
    chunks = CHUNKS_RE.search(text)
    return {"perplexity": float(final.group(1)), "plus_minus": float(final.group(2)),
            "chunks": int(chunks.group(1)) if chunks else None}


def run_llama_perplexity(binary: str, model: str, text: Path, ctx: int, timeout: float) -> dict[str, Any]:
    cmd = [binary, "-m", model, "-f", str(text), "-c", str(ctx), "-t", str(physical_cores())]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"llama-perplexity exited with {proc.returncode}: {proc.stderr[-800:]}")
    return {**parse_llama_perplexity(proc.stdout + "\n" + proc.stderr), "command": cmd, "seconds": seconds}


# -- run -------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagellm.model_executor.loader import load_tokenizer

    text = Path(args.text)
    content = text.read_text(encoding="utf-8")
    tok = load_tokenizer(args.model)
    bos = adds_bos(args.model, tok)
    ids = tok(content, add_special_tokens=False)["input_ids"]
    if bos:  # common_tokenize(ctx, text, add_special=true)
        ids = [tok.bos_token_id, *ids]
    chunks = make_chunks(ids, args.ctx, tok.bos_token_id if bos else None)
    print(f"{text.name}: {len(content)} characters, {len(ids)} tokens, {len(chunks)} chunks of "
          f"{args.ctx} (BOS {'added' if bos else 'not added'}), "
          f"{len(chunks) * scored_per_chunk(args.ctx)} tokens scored", flush=True)
    pagellm, tops, nlls = {}, {}, {}
    for act in args.activations.split(","):
        print(f"pagellm, {act} activations ...", flush=True)
        scores = pagellm_scores(args.model, chunks, act)
        tops[act], nlls[act] = scores.pop("_top"), scores.pop("_nll")
        pagellm[act] = scores
    ratio = ratio_se = agreement = None
    if {"float32", "q8"} <= set(pagellm):
        ratio = pagellm["q8"]["perplexity"] / pagellm["float32"]["perplexity"]
        # the ratio is exp(mean of the paired differences): its standard error from theirs
        diff = (nlls["q8"] - nlls["float32"]).flatten()
        ratio_se = ratio * diff.std().item() / math.sqrt(diff.numel()) if diff.numel() > 1 else None
        agreement = (tops["q8"] == tops["float32"]).double().mean().item()
    llama = None
    if args.llama_perplexity:
        print("llama-perplexity ...", flush=True)
        llama = run_llama_perplexity(args.llama_perplexity, args.model, text, args.ctx, args.timeout)
    return {
        "date": datetime.now().isoformat(timespec="seconds"), "model": args.model,
        "model_name": args.model_name, "text": str(text), "text_chars": len(content),
        "ctx": args.ctx, "add_bos": bos, "tokens": len(ids), "chunks": len(chunks),
        "scored_tokens": len(chunks) * scored_per_chunk(args.ctx), "pagellm": pagellm,
        "q8_over_float32": ratio, "q8_over_float32_se": ratio_se, "top1_agreement": agreement,
        "llama_perplexity": llama,
        "machine": {"cpu_model": cpu_model(), "physical_cores": physical_cores(),
                    "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version()},
    }


def print_table(result: dict[str, Any]) -> None:
    header = f"{'system':<28} {'perplexity':>10} {'scored tokens':>13} {'time s':>8}"
    print(header)
    print("-" * len(header))
    for act, r in result["pagellm"].items():
        print(f"{'pagellm, ' + act + ' activations':<28} {r['perplexity']:>10.4f} "
              f"{r['scored_tokens']:>13} {r['seconds']:>8.1f}  ({r['kv_cache_dtype']} KV cache)")
    llama = result["llama_perplexity"]
    if llama:
        scored = None if llama["chunks"] is None else llama["chunks"] * scored_per_chunk(result["ctx"])
        print(f"{'llama.cpp llama-perplexity':<28} {llama['perplexity']:>10.4f} "
              f"{'-' if scored is None else scored:>13} {llama['seconds']:>8.1f}  "
              f"(+/- {llama['plus_minus']:.4f})")
    if result["q8_over_float32"] is not None:
        print(f"q8 / float32 perplexity: {result['q8_over_float32']:.4f} "
              f"(+/- {result['q8_over_float32_se']:.4f}, paired standard error); top-1 agreement "
              f"{100 * result['top1_agreement']:.1f}% of {result['scored_tokens']} positions")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="GGUF file, `default` (the default) or a synthetic shape name (see compare.py).")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="Text file (default: %(default)s).")
    p.add_argument("--ctx", type=int, default=512, help="Tokens per chunk, llama-perplexity's -c.")
    p.add_argument("--activations", default="float32,q8",
                   help="Comma list of GGUF activation paths to measure: float32, q8, q8x2.")
    p.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity binary.")
    p.add_argument("--timeout", type=float, default=3600.0, help="Seconds llama-perplexity may run.")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    unknown = set(args.activations.split(",")) - set(ACTIVATIONS)
    if unknown:
        p.error(f"unknown activations {sorted(unknown)}; choose from {ACTIVATIONS}")
    args.model_name = args.model or "default"
    args.model = resolve_model(args.model)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    print_table(result)
    write_results(result, args.results_dir, "perplexity-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
