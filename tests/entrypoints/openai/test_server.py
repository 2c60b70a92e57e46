"""The OpenAI-compatible server, driven by the official `openai` client: results equal
LLM.generate, streaming equals non-streaming, bad input gets OpenAI errors."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pagellm import LLM, SamplingParams

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three fruits."}]


API_KEY = "sk-pagellm-test"  # the key the `server` fixture starts with


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    assert server.api_key == API_KEY
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM(multiprocess_mode=False, max_model_len=1024)
    yield llm
    llm.shutdown()


def test_completion_equals_llm_generate(client, model, llm) -> None:
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, logprobs=2), use_tqdm=False)[0].outputs[0]
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2)
    choice = resp.choices[0]
    assert choice.text == ref.text
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == 5 + len(ref.token_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ref.token_ids)
    for got, tok, entry in zip(lp.token_logprobs, ref.token_ids, ref.logprobs):
        assert got == pytest.approx(entry[tok].logprob, abs=1e-3)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == ref.text

    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == ref.text


def test_completion_n2_stop_seed_and_batch(client, model, llm) -> None:
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    stop = ref.text[6:9]
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop])
    assert resp.choices[0].text == ref.text[: ref.text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"

    seeded = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=42, n=2)
    a = client.completions.create(**seeded)
    b = client.completions.create(**seeded)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1]
    ref_n2 = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=42, n=2, max_tokens=16), use_tqdm=False)[0]
    assert sorted(c.text for c in a.choices) == sorted(c.text for c in ref_n2.outputs)

    batch = client.completions.create(model=model, prompt=[PROMPT, "Once upon a time"], max_tokens=8, temperature=0, echo=True)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text.startswith(PROMPT + ref.text[:10])
    ids = llm.get_tokenizer().encode(PROMPT)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == ref.text


def test_chat_equals_llm_chat_and_stream(client, model, llm) -> None:
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24, logprobs=3), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=24, temperature=0,
                                          logprobs=True, top_logprobs=3)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    content = resp.choices[0].logprobs.content
    assert len(content) == len(ref.outputs[0].token_ids)
    # exactly top_logprobs alternatives per token, the most likely first (OpenAI's shape)
    assert all(len(c.top_logprobs) == 3 for c in content)
    for c, entry in zip(content, ref.outputs[0].logprobs):
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].logprob == pytest.approx(max(lp.logprob for lp in entry.values()), abs=1e-3)
    none = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=0)
    assert [len(c.top_logprobs) for c in none.choices[0].logprobs.content] == [0, 0, 0, 0]

    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.outputs[0].finish_reason]


def test_32_concurrent_streaming_chats(server, model) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, int]:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=16,
            temperature=0.5, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        pieces, usage = 0, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
            if chunk.usage:
                usage = chunk.usage
        return pieces, usage.completion_tokens, usage.prompt_tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        return await asyncio.gather(*[one(client, i) for i in range(32)])

    results = asyncio.run(main())
    assert len(results) == 32
    for pieces, completion_tokens, prompt_tokens in results:
        assert completion_tokens == 16
        assert 1 <= pieces <= 16 and prompt_tokens > 10


BAD_REQUESTS = [
    # (path, body, status, text that must appear in the message)
    ("/v1/completions", "{not json", 400, "Invalid JSON"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "top_k": -7}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": [], "max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**7], "max_tokens": 3}, 400, "vocabulary"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hello " * 1100, "max_tokens": 3}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 1100}]}, 400, "maximum context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"},
     400, "--trust-request-chat-template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, 400, "--trust-request-chat-template"),
]


def test_bad_requests_get_openai_errors(server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body, status, needle in BAD_REQUESTS:
            if isinstance(body, str):
                r = http.post(path, content=body, headers={**headers, "content-type": "application/json"})
            else:
                r = http.post(path, json=body, headers=headers)
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == status
            assert needle.lower() in err["message"].lower(), (body, err)
        # a union-typed field is named as itself, not as the union member pydantic tried
        err = http.post("/v1/completions", json={"prompt": 5}, headers=headers).json()["error"]
        assert err["param"] == "prompt" and "prompt." not in err["message"]
        # streamed requests are checked before the 200 goes out, like unstreamed ones
        for body in ({"prompt": "x", "stop_token_ids": [99999999]}, {"prompt": "x", "logit_bias": {"99999999": 1}}):
            r = http.post("/v1/completions", json={**body, "max_tokens": 3, "stream": True}, headers=headers)
            assert r.status_code == 400 and "99999999" in r.json()["error"]["message"], r.text
        r = http.post("/v1/chat/completions", headers=headers, json={
            "messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": [99999999], "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
        missing_key = http.post("/v1/completions", json={"prompt": "x"})
        assert missing_key.status_code == 401 and "API key" in missing_key.json()["error"]["message"]
        wrong_key = http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong_key.status_code == 401
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, headers=headers)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert server.metric("pagellm:kv_cache_usage_perc") == 0.0
    assert server.metric("pagellm:num_requests_running") == 0.0


def test_closing_a_stream_aborts_the_request(server, model) -> None:
    aborts_before = server.metric('pagellm:request_success_total{engine="0",finished_reason="abort"')
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True,
                "stream": True}
        with http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            chunks = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                if chunks == 3:
                    break
    import time

    for _ in range(100):
        m = server.metrics()
        running = sum(v for k, v in m.items() if k.startswith("pagellm:num_requests_running"))
        aborted = sum(v for k, v in m.items() if 'finished_reason="abort"' in k and k.startswith("pagellm:request_success_total"))
        if running == 0 and aborted > aborts_before:
            break
        time.sleep(0.1)
    assert running == 0 and aborted == aborts_before + 1
    assert server.metric("pagellm:kv_cache_usage_perc") == 0.0


def test_tokenize_detokenize_version_models(server, client, model) -> None:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.api_key}"}) as http:
        tok = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tok["count"] == 5 and tok["max_model_len"] == 1024
        assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == PROMPT
        assert http.get("/version").json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == [model] and models[0].max_model_len == 1024


def test_client_gone_before_an_unstreamed_answer_aborts_it(server, model) -> None:
    aborts_before = server.metric('pagellm:request_success_total{engine="0",finished_reason="abort"')
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=2)
    import time

    for _ in range(100):  # 900 tokens take minutes; the abort comes within a step
        running = server.metric("pagellm:num_requests_running")
        aborted = server.metric('pagellm:request_success_total{engine="0",finished_reason="abort"')
        if running == 0 and aborted > aborts_before:
            break
        time.sleep(0.1)
    assert running == 0 and aborted == aborts_before + 1  # one request (its two choices)
    assert server.metric("pagellm:kv_cache_usage_perc") == 0.0


def test_echo_with_logprobs_scores_the_prompt(client, model, llm) -> None:
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = resp.choices[0].logprobs
    ids = [*ref.prompt_token_ids, *ref.outputs[0].token_ids]
    assert len(lp.tokens) == len(ids) == 5 + 3
    assert "".join(lp.tokens) == resp.choices[0].text == PROMPT + ref.outputs[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts it
    for got, tok, entry in zip(lp.token_logprobs[1:], ids[1:], [*ref.prompt_logprobs[1:], *ref.outputs[0].logprobs]):
        assert got == pytest.approx(entry[tok].logprob, abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_continuous_usage_and_chat_echo(client, model) -> None:
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True, logprobs=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    # every chunk counts the tokens streamed so far (its logprobs name its own tokens)
    sent = 0
    for c in chunks[:-1]:
        sent += len(c.choices[0].logprobs.tokens)
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (5, sent)
    assert sent == 4 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4

    messages = [*MESSAGES, {"role": "assistant", "content": "Apple, banana"}]
    body = dict(model=model, messages=messages, max_tokens=5, temperature=0,
                extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False})
    echoed = client.chat.completions.create(**body).choices[0].message.content
    plain = client.chat.completions.create(**{**body, "extra_body": {**body["extra_body"], "echo": False}})
    assert echoed == "Apple, banana" + plain.choices[0].message.content
    stream = client.chat.completions.create(**body, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == echoed


def test_models_lists_one_clean_id_and_accepts_its_aliases(server, default_model_path) -> None:
    """What a curl user types: the clean id from /v1/models, the file name, the GGUF's
    general.name, or no model at all; an unknown name is a 404."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["SmolLM2-135M-Instruct"]
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        texts = {}
        for model in ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      "Smollm2 135M 8k Lc100K Mix1 Ep2", None):
            sent = body if model is None else {**body, "model": model}
            r = http.post("/v1/completions", json=sent)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == (model or "SmolLM2-135M-Instruct")
            texts[model] = r.json()["choices"][0]["text"]
            chat = http.post("/v1/chat/completions", json={
                **({} if model is None else {"model": model}), "max_tokens": 2, "messages": MESSAGES})
            assert chat.status_code == 200, chat.text
        assert len(set(texts.values())) == 1
        r = http.post("/v1/completions", json={**body, "model": "SmolLM2"})
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "The model `SmolLM2` does not exist."
