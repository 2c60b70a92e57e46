"""How much of an agent's history each turn computes again (#34's target: a tool round trip
adds no more than one prefill of the history per turn). The OpenAI Agents SDK runs an agent
with one function tool against its own `pagellm serve` (loopback, no tool flags, the
default model unless --model), through both of its models: the Responses API (its default)
and chat completions. Around every model call the script reads the server's prefix-cache
counters (`pagellm:prefix_cache_queries` / `prefix_cache_hits`) and prints, per turn, the
prompt tokens, the tokens computed (queried minus hit) and the new tokens since the last
turn's prompt; then the hit rate of all turns after the first.

    python benchmarks/agent_prefix.py [--runs 5] [--model M] [-- extra serve flags]

The first turn forces the tool call (`tool_choice="required"`); the SDK then resets it to
auto, as in the Agents SDK's own loop. Tracing is off (it would export to OpenAI).
"""

from __future__ import annotations

import argparse
import asyncio
import os

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # before agents is imported

import httpx
from local_server import local_server, metric_sum

CITIES = ["London", "Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth"]
BLOCK = 16
"""The KV block size: a prompt's last partial block is always computed again."""


def _counters(url: str) -> tuple[float, float]:
    """(prefix-cache queries, hits) so far, in tokens."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return metric_sum(text, "prefix_cache_queries_total"), metric_sum(text, "prefix_cache_hits_total")


async def one_run(url: str, model_kind: str, city: str) -> list[dict]:
    """Runs the agent once; per model call: prompt tokens and tokens computed."""
    import openai
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelBehaviorError,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        RunHooks,
        Runner,
        function_tool,
    )

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    name = (await client.models.list()).data[0].id
    model = (OpenAIResponsesModel(model=name, openai_client=client) if model_kind == "responses"
             else OpenAIChatCompletionsModel(model=name, openai_client=client))
    turns: list[dict] = []

    class Marks(RunHooks):
        async def on_llm_start(self, context, agent, system_prompt, input_items) -> None:
            self.before = _counters(url)

        async def on_llm_end(self, context, agent, response) -> None:
            after = _counters(url)
            queried = after[0] - self.before[0]
            turns.append({"prompt": response.usage.input_tokens, "queried": queried,
                          "computed": queried - (after[1] - self.before[1])})

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"Sunny, 21 C in {city}"

    agent = Agent(name="weather", model=model, tools=[get_weather], instructions="You tell the weather.",
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=256))
    try:
        async with client:  # closed inside this event loop (asyncio.run closes it after)
            await Runner.run(agent, f"What is the weather like in {city} today?", max_turns=4, hooks=Marks())
    except MaxTurnsExceeded:
        pass  # the small model may call the tool again: every turn is still counted
    except ModelBehaviorError as e:  # a reply cut at max_tokens: the turns before it count
        print(f"  (run ended early: {e})")
    return turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="agent runs per model kind")
    ap.add_argument("--model", default=None)
    ap.add_argument("serve_flags", nargs="*", help="extra flags for pagellm serve (after --)")
    args = ap.parse_args()
    for kind in ("responses", "chat"):
        # a server of its own per kind: the other kind's turns would be in its cache
        with local_server(args.model, args.serve_flags) as (_, url):
            later_queried = later_computed = 0.0
            worst = 0.0
            print(f"Agents SDK, {kind} model: per turn prompt tokens / computed (new since the last prompt)")
            for i in range(args.runs):
                turns = asyncio.run(one_run(url, kind, CITIES[i % len(CITIES)]))
                cells = []
                for j, t in enumerate(turns):
                    new = t["prompt"] - turns[j - 1]["prompt"] if j else t["prompt"]
                    cells.append(f"{t['prompt']:4d} / {t['computed']:4.0f} ({new})")
                    if j:
                        later_queried += t["queried"]
                        later_computed += t["computed"]
                        worst = max(worst, t["computed"] - new)
                print(f"  run {i + 1}: " + "   ".join(cells))
            if later_queried:
                print(f"  turns after the first: {1 - later_computed / later_queried:.1%} of prompt tokens "
                      f"found in the prefix cache; at most {worst:.0f} tokens computed beyond the new ones "
                      f"(a block is {BLOCK})")


if __name__ == "__main__":
    main()
