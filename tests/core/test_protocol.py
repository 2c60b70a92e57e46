"""Wire messages: an EngineCoreOutputs carrying the runner's LogprobsLists (defined in
pagellm/outputs.py, outside core) survives the msgpack round trip exactly."""

from __future__ import annotations

from pagellm.core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    FinishReason,
    engine_identity,
    rank_of_identity,
)
from pagellm.core.serial import encode, outputs_decoder, ready_decoder
from pagellm.outputs import LogprobsLists


def test_logprobs_cross_the_wire_as_logprobs_lists() -> None:
    sampled = LogprobsLists([[7, 7, 3]], [[-0.25, -0.25, -1.5]], [1])
    prompt = LogprobsLists([[4, 9], [5, 4]], [[-2.0, -0.5], [-0.75, -0.75]], [2, 1])
    sent = EngineCoreOutputs(
        engine_index=1,
        outputs=[
            EngineCoreOutput(
                "req-0",
                [7],
                new_logprobs=sampled,
                new_prompt_logprobs=prompt,
                finish_reason=FinishReason.LENGTH,
            )
        ],
        timestamp=12.5,
    )
    got = outputs_decoder.decode(encode(sent))
    assert got == sent
    assert type(got.outputs[0].new_logprobs) is LogprobsLists
    assert got.outputs[0].new_prompt_logprobs == prompt


def test_ready_response_crosses_the_wire() -> None:
    sent = EngineCoreReadyResponse(num_gpu_blocks=123)
    assert ready_decoder.decode(encode(sent)) == sent


def test_engine_identity_round_trips_every_rank() -> None:
    assert engine_identity(0) == b"\x00\x00" and engine_identity(258) == b"\x02\x01"
    assert [rank_of_identity(engine_identity(r)) for r in (0, 1, 7, 65535)] == [0, 1, 7, 65535]
