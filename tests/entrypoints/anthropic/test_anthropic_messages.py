"""Anthropic's Messages API on `pagellm serve` (issue #34, item 5), driven by the official
`anthropic` client: text and tool_use blocks, whole and streamed as Anthropic's events,
a tool round trip through tool_result, stop sequences, and a 4xx for bad input."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from pagellm.entrypoints.anthropic.protocol import (
    MessagesInputError,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    messages_param,
)
from tests.entrypoints.openai.conftest import ServerProcess

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = "Sunny, 21 C"
GREEDY = {"temperature": 0}  # this client version has no sampling arguments of its own


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--disable-ui")
    yield srv
    srv.stop()


def _client(srv: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=srv.api_key, max_retries=0, timeout=120)


def _model(srv: ServerProcess) -> str:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key).models.list().data[0].id


# -- the request as chat -------------------------------------------------------------------------


def test_content_blocks_become_chat_messages() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "..."},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": RESULT}]},
            {"type": "text", "text": "Thanks"},
        ]},
    ]
    assert chat_messages(messages) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": RESULT},
        {"role": "user", "content": "Thanks"},
    ]
    assert chat_tools([WEATHER_TOOL]) == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER_TOOL["input_schema"],
        "description": WEATHER_TOOL["description"]}}]
    assert chat_tool_choice({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)
    assert chat_tool_choice({"type": "tool", "name": "f"}) == ({"type": "function", "function": {"name": "f"}}, None)
    assert messages_param("tools[0].function.parameters") == "tools[0].input_schema"
    assert messages_param("max_completion_tokens") == "max_tokens"


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "system", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages[0].content[0].type"),
    ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "tool_result"}]}], "messages[0].content[0].tool_use_id"),
])
def test_bad_blocks_name_the_field(messages, param) -> None:
    with pytest.raises(MessagesInputError) as info:
        chat_messages(messages)
    assert info.value.param == param


# -- on a server ---------------------------------------------------------------------------------


def test_text_reply_equals_the_chat_reply_streamed_and_not(server) -> None:
    client, model = _client(server), _model(server)
    body = dict(model=model, max_tokens=12, messages=ASK, extra_body=GREEDY)
    client.messages.create(**{**body, "max_tokens": 1})  # the runs below all hit the cache
    reply = client.messages.create(**body)
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key).chat.completions.create(
        model=model, messages=ASK, max_tokens=12, temperature=0)
    assert reply.type == "message" and reply.role == "assistant" and reply.stop_reason == "max_tokens"
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == chat.choices[0].message.content
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    with client.messages.stream(**body) as stream:
        assert "".join(stream.text_stream) == reply.content[0].text
        assert stream.get_final_message().stop_reason == "max_tokens"

    raw = httpx.post(server.url + "/v1/messages", headers={"x-api-key": server.api_key}, timeout=60,
                     json={"model": model, "max_tokens": 3, "messages": ASK, "stream": True, **GREEDY})
    kinds = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    # One delta per token, unless the server merged the deltas of a stream its writer
    # had fallen behind on (AsyncLLM's collector does, as vLLM's): 1 to 3 of them.
    deltas = kinds.count("content_block_delta")
    assert 1 <= deltas <= 3 and kinds == [
        "message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
        "content_block_stop", "message_delta", "message_stop"]
    texts = [json.loads(line[6:])["delta"]["text"] for line in raw.text.splitlines()
             if line.startswith("data: ") and '"content_block_delta"' in line]
    short = client.messages.create(**{**body, "max_tokens": 3})
    assert "".join(texts) == short.content[0].text


def test_a_tool_round_trip(server) -> None:
    client, model = _client(server), _model(server)
    first = client.messages.create(model=model, max_tokens=60, messages=ASK, tools=[WEATHER_TOOL],
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    # no tool_choice: auto, with the generic format of the default model's template
    answer = client.messages.create(model=model, max_tokens=40, messages=history, tools=[WEATHER_TOOL],
                                    extra_body=GREEDY)
    assert answer.stop_reason == "end_turn" and [b.type for b in answer.content] == ["text"]
    assert "21" in answer.content[0].text


def test_a_streamed_tool_use_streams_its_input(server) -> None:
    client, model = _client(server), _model(server)
    with client.messages.stream(model=model, max_tokens=60, messages=ASK, tools=[WEATHER_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        pieces = [e.delta.partial_json for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    [use] = final.content
    assert final.stop_reason == "tool_use" and use.name == "get_weather"
    assert json.loads("".join(pieces)) == use.input == {"city": "Paris"}


def test_stop_sequences(server) -> None:
    client, model = _client(server), _model(server)
    free = client.messages.create(model=model, max_tokens=12, messages=ASK, extra_body=GREEDY)
    word = free.content[0].text.split()[2]
    reply = client.messages.create(model=model, max_tokens=12, messages=ASK, stop_sequences=[word],
                                   extra_body=GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == word
    assert reply.content[0].text == free.content[0].text[:free.content[0].text.index(word)]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [], "max_tokens": 5}, "messages"),
    ({"messages": ASK}, "max_tokens"),
    ({"messages": ASK, "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
    ({"messages": ASK, "max_tokens": 5, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 5},
     "messages[0].content[0].type"),
    ({"messages": ASK, "max_tokens": 5000}, "max_tokens"),
    ({"messages": ASK, "max_tokens": 5, "tools": [{**WEATHER_TOOL, "input_schema": {"type": "objekt"}}]},
     "tools[0].input_schema"),
])
def test_bad_requests_are_a_400_naming_the_field(server, body, param) -> None:
    prompt_tokens = server.metric("pagellm:prompt_tokens_total")
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": server.api_key}, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert server.metric("pagellm:prompt_tokens_total") == prompt_tokens
    assert server.metric("pagellm:kv_cache_usage_perc") == 0.0


def test_the_key_may_come_as_x_api_key(server) -> None:
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=_model(server), max_tokens=2, messages=ASK)
