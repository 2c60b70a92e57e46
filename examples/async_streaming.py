"""Streaming with `AsyncLLM`: each request is an async generator of outputs; with
`RequestOutputKind.DELTA` every output carries only the new text. Several requests run
concurrently in one batch.

    python examples/async_streaming.py
"""

import asyncio

from pagellm import AsyncLLM, EngineArgs, SamplingParams
from pagellm.sampling_params import RequestOutputKind


async def stream(engine: AsyncLLM, prompt: str, request_id: str) -> str:
    params = SamplingParams(temperature=0, max_tokens=24, output_kind=RequestOutputKind.DELTA)
    text = ""
    async for output in engine.generate(prompt, params, request_id):
        delta = output.outputs[0].text
        print(f"[{request_id}] {delta!r}", flush=True)
        text += delta
        if output.finished:
            print(f"[{request_id}] finished: {output.outputs[0].finish_reason}")
    return text


async def main() -> None:
    engine = AsyncLLM.from_engine_args(EngineArgs())
    try:
        prompts = ["The capital of France is", "Once upon a time"]
        texts = await asyncio.gather(*(stream(engine, p, f"req-{i}") for i, p in enumerate(prompts)))
        for prompt, text in zip(prompts, texts):
            print(f"\n{prompt}{text}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
