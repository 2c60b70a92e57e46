"""Shared test helpers: tiny random-weight models of every family saved as HF
directories, and `PagedRunner`, which drives a pagellm model over sequences with a real
paged KV cache (blocks, slot mapping, attention metadata) without the engine.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.attention import get_attn_backend
from pagellm.attention.backend import (
    AttentionGroups,
    CommonAttentionMetadata,
    model_layer_windows,
    set_forward_context,
)
from pagellm.config import ModelConfig, ServedModelNames

TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe",
                 "phi3")
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
"""Gemma 3's two rope settings, the global one scaled (as in the 4B and larger models)."""
_TINY_CACHE: dict[str, str] = {}


def token_ids(n: int, offset: int = 13) -> list[int]:
    """n deterministic ids spread over the default vocabulary's ordinary tokens."""
    return [(i * 7919 + offset) % 49000 + 100 for i in range(n)]


def _tiny_config(family: str, vocab_size: int, tok: Any, **overrides: Any) -> Any:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        SmolLM3Config,
    )

    common: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.05,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    if family == "llama":
        cfg = LlamaConfig(**{**common, "rope_theta": 10000.0, **overrides})
    elif family == "mistral":  # sliding_window: None unless overridden
        cfg = MistralConfig(**{**common, "rope_theta": 10000.0, "sliding_window": None, **overrides})
    elif family == "qwen2":
        cfg = Qwen2Config(**{**common, "rope_theta": 1000000.0, **overrides})
    elif family == "qwen3":  # head_dim deliberately != hidden / heads
        cfg = Qwen3Config(**{**common, "head_dim": 32, **overrides})
    elif family in ("gemma2", "gemma3"):
        # three layers, a window of 8 on all but the last: sliding and global layers both
        # matter from 9 tokens on; query_pre_attn_scalar deliberately != head_dim
        layers = overrides.pop("num_hidden_layers", 3)  # the last one global
        gemma: dict[str, Any] = dict(
            num_hidden_layers=layers, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
            pad_token_id=0,
        )
        if family == "gemma2":  # caps low enough to bend the random model's scores
            gemma.update(attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
            cfg = Gemma2Config(**{**common, **gemma, **overrides})
        else:
            cfg = Gemma3TextConfig(**{**common, **gemma, "rope_parameters": GEMMA3_ROPE, **overrides})
        cfg.architectures = [f"{family.capitalize()}ForCausalLM"]
        return cfg
    elif family in ("qwen2_moe", "qwen3_moe"):
        # 8 experts of 32, top 2 (Qwen3: renormalised); the second layer dense
        # (mlp_only_layers), Qwen2's shared expert of 64 behind its gate
        moe: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   mlp_only_layers=[1], decoder_sparse_step=1)
        if family == "qwen2_moe":
            cfg = Qwen2MoeConfig(**{**common, **moe, "shared_expert_intermediate_size": 64,
                                    "rope_theta": 1000000.0, **overrides})
        else:
            cfg = Qwen3MoeConfig(**{**common, **moe, "head_dim": 16, "norm_topk_prob": True,
                                    **overrides})
    elif family == "phi3":  # untied as Phi-3 (Phi-4-mini ties); no window unless overridden
        cfg = Phi3Config(**{**common, "rope_theta": 10000.0, "sliding_window": None,
                            "tie_word_embeddings": False, "pad_token_id": None, **overrides})
    elif family == "smollm3":  # four layers: the last without rope
        cfg = SmolLM3Config(**{**common, "num_hidden_layers": 4, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0}, "pad_token_id": None, **overrides})
    elif family == "mixtral":  # 8 experts of the config's intermediate size, top 2
        cfg = MixtralConfig(**{**common, "intermediate_size": 32, "num_local_experts": 8,
                               "num_experts_per_tok": 2, "sliding_window": None, **overrides})
    else:
        raise ValueError(f"unknown tiny family {family!r}; choose from {TINY_FAMILIES}")
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0, which would hide loading mistakes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            if "norm" in name:
                p.copy_(1.0 + noise)
            elif name.endswith("bias"):
                p.copy_(noise)


def make_tiny_model(family: str, tmp_path_factory: Any, seed: int = 0, **overrides: Any) -> str:
    """Directory of a tiny random-weight HF model of `family` (one of TINY_FAMILIES):
    config.json, model.safetensors, generation_config.json and the default model's
    tokenizer (so vocab ids line up with real text). Deterministic; cached per session.
    `overrides` go into the config (e.g. tie_word_embeddings=False, rope_scaling={...})."""
    from transformers import AutoModelForCausalLM

    from pagellm.model_executor.loader import default_model_path, load_tokenizer

    key = json.dumps([family, seed, overrides], sort_keys=True)
    if key in _TINY_CACHE:
        return _TINY_CACHE[key]
    tok = load_tokenizer(default_model_path())
    # vocab_size may be overridden upward, for tokens a test adds to the tokenizer copy
    cfg = _tiny_config(family, overrides.pop("vocab_size", len(tok)), tok, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    out = str(tmp_path_factory.mktemp(f"tiny-{family}"))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _TINY_CACHE[key] = out
    return out


def make_model_config(
    path: str, dtype: torch.dtype = torch.float32, max_model_len: int = 512,
    quantization: str | None = None, gguf_activations: str = "auto",
) -> ModelConfig:
    """A ModelConfig as EngineArgs builds it; `gguf_activations` 'auto' is resolved when
    the model loads (PAGELLM_GGUF_ACTIVATIONS, else the CPU rule)."""
    from pagellm.model_executor.loader import load_generation_config, load_hf_config

    return ModelConfig(
        model=path,
        model_path=path,
        tokenizer=path,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=0,
        served_names=ServedModelNames([os.path.basename(path)], []),
        hf_config=load_hf_config(path),
        generation_config=load_generation_config(path),
        quantization=quantization,
        gguf_activations=gguf_activations,
    )


@dataclass
class _Seq:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedRunner:
    """Runs a pagellm model step by step over named sequences with a real paged cache.

    Blocks are handed out in shuffled order so block tables are never contiguous.
    `step([(seq_id, n), ...])` runs the next n uncomputed tokens of each sequence in one
    flattened batch and returns the logits of each chunk's last token [num_seqs, vocab].
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        block_size: int = 16,
        num_blocks: int = 256,
        backend: str = "torch",
        device: str = "cpu",
        seed: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """kv_dtype: the cache's storage dtype (default: the model's compute dtype)."""
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        kvh, d = model_config.num_kv_heads, model_config.head_dim

        attn_backend = get_attn_backend(backend)

        def layer_cache() -> tuple[torch.Tensor, torch.Tensor]:
            k, v = attn_backend.allocate_kv_cache(
                num_blocks, block_size, kvh, d, kv_dtype or model_config.torch_dtype, self.device
            )
            return k.zero_(), v.zero_()

        self.kv_caches = [layer_cache() for _ in range(model_config.num_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.groups = AttentionGroups(attn_backend, block_size, self.device,
                                      model_layer_windows(model))
        self.builder = self.groups.primary
        self.seqs: dict[str, _Seq] = {}

    def add(self, seq_id: str, token_ids: list[int]) -> None:
        self.seqs[seq_id] = _Seq(list(token_ids))

    def add_with_prefix(
        self, seq_id: str, token_ids: list[int], src_id: str, num_blocks: int
    ) -> None:
        """Start `seq_id` with the first `num_blocks` full blocks of `src_id` already cached
        (as a prefix-cache hit would): those block ids are shared, not recomputed."""
        src = self.seqs[src_id]
        n = num_blocks * self.block_size
        assert src.num_computed >= n and src.tokens[:n] == list(token_ids[:n])
        self.seqs[seq_id] = _Seq(list(token_ids), n, src.blocks[:num_blocks])

    def append(self, seq_id: str, token_id: int) -> None:
        self.seqs[seq_id].tokens.append(token_id)

    def step(self, chunks: list[tuple[str, int]], every_row: bool = False) -> torch.Tensor:
        """every_row: the logits of every row of the step, not only each chunk's last."""
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for seq_id, n in chunks:
            seq = self.seqs[seq_id]
            start, end = seq.num_computed, seq.num_computed + n
            assert end <= len(seq.tokens), f"{seq_id}: only {len(seq.tokens)} tokens"
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free_blocks.pop())
            ids += seq.tokens[start:end]
            positions += range(start, end)
            # token at position p lives in block p // bs, offset p % bs
            slots += [seq.blocks[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(start, end)]  # fmt: skip
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            seq.num_computed = end
        common = self._common(chunks, ids, qsl, seq_lens, slots)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        metadata, by_window = self.groups.build(common)
        with (
            torch.inference_mode(),
            set_forward_context(metadata, self.kv_caches, None, by_window),
        ):
            hidden = self.model(t(ids), t(positions))
            return self.model.compute_logits(hidden if every_row else hidden[t(qsl[1:]) - 1])

    def _common(
        self, chunks: list[tuple[str, int]], ids: list[int], qsl: list[int],
        seq_lens: list[int], slots: list[int],
    ) -> CommonAttentionMetadata:  # fmt: skip
        max_blocks = max(len(self.seqs[s].blocks) for s, _ in chunks)
        table = torch.zeros(len(chunks), max_blocks, dtype=torch.long)
        for i, (seq_id, _) in enumerate(chunks):
            blocks = self.seqs[seq_id].blocks
            table[i, : len(blocks)] = torch.tensor(blocks)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return CommonAttentionMetadata(
            num_reqs=len(chunks),
            num_actual_tokens=len(ids),
            query_start_loc=t(qsl),
            seq_lens=t(seq_lens),
            block_table=table.to(self.device),
            slot_mapping=t(slots),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )

    def greedy(
        self, seq_id: str, prompt: list[int], max_new_tokens: int, banned: Sequence[int] = ()
    ) -> list[int]:
        """Prefill `prompt` in one chunk, then decode greedily without stopping; `banned`
        ids (e.g. EOS, as HF's min_new_tokens does) are never chosen."""
        self.add(seq_id, prompt)
        logits = self.step([(seq_id, len(prompt))])
        out: list[int] = []
        for _ in range(max_new_tokens):
            if banned:
                logits = logits.index_fill(1, torch.tensor(list(banned)), float("-inf"))
            token = int(logits[0].argmax())
            out.append(token)
            self.append(seq_id, token)
            if len(out) < max_new_tokens:
                logits = self.step([(seq_id, 1)])
        return out


def import_benchmark(name: str) -> Any:
    """A script of benchmarks/ (compare.py, perplexity.py, ...) as a module: they are
    scripts, not a package, and import each other by name."""
    import importlib
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
