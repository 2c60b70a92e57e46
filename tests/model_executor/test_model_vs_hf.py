"""Model numerics against Hugging Face transformers on the same weights: greedy tokens of
the default GGUF model, and last-position logits of tiny random models of every family
(GQA, tied/untied embeddings, llama3 rope scaling, qkv bias, q/k norm, explicit head_dim).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagellm.model_executor.loader import get_model, load_tokenizer
from tests.utils import PagedRunner, make_model_config

NEW_TOKENS = 64
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def gguf_pair(default_model_path: str) -> tuple[Any, Any, Any]:
    """(pagellm model + config, HF model, tokenizer) for the default GGUF; HF load ~35 s."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_model_path)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    mc = make_model_config(default_model_path)
    ours = get_model(mc, torch.device("cpu"))
    return (ours, mc), hf.eval(), load_tokenizer(default_model_path)


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            min_new_tokens=n,
            max_new_tokens=n,
            pad_token_id=hf.config.eos_token_id,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_default_gguf_greedy_matches_transformers(
    gguf_pair: tuple[Any, Any, Any], kind: str
) -> None:
    (ours, mc), hf, tok = gguf_pair
    if kind == "text":
        prompt = tok("The capital of France is")["input_ids"]
    else:
        messages = [{"role": "user", "content": "Write a haiku about paged memory."}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
    expected = _hf_greedy(hf, prompt, NEW_TOKENS)
    eos = hf.generation_config.eos_token_id
    got = PagedRunner(ours, mc).greedy(
        "s", prompt, NEW_TOKENS, banned=[eos] if isinstance(eos, int) else eos
    )
    assert got == expected, (
        f"first divergence at {next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)}"
    )


def _hf_last_logits(model_dir: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0, -1].float()


TINY_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-untied": ("qwen3", {"tie_word_embeddings": False}),
}


@pytest.mark.parametrize("case", list(TINY_CASES))
@pytest.mark.parametrize("length", [1, 7, 33, 130])
def test_tiny_model_logits_match_transformers(
    tiny_model: Callable[..., str], case: str, length: int
) -> None:
    family, overrides = TINY_CASES[case]
    model_dir = tiny_model(family, **overrides)
    prompt = [(i * 7919 + 13) % 49000 + 100 for i in range(length)]
    mc = make_model_config(model_dir)
    runner = PagedRunner(get_model(mc, torch.device("cpu")), mc)
    runner.add("s", prompt)
    logits = runner.step([("s", length)])
    expected = _hf_last_logits(model_dir, prompt)
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


def test_tiny_configs_exercise_their_feature(tiny_model: Callable[..., str]) -> None:
    """Guards the oracle: each case really has the property it claims to test."""
    from pagellm.model_executor.layers.rotary_embedding import get_rope_params

    mc = make_model_config(tiny_model("llama", rope_parameters=LLAMA3_ROPE))
    assert get_rope_params(mc.hf_config).rope_type == "llama3"
    untied = get_model(
        make_model_config(tiny_model("llama", tie_word_embeddings=False)), torch.device("cpu")
    )
    assert untied.lm_head is not None
    qwen3 = make_model_config(tiny_model("qwen3"))
    assert (
        qwen3.head_dim == 32 != qwen3.hf_config.hidden_size // qwen3.hf_config.num_attention_heads
    )
