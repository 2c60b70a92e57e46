"""The engine's max_logprobs (EngineArgs / --max-logprobs, vLLM's default 20) refuses a
request asking for more logprobs or prompt logprobs, in vLLM's words and naming the field;
-1 on either side means the whole vocabulary. No engine is started."""

from __future__ import annotations

import dataclasses
import types

import pytest

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.input_processor import InputProcessor
from pagellm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_config(tiny_model):
    config = EngineArgs(model=tiny_model("llama"), max_logprobs=5, max_model_len=64).create_engine_config()
    return config.model_config


def _process(model_config, **params) -> None:
    processor = InputProcessor(model_config, tokenizer=types.SimpleNamespace(eos_token_id=None))
    processor.process_inputs("r", [1, 2, 3], SamplingParams(max_tokens=2, **params))


def test_engine_args_default_is_vllms() -> None:
    assert EngineArgs().max_logprobs == 20


def test_logprobs_over_the_cap_are_refused(model_config) -> None:
    assert model_config.max_logprobs == 5
    _process(model_config, logprobs=5, prompt_logprobs=5)  # at the cap: accepted
    with pytest.raises(ValueError) as e:
        _process(model_config, logprobs=6)
    assert str(e.value) == ("Requested sample logprobs of 6, which is greater than max allowed: 5 "
                            "(logprobs=6 is over the engine's max_logprobs=5).")
    with pytest.raises(ValueError, match=r"^Requested prompt logprobs of 7, .* \(prompt_logprobs=7 is over"):
        _process(model_config, prompt_logprobs=7)
    vocab = model_config.vocab_size
    with pytest.raises(ValueError, match=f"^Requested sample logprobs of {vocab}, which is greater than max"):
        _process(model_config, logprobs=-1)


def test_minus_one_allows_the_whole_vocabulary(model_config) -> None:
    everything = dataclasses.replace(model_config, max_logprobs=-1)
    _process(everything, logprobs=-1, prompt_logprobs=model_config.vocab_size)


def test_a_cap_below_minus_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^max_logprobs must be -1 \(the vocabulary\) or >= 0, got -2\.$"):
        EngineArgs(max_logprobs=-2).verify_args()
