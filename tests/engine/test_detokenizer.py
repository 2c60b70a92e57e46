"""Incremental detokenizer with the default model's real tokenizer: UTF-8 safety, stop
strings across token boundaries, streaming hold-back, and logprob decoding."""

from __future__ import annotations

from typing import Any

import pytest

from pagellm.core.protocol import EngineCoreRequest
from pagellm.engine.detokenizer import (
    BaseIncrementalDetokenizer,
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    check_stop_strings,
    convert_logprobs,
)
from pagellm.outputs import LogprobsLists
from pagellm.sampling_params import SamplingParams

MULTIBYTE = "héllo wörld 日本語 🎉"
KINDS = [FastIncrementalDetokenizer, SlowIncrementalDetokenizer]


def make_request(prompt_ids: list[int], **params: Any) -> EngineCoreRequest:
    return EngineCoreRequest("r", prompt_ids, SamplingParams(**params), 0.0)


def make_detok(tokenizer: Any, kind: type, prompt: str = "Say:", **params: Any) -> Any:
    request = make_request(tokenizer.encode(prompt), **params)
    if kind is FastIncrementalDetokenizer:
        return FastIncrementalDetokenizer(tokenizer.backend_tokenizer, request)
    return SlowIncrementalDetokenizer(tokenizer, request)


def stream(detok: BaseIncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feeds one token per step; returns each step's delta text."""
    deltas = []
    for token_id in token_ids:
        detok.update([token_id], stop_terminated=False)
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    return deltas


def test_factory_picks_fast_path_and_noop(tokenizer: Any) -> None:
    request = make_request([1, 2])
    assert isinstance(
        IncrementalDetokenizer.from_new_request(tokenizer, request), FastIncrementalDetokenizer
    )
    noop = IncrementalDetokenizer.from_new_request(None, request)
    assert noop.update([5, 6], False) is None and noop.output_token_ids == [5, 6]
    assert noop.get_next_output_text(True, False) == ""


@pytest.mark.parametrize("kind", KINDS)
def test_multibyte_text_token_by_token(tokenizer: Any, kind: type) -> None:
    ids = tokenizer.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE.split())  # characters really are split across tokens
    detok = make_detok(tokenizer, kind)
    deltas = stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE == tokenizer.decode(ids)
    assert detok.output_token_ids == ids


@pytest.mark.parametrize("kind", KINDS)
def test_skip_special_tokens(tokenizer: Any, kind: type) -> None:
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    skipped = make_detok(tokenizer, kind)
    assert "".join(stream(skipped, ids)) == "Hi there"
    kept = make_detok(tokenizer, kind, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == f"Hi{tokenizer.eos_token} there"


def test_first_token_decoded_in_prompt_context(tokenizer: Any) -> None:
    prompt_ids = tokenizer.encode("The answer is")
    ids = tokenizer.encode(" forty two")
    detok = FastIncrementalDetokenizer(tokenizer.backend_tokenizer, make_request(prompt_ids))
    assert "".join(stream(detok, ids)) == " forty two"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("include", "expected"), [(False, "Hello wo"), (True, "Hello world, th")])
def test_stop_string_across_token_boundary(
    tokenizer: Any, kind: type, include: bool, expected: str
) -> None:
    ids = tokenizer.encode("Hello world, this is a test.")
    detok = make_detok(tokenizer, kind, stop=["rld, th"], include_stop_str_in_output=include)
    # All tokens arrive in one step: those after the completing token are surplus.
    assert detok.update(ids, stop_terminated=False) == "rld, th"
    assert detok.output_text == expected
    completing = next(i for i in range(len(ids)) if "rld, th" in tokenizer.decode(ids[: i + 1]))
    assert detok.output_token_ids == ids[: completing + 1]
    assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_stop_string_ignored_within_min_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("stop here and stop there")
    detok = make_detok(tokenizer, FastIncrementalDetokenizer, stop=["stop"], min_tokens=2)
    assert detok.update(ids, stop_terminated=False) == "stop"
    assert detok.output_text == "stop here and "


def test_stop_token_text_excluded_unless_included(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world")  # pretend " world" is a stop token id
    detok = make_detok(tokenizer, FastIncrementalDetokenizer, stop_token_ids=[ids[-1]])
    assert detok.update(ids, stop_terminated=True) is None
    assert detok.output_text == "Hello" and detok.output_token_ids == ids
    detok = make_detok(tokenizer, FastIncrementalDetokenizer, include_stop_str_in_output=True)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == "Hello world"


def test_streaming_holds_back_partial_stop_string(tokenizer: Any) -> None:
    text = "one two three four five six"
    ids = tokenizer.encode(text)
    detok = make_detok(tokenizer, FastIncrementalDetokenizer, stop=["NEVER", "xyz"])
    assert detok.stop_buffer_length == 4
    streamed = ""
    for token_id in ids:
        detok.update([token_id], stop_terminated=False)
        streamed += detok.get_next_output_text(finished=False, delta=True)
        assert streamed == detok.output_text[: max(0, len(detok.output_text) - 4)]
    assert detok.get_next_output_text(finished=True, delta=True) == text[-4:]
    # Cumulative view: everything but the hold-back, then everything once finished.
    assert detok.get_next_output_text(finished=False, delta=False) == text[:-4]
    assert detok.get_next_output_text(finished=True, delta=False) == text


def test_streamed_text_never_shows_a_stop_string(tokenizer: Any) -> None:
    ids = tokenizer.encode("The end is near. END of story")
    detok = make_detok(tokenizer, FastIncrementalDetokenizer, stop=["END"])
    streamed = ""
    for token_id in ids:
        stop = detok.update([token_id], stop_terminated=False)
        streamed += detok.get_next_output_text(finished=stop is not None, delta=True)
        assert "END" not in streamed
        if stop is not None:
            break
    assert streamed == "The end is near. "


def test_check_stop_strings_only_searches_new_text() -> None:
    # The stop string lies wholly in old text: not found again.
    assert check_stop_strings("abcSTOPdef", 3, ["STOP"], False) is None
    # It ends in the new text (overlap into the old text is searched).
    assert check_stop_strings("abcSTOPdef", 5, ["STOP"], False) == ("STOP", 3)
    assert check_stop_strings("abcSTOPdef", 5, ["STOP"], True) == ("STOP", 7)
    assert check_stop_strings("abcSTOP", 1, ["STOP"], True) == ("STOP", -1)
    # Earliest match wins over list order.
    assert check_stop_strings("xaybz", 5, ["b", "a"], False) == ("a", 1)
    assert check_stop_strings("abc", 0, ["a"], False) is None


def test_convert_logprobs_decodes_and_ranks(tokenizer: Any) -> None:
    hello, world = tokenizer.encode("Hello"), tokenizer.encode(" world")
    lists = LogprobsLists(
        logprob_token_ids=[[world[0], hello[0], world[0], 7]],
        logprobs=[[-0.5, -0.1, -0.5, -3.0]],
        ranks=[2],
    )
    (position,) = convert_logprobs(tokenizer, lists, num_logprobs=2)
    assert list(position) == [world[0], hello[0]]
    assert position[world[0]].rank == 2 and position[world[0]].decoded_token == " world"
    assert position[hello[0]].rank == 1 and position[hello[0]].logprob == -0.1
    (everything,) = convert_logprobs(None, lists, num_logprobs=-1)
    assert len(everything) == 3 and everything[7].decoded_token is None
