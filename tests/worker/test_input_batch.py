"""InputBatch's per-row logprob counts: NO_LOGPROBS for a row that asked for none,
ALL_LOGPROBS (-1) for the whole vocabulary, and the batch-wide maximum the sampler gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.sampling_params import ALL_LOGPROBS, SamplingParams
from pagellm.worker.input_batch import NO_LOGPROBS, CachedRequestState, InputBatch

VOCAB = 50


def batch_with(*logprobs: int | None) -> InputBatch:
    batch = InputBatch(max_num_reqs=4, max_model_len=8, max_blocks_per_req=2, vocab_size=VOCAB)
    for i, lp in enumerate(logprobs):
        state = CachedRequestState(f"r{i}", [1, 2], SamplingParams(temperature=0, logprobs=lp), None, [])
        batch.add_request(state, [i + 1], 0)
    return batch


def max_num_logprobs(batch: InputBatch) -> int | None:
    rows = np.arange(batch.num_reqs)
    return batch.make_sampling_metadata(rows, torch.device("cpu")).max_num_logprobs


def test_the_sentinels_are_distinct_and_outside_the_counts() -> None:
    assert ALL_LOGPROBS == -1 and NO_LOGPROBS == -2
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=NO_LOGPROBS)


@pytest.mark.parametrize(
    ("logprobs", "expected"),
    [((None, None), None), ((None, 3), 3), ((0, None), 0), ((ALL_LOGPROBS, None), VOCAB),
     # a whole-vocabulary row beside a top-k row: the vocabulary, not k (was k)
     ((ALL_LOGPROBS, 3), VOCAB), ((5, ALL_LOGPROBS, None), VOCAB)],
)
def test_max_num_logprobs_over_the_rows(logprobs: tuple, expected: int | None) -> None:
    batch = batch_with(*logprobs)
    assert list(batch.num_logprobs[: len(logprobs)]) == [NO_LOGPROBS if lp is None else lp for lp in logprobs]
    assert max_num_logprobs(batch) == expected
