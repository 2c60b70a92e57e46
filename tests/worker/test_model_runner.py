"""The model runner against the scheduler's contract: it runs what a SchedulerOutput
says, applies a step's token bitmask to the constrained rows only, and refuses a step
whose computed-token count disagrees with its own (the KV cache would be misread)."""

from __future__ import annotations

import pytest
import torch

from pagellm.engine.arg_utils import EngineArgs
from pagellm.sampling_params import SamplingParams
from pagellm.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagellm.worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_model) -> ModelRunner:
    config = EngineArgs(model=tiny_model("llama"), max_model_len=64, block_size=4).create_engine_config()
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(32)
    return runner


def _new(req_id: str, prompt: list[int], blocks: list[int]) -> NewRequestData:
    return NewRequestData(req_id, prompt, [], SamplingParams(temperature=0, max_tokens=8), blocks, 0)


def _step(new: list[NewRequestData], cached: CachedRequestData, num: dict[str, int], **kw) -> SchedulerOutput:
    return SchedulerOutput(new, cached, num, sum(num.values()), set(), **kw)


def test_bitmask_constrains_only_its_row_and_counts_are_checked(runner: ModelRunner) -> None:
    vocab = runner.model_config.vocab_size
    out = runner.execute_model(_step([_new("a", [5, 6, 7], [1]), _new("b", [8, 9, 10], [2])],
                                     CachedRequestData(), {"a": 3, "b": 3}))
    free_a, free_b = out.sampled_token_ids
    # Step 2: "b" may only produce token 11 (bit 11 of its row); "a" is left alone.
    allowed = 11 if free_b[0] != 11 else 12
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[0, allowed // 32] = 1 << (allowed % 32)
    cached = CachedRequestData(["a", "b"], [[], []], [3, 3])
    out = runner.execute_model(_step([], cached, {"a": 1, "b": 1}, grammar_bitmask=bitmask,
                                     structured_output_request_ids={"b": 0}))
    assert out.sampled_token_ids[1] == [allowed]
    assert len(out.sampled_token_ids[0]) == 1 and len(free_a) == 1

    wrong = CachedRequestData(["a"], [[]], [3])  # the runner has computed 4 tokens of "a"
    with pytest.raises(RuntimeError, match="request a: the scheduler counts 3 computed tokens, the model runner 4"):
        runner.execute_model(_step([], wrong, {"a": 1}))
