"""The engine (batching, preemption and recompute, prefix caching, logprobs, n > 1) on
the families whose layers differ from Llama's: Gemma 3 (interleaved sliding and global
layers, two kinds of attention metadata a step) and Qwen3-MoE (experts chosen per token),
each against transformers on a tiny random-weight model (the engine core in-process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagellm import LLM, SamplingParams
from tests.utils import token_ids


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """HF's greedy choice recomputed over the whole sequence at every step."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="module", params=["gemma3", "qwen3_moe"])
def engine(request: pytest.FixtureRequest, tiny_model: Callable[..., str]) -> tuple[LLM, Any, str]:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(request.param)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, multiprocess_mode=False, dtype="float32", max_model_len=128, block_size=8)
    yield llm, hf, model_dir
    llm.shutdown()


PROMPTS = [token_ids(n, offset) for n, offset in ((30, 13), (12, 17), (21, 23), (5, 29))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_engine_batches_as_transformers(engine: tuple[LLM, Any, str]) -> None:
    """Four prompts of 5-30 tokens batched (Gemma 3: under a window of 8, two kinds of
    metadata a step; Qwen3-MoE: two of 8 experts per token): each request's 16 greedy
    tokens are transformers'."""
    llm, hf, _ = engine
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    gemma = type(runner.model).__name__.startswith("Gemma")
    assert set(runner.attn_groups.builders) == ({8, None} if gemma else {None})
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [_hf_greedy(hf, p, 16) for p in PROMPTS]


def test_engine_preempts_and_caches_prefixes(engine: tuple[LLM, Any, str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Preempted and recomputed (a cache of 10 blocks of 8 for four requests), and read
    again through a prefix-cache hit: the same tokens, every block back in the pool."""
    llm, _, model_dir = engine
    expected = [o.outputs[0].token_ids for o in
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    monkeypatch.setenv("PAGELLM_CHECK_INVARIANTS", "1")
    small = LLM(model_dir, multiprocess_mode=False, dtype="float32",
                max_model_len=64, block_size=8, num_gpu_blocks_override=10, max_num_seqs=4)
    try:
        core = small.llm_engine.engine_core.engine_core
        got = small.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == expected
        assert core.scheduler.num_preemptions_total > 0
        first, again = (small.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
                        for _ in range(2))
        assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 24)
        assert again.outputs[0].token_ids == expected[0]
        pool = core.scheduler.kv_cache_manager.block_pool
        pool.check_invariants()
        assert pool.get_num_free_blocks() == pool.num_usable_blocks == 9
    finally:
        small.shutdown()


def test_engine_logprobs_and_n(engine: tuple[LLM, Any, str]) -> None:
    """Greedy logprobs are transformers' log-softmax at each chosen token; n = 2 seeded
    samples repeat under the same seed."""
    llm, hf, _ = engine
    prompt = PROMPTS[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    seq = list(prompt)
    for token, entry in zip(out.token_ids, out.logprobs):
        with torch.inference_mode():
            expected = torch.log_softmax(hf(torch.tensor([seq])).logits[0, -1], -1)[token]
        assert entry[token].logprob == pytest.approx(float(expected), abs=1e-4)
        seq.append(token)
    sampled = SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=8, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, sampled, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompt}, sampled, use_tqdm=False)[0]
    assert len(first.outputs) == 2
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
