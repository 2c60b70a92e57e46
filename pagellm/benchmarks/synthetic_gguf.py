"""Random GGUF weights in any block type, and whole synthetic Llama and Qwen3-MoE GGUF
files.

gguf's Python package can dequantize every type but quantize only a few, so random
weights are written as random *blocks*: random quant bits with valid, small float16
scales. Dequantized, they are ordinary random weights, which is all a kernel test or a
speed benchmark needs. `write_llama_gguf` lays out a Llama model in llama.cpp's naming
(q/k rows permuted as llama.cpp's converter does) with a chosen type mix, e.g. Q4_K_M's:

    python -m pagellm.benchmarks.synthetic_gguf out.gguf --shape llama-3.2-1b --mix q4_k_m

`write_qwen3_moe_gguf` does the same for a mixture-of-experts model in llama.cpp's
`qwen3moe` layout (router `ffn_gate_inp`, experts stacked as 3-D `ffn_*_exps` tensors):

    python -m pagellm.benchmarks.synthetic_gguf moe.gguf --shape qwen3-30b-a3b-32e
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

# byte ranges of the float16 scale fields inside one block, per type
_F16_FIELDS: dict[str, list[tuple[int, int]]] = {
    "Q4_0": [(0, 2)], "Q4_1": [(0, 2), (2, 4)], "Q5_0": [(0, 2)], "Q5_1": [(0, 2), (2, 4)],
    "Q8_0": [(0, 2)], "Q2_K": [(80, 82), (82, 84)], "Q3_K": [(108, 110)],
    "Q4_K": [(0, 2), (2, 4)], "Q5_K": [(0, 2), (2, 4)], "Q6_K": [(208, 210)],
    "IQ4_XS": [(0, 2)], "IQ4_NL": [(0, 2)],
}  # fmt: skip

SHAPES: dict[str, dict[str, int]] = {
    # Llama-3.2-1B's shapes; its vocabulary (128256) is replaced by another file's
    # (`vocab_from`, by default pagellm's default model: 49152 tokens), which keeps the
    # file ~0.8 GB in Q4_K_M and gives llama.cpp and transformers a real BPE tokenizer
    "llama-3.2-1b": dict(hidden=2048, inter=8192, layers=16, heads=32, kv_heads=8, vocab=49152),
    # Llama-3.1-8B's shapes, the same replaced vocabulary (~4.5 GB in Q4_K_M)
    "llama-3.1-8b": dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, vocab=49152),
    "tiny": dict(hidden=256, inter=768, layers=2, heads=4, kv_heads=2, vocab=512),
    # Qwen3-30B-A3B's layer shapes (48 layers, head_dim 128, experts of 768, top-8) with 32
    # of its 128 experts: ~4.6 GB in Q4_K_M, ~1.5 GB of weights read per token
    "qwen3-30b-a3b-32e": dict(hidden=2048, inter=6144, layers=48, heads=32, kv_heads=4,
                              head_dim=128, experts=32, top_k=8, expert_inter=768, vocab=49152),
    "tiny-moe": dict(hidden=256, inter=768, layers=2, heads=4, kv_heads=2, head_dim=64,
                     experts=8, top_k=2, expert_inter=256, vocab=512),
}
MOE_SHAPES = ("qwen3-30b-a3b-32e", "tiny-moe")


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator,
                  scale: float = 0.02) -> np.ndarray:
    """[rows, bytes per row] uint8: random blocks of `qtype` whose values are ~`scale`."""
    import gguf

    gtype = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[gtype]
    if cols % block:
        raise ValueError(f"{qtype}: columns ({cols}) must be a multiple of {block}")
    if qtype in ("F32", "F16", "BF16"):
        values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if qtype == "F32":
            return values.view(np.uint8)
        if qtype == "F16":
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nblocks = cols // block
    data = rng.integers(0, 256, size=(rows, nblocks, size), dtype=np.uint8)
    # block-scale magnitude so that dequantized values stay near `scale`
    levels = {"Q8_0": 64.0, "Q2_K": 2.0 * 8, "Q3_K": 4.0 * 32, "Q6_K": 32.0 * 64,
              "IQ4_XS": 64.0 * 32, "IQ4_NL": 64.0 * 32, "Q4_K": 8.0 * 32, "Q5_K": 16.0 * 32}.get(qtype, 8.0)
    for start, end in _F16_FIELDS[qtype]:
        d = (rng.uniform(0.5, 1.5, size=(rows, nblocks)) * scale / levels).astype(np.float16)
        data[:, :, start:end] = d.view(np.uint8).reshape(rows, nblocks, 2)
    return data.reshape(rows, nblocks * size)


def q4_k_m_type(name: str, layer: int, layers: int) -> str:
    """The type llama.cpp's Q4_K_M recipe gives a tensor: Q6_K for the output head and
    for attn_v / ffn_down in the first and last eighth of the layers and every third
    layer between; Q4_K elsewhere."""
    if name == "output":
        return "Q6_K"
    if name in ("attn_v", "ffn_down"):
        eighth = max(1, layers // 8)
        if layer < eighth or layer >= layers - eighth or (layer - eighth) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def write_llama_gguf(path: str, shape: dict[str, int], mix: str = "q4_k_m", seed: int = 0,
                     tied: bool = False, vocab_from: str | None = None) -> None:
    """A Llama GGUF with random weights of `shape` and type mix `mix` ('q4_k_m' or a
    single type name such as 'Q8_0'). The vocabulary is `vocab_from`'s (a GGUF with a
    gpt2-style BPE tokenizer) when given, else `vocab` placeholder tokens without merges
    (enough for transformers and pagellm, not for llama.cpp)."""
    import gguf

    rng = np.random.default_rng(seed)
    h, inter, n_layers = shape["hidden"], shape["inter"], shape["layers"]
    heads, kv_heads, vocab = shape["heads"], shape["kv_heads"], shape["vocab"]
    head_dim = h // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(2048)
    w.add_embedding_length(h)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    vocab = _add_vocab(w, vocab, vocab_from)

    def type_of(name: str, layer: int) -> str:
        return q4_k_m_type(name, layer, n_layers) if mix == "q4_k_m" else mix.upper()

    def add(name: str, qtype: str, rows: int, cols: int, experts: int = 0) -> None:
        _add_blocks(w, rng, name, qtype, rows, cols, experts)

    def add_norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32))

    embd_type = "Q6_K" if tied and mix == "q4_k_m" else type_of("token_embd", 0)
    add("token_embd.weight", embd_type, vocab, h)
    for i in range(n_layers):
        add_norm(f"blk.{i}.attn_norm.weight")
        add_norm(f"blk.{i}.ffn_norm.weight")
        add(f"blk.{i}.attn_q.weight", type_of("attn_q", i), heads * head_dim, h)
        add(f"blk.{i}.attn_k.weight", type_of("attn_k", i), kv_heads * head_dim, h)
        add(f"blk.{i}.attn_v.weight", type_of("attn_v", i), kv_heads * head_dim, h)
        add(f"blk.{i}.attn_output.weight", type_of("attn_output", i), h, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", type_of("ffn_gate", i), inter, h)
        add(f"blk.{i}.ffn_up.weight", type_of("ffn_up", i), inter, h)
        add(f"blk.{i}.ffn_down.weight", type_of("ffn_down", i), h, inter)
    add_norm("output_norm.weight")
    if not tied:
        add("output.weight", type_of("output", 0), vocab, h)
    _write_out(w)


def write_qwen3_moe_gguf(path: str, shape: dict[str, int], mix: str = "q4_k_m", seed: int = 0,
                         vocab_from: str | None = None) -> None:
    """A Qwen3-MoE GGUF (llama.cpp's `qwen3moe`) with random weights of `shape` (keys of
    a Llama shape plus head_dim, experts, top_k, expert_inter): per-head q/k norms, an F32
    router, each projection of all experts as one 3-D tensor in `mix`'s types (Q4_K_M:
    Q4_K, the down projections Q6_K where llama.cpp's recipe puts ffn_down at Q6_K)."""
    import gguf

    rng = np.random.default_rng(seed)
    h, n_layers, heads, kv_heads = shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"]
    d, n_exp, e_inter, vocab = shape["head_dim"], shape["experts"], shape["expert_inter"], shape["vocab"]
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(shape["inter"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(shape["top_k"])
    w.add_expert_feed_forward_length(e_inter)
    vocab = _add_vocab(w, vocab, vocab_from)

    def type_of(name: str, layer: int) -> str:
        return q4_k_m_type(name, layer, n_layers) if mix == "q4_k_m" else mix.upper()

    def add(name: str, qtype: str, rows: int, cols: int, experts: int = 0) -> None:
        _add_blocks(w, rng, name, qtype, rows, cols, experts)

    def add_f32(name: str, *dims: int, mean: float = 1.0) -> None:
        w.add_tensor(name, (mean + 0.1 * rng.standard_normal(dims)).astype(np.float32))

    add("token_embd.weight", type_of("token_embd", 0), vocab, h)
    for i in range(n_layers):
        b = f"blk.{i}"
        add_f32(f"{b}.attn_norm.weight", h)
        add_f32(f"{b}.ffn_norm.weight", h)
        add_f32(f"{b}.attn_q_norm.weight", d)
        add_f32(f"{b}.attn_k_norm.weight", d)
        add(f"{b}.attn_q.weight", type_of("attn_q", i), heads * d, h)
        add(f"{b}.attn_k.weight", type_of("attn_k", i), kv_heads * d, h)
        add(f"{b}.attn_v.weight", type_of("attn_v", i), kv_heads * d, h)
        add(f"{b}.attn_output.weight", type_of("attn_output", i), h, heads * d)
        add_f32(f"{b}.ffn_gate_inp.weight", n_exp, h, mean=0.0)
        add(f"{b}.ffn_gate_exps.weight", type_of("ffn_gate", i), e_inter, h, n_exp)
        add(f"{b}.ffn_up_exps.weight", type_of("ffn_up", i), e_inter, h, n_exp)
        add(f"{b}.ffn_down_exps.weight", type_of("ffn_down", i), h, e_inter, n_exp)
    add_f32("output_norm.weight", h)
    add("output.weight", type_of("output", 0), vocab, h)
    _write_out(w)


def _add_vocab(w: Any, vocab: int, vocab_from: str | None) -> int:
    """`vocab_from`'s BPE vocabulary into writer `w`, or `vocab` placeholder tokens without
    merges; returns the vocabulary size."""
    if vocab_from is not None:
        return _copy_bpe_vocab(w, vocab_from)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    return vocab


def _add_blocks(w: Any, rng: np.random.Generator, name: str, qtype: str, rows: int, cols: int,
                experts: int = 0) -> None:
    """A random [rows, cols] tensor of `qtype` blocks, or `experts` of them stacked 3-D."""
    import gguf

    data = random_blocks(qtype, rows * max(experts, 1), cols, rng)
    if experts:
        data = data.reshape(experts, rows, data.shape[1])
    w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])


def _write_out(w: Any) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _copy_bpe_vocab(w: Any, source: str) -> int:
    """Tokens, types, merges and special ids of `source`'s BPE vocabulary into writer `w`;
    returns the vocabulary size."""
    from pagellm.model_executor.weight_utils import gguf_field, open_gguf

    reader = open_gguf(source)

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    if gguf_field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{source}: vocab_from needs a gpt2-style (BPE) vocabulary")
    tokens = strings("tokenizer.ggml.tokens")
    types = reader.fields["tokenizer.ggml.token_type"]
    w.add_tokenizer_model("gpt2")
    pre = gguf_field(reader, "tokenizer.ggml.pre")
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([int(types.parts[i][0]) for i in types.data])
    w.add_token_merges(strings("tokenizer.ggml.merges"))
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id)):
        token_id = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            add(token_id)
    template = gguf_field(reader, "tokenizer.chat_template")
    if template:
        w.add_chat_template(template)
    return len(tokens)


def main(argv: Any = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--mix", default="q4_k_m", help="q4_k_m or one type name (Q8_0, Q4_0, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-from", default=None,
                   help="GGUF whose BPE vocabulary to use (default for every shape but tiny: "
                        "pagellm's default model)")
    args = p.parse_args(argv)
    vocab_from = args.vocab_from
    if vocab_from is None and args.shape not in ("tiny", "tiny-moe"):
        from pagellm.model_executor.loader import default_model_path

        vocab_from = default_model_path()
    write = write_qwen3_moe_gguf if args.shape in MOE_SHAPES else write_llama_gguf
    write(args.path, SHAPES[args.shape], args.mix, args.seed, vocab_from=vocab_from)
    print(args.path)


if __name__ == "__main__":
    main()
