"""vLLM's offline API surface, on a tiny model: the prompt types, LLM(...) arguments
vLLM scripts pass, defaults from generation_config.json, progress-bar factories, chat
options, and the SamplingParams rules that differ from a naive reading."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from pagellm import LLM, SamplingParams, TextPrompt, TokensPrompt
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import RequestOutputKind

IDS = [100 + 7 * j for j in range(12)]


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    # vLLM's own arguments, at values pagellm honours or accepts as its behaviour
    llm = LLM(model, multiprocess_mode=False, dtype=torch.float32, seed=None, quantization=None,
              kv_cache_dtype="auto", tokenizer_mode="auto", revision=None, tensor_parallel_size=1)
    yield llm
    llm.shutdown()


def test_vllm_prompt_types_and_arguments(llm) -> None:
    from pagellm.inputs import PromptType  # noqa: F401 - importable where vLLM has it

    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=IDS), greedy, use_tqdm=False)[0]
    text = llm.get_tokenizer().decode(IDS)
    by_text = llm.generate(TextPrompt(prompt=text), greedy, use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == IDS and len(by_ids.outputs[0].token_ids) == 5
    assert by_text.prompt == text
    with pytest.raises(ValueError, match=r"quantization='awq' is not supported; choose one of gguf or 'none' \(default: detected from the checkpoint\)"):
        LLM(quantization="awq")
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.generate("x", greedy, lora_request=object(), use_tqdm=False)


def test_progress_bar_factory_is_used(llm) -> None:
    made = []

    class Bar:
        def __init__(self, **kwargs):
            made.append(kwargs["total"])
            self.format_dict, self.postfix, self.n = {"elapsed": 1.0}, "", 0

        def update(self, k):
            self.n += k

        def close(self):
            made.append(self.n)

    llm.generate([TokensPrompt(prompt_token_ids=IDS)] * 3, SamplingParams(max_tokens=2), use_tqdm=Bar)
    assert made == [3, 3]


def test_defaults_come_from_generation_config(model, tmp_path) -> None:
    path = tmp_path / "with-defaults"
    shutil.copytree(model, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_new_tokens=7)
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(path), multiprocess_mode=False)
    try:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.6, 0.9, 20, 1.1, 7)
        out = llm.generate(TokensPrompt(prompt_token_ids=IDS), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 7 or out.finish_reason == "stop"
    finally:
        llm.shutdown()


def test_chat_options(llm) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]
    assert "A\nB" in llm.chat(parts, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt
    template = "{% for t in tools %}[{{ t.name }}]{% endfor %}{{ messages[0]['content'] }}"
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                   chat_template=template, tools=[{"name": "lookup"}])[0]
    assert out.prompt == "[lookup]hi"


def test_sampling_rules(llm) -> None:
    SamplingParams(repetition_penalty=2.5)  # any finite positive value, as in vLLM
    with pytest.raises(ValueError, match="repetition_penalty must be a finite number > 0"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match="bad_words entries must contain text"):
        SamplingParams(bad_words=[""])
    eos = llm.llm_engine.input_processor.eos_token_id
    # min_tokens holds EOS back even when EOS does not stop the request
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=3, ignore_eos=True, logit_bias={eos: 100})
    tokens = llm.generate(TokensPrompt(prompt_token_ids=IDS), params, use_tqdm=False)[0].outputs[0].token_ids
    assert eos not in tokens[:3] and tokens[3:] == [eos, eos]


def test_prompt_logprobs_survive_a_slow_consumer(model) -> None:
    """Prompt logprobs come one prefill chunk at a time; outputs that pile up behind a
    slow consumer are folded together, and none of the chunks may be lost."""
    prompt = [100 + (13 * j) % 4000 for j in range(101)]

    async def run(kind: RequestOutputKind) -> list:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=model, max_num_batched_tokens=32))
        try:
            params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, output_kind=kind)
            got = []
            async for out in engine.generate({"prompt_token_ids": prompt}, params, "r"):
                got.append(out)
                await asyncio.sleep(0.5)
            if kind == RequestOutputKind.DELTA:
                return [lp for out in got for lp in (out.prompt_logprobs or [])]
            return got[-1].prompt_logprobs
        finally:
            engine.shutdown()

    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        lps = asyncio.run(run(kind))
        assert len(lps) == 101 and lps[0] is None
        assert all(prompt[i + 1] in e for i, e in enumerate(lps[1:]))  # the scored token


def test_folding_outputs_keeps_every_prompt_logprob() -> None:
    def out(lps):
        return RequestOutput("r", None, [1, 2, 3], lps, [CompletionOutput(0, "", [], None, None)], False)

    delta = out([None, {2: 0.1}])
    delta.add(out([{3: 0.2}]), aggregate=True)
    assert delta.prompt_logprobs == [None, {2: 0.1}, {3: 0.2}]
    cumulative = out([None])
    cumulative.add(out([None, {2: 0.1}, {3: 0.2}]), aggregate=False)
    cumulative.add(out(None), aggregate=False)
    assert cumulative.prompt_logprobs == [None, {2: 0.1}, {3: 0.2}]
