"""OpenAI's Responses API on `pagellm serve` (issue #34), driven by the official `openai`
client and the OpenAI Agents SDK's default (Responses) model: text and tool calls, whole
and streamed with the Responses event types, `previous_response_id` through a bounded
store, `GET /v1/responses/{id}`, and OpenAI's error JSON for bad input."""

from __future__ import annotations

import asyncio
import json
import os

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # before agents is imported

import httpx
import jsonschema
import openai
import pytest

from pagellm.entrypoints.openai.responses_protocol import (
    ResponsesInputError,
    chat_tool_choice,
    chat_tools,
    input_messages,
    responses_param,
)
from pagellm.entrypoints.openai.serving_responses import ResponseStore, StoredResponse
from tests.entrypoints.openai.conftest import ServerProcess

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = "What is the weather in Paris?"
RESULT = "Sunny, 21 C"

# -- the request's parts as chat -----------------------------------------------------------


def test_input_items_become_chat_messages() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": RESULT},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "9:00"}]},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": RESULT},
        {"role": "tool", "tool_call_id": "c2", "content": "9:00"},
    ]
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(("items", "param"), [
    ([{"type": "web_search_call", "id": "ws_1"}], "input[0].type"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
    ([{"type": "function_call", "call_id": "c1", "name": "f"}], "input[0].arguments"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
])
def test_bad_input_items_name_the_field(items, param) -> None:
    with pytest.raises(ResponsesInputError) as info:
        input_messages(items)
    assert info.value.param == param


def test_tools_and_tool_choice_in_the_chat_shape() -> None:
    assert chat_tools([WEATHER_TOOL]) == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER_TOOL["description"],
        "parameters": WEATHER_TOOL["parameters"]}}]
    with pytest.raises(ResponsesInputError, match=r"tools\[1\]\.type"):
        chat_tools([WEATHER_TOOL, {"type": "web_search"}])
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    assert responses_param("tools[0].function.parameters") == "tools[0].parameters"
    assert responses_param("messages") == "input" and responses_param("response_format") == "text.format"


def test_store_evicts_the_oldest() -> None:
    store = ResponseStore(max_entries=2)
    for i in range(3):
        store.put(f"resp_{i}", StoredResponse({"id": f"resp_{i}"}, []))
    assert len(store) == 2 and store.get("resp_0") is None
    assert store.get("resp_1").response == {"id": "resp_1"} and store.get("resp_2") is not None
    store.put("resp_1", StoredResponse({"id": "resp_1"}, []))  # stored again: now the newest
    store.put("resp_3", StoredResponse({"id": "resp_3"}, []))
    assert store.get("resp_2") is None and store.get("resp_1") is not None
    nothing = ResponseStore(max_entries=0)
    nothing.put("resp_x", StoredResponse({}, []))
    assert len(nothing) == 0


# -- on a server ---------------------------------------------------------------------------------


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0, timeout=120)


def _model(srv: ServerProcess) -> str:
    return _client(srv).models.list().data[0].id


def test_text_response_equals_the_chat_reply_streamed_and_not(server) -> None:
    client, model = _client(server), _model(server)
    body = dict(model=model, input=ASK, max_output_tokens=12, temperature=0)
    client.responses.create(**{**body, "max_output_tokens": 1})  # every run below hits the cache
    r = client.responses.create(**body)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": ASK}],
                                          max_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, 12, chat.usage.prompt_tokens + 12)

    events = list(client.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == r.output_text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.usage.output_tokens == 12


def test_a_tool_round_trip_through_previous_response_id(server) -> None:
    client, model = _client(server), _model(server)
    first = client.responses.create(model=model, input=ASK, tools=[WEATHER_TOOL], tool_choice="required",
                                    max_output_tokens=60, temperature=0)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()

    follow = dict(model=model, previous_response_id=first.id, tools=[WEATHER_TOOL], max_output_tokens=40,
                  temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": RESULT}])
    second = client.responses.create(**follow)
    assert second.status == "completed" and second.previous_response_id == first.id
    assert [o.type for o in second.output] == ["message"] and "21" in second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn came along

    streamed = list(client.responses.create(**follow, stream=True))
    assert streamed[-1].type == "response.completed"
    assert streamed[-1].response.output_text == second.output_text


def test_a_streamed_tool_call_streams_its_arguments(server) -> None:
    client, model = _client(server), _model(server)
    events = list(client.responses.create(model=model, input=ASK, tools=[WEATHER_TOOL],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, temperature=0, stream=True))
    kinds = [e.type for e in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(pieces),
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    [call] = events[-1].response.output
    assert call.name == "get_weather" and "".join(pieces) == call.arguments == events[-3].arguments
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_text_format_json_schema_and_instructions(server) -> None:
    client, model = _client(server), _model(server)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(model=model, input="Name a city.", instructions="Answer in JSON.",
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
                                max_output_tokens=30, temperature=0)
    assert r.status == "completed" and r.instructions == "Answer in JSON."
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_unstored_and_unknown_responses_are_404(server) -> None:
    client, model = _client(server), _model(server)
    r = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    prompt_tokens = server.metric("pagellm:prompt_tokens_total")
    for response_id in (r.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(response_id)
        assert info.value.body["param"] is None and response_id in info.value.body["message"]
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(model=model, input="Hi", previous_response_id=response_id)
        assert info.value.body == {"message": info.value.body["message"], "type": "NotFoundError",
                                   "param": "previous_response_id", "code": 404}
    assert server.metric("pagellm:prompt_tokens_total") == prompt_tokens  # nothing reached the engine


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": "Hi", "tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [{**WEATHER_TOOL, "parameters": {"type": "object", "properties": 3}}]},
     "tools[0].parameters"),
    ({"input": "Hi", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "Hi " * 1200}, "input"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}},
     "text.format"),
    ({"input": "Hi", "model": "gpt-5"}, "model"),
], ids=["empty-list", "empty-string", "item-type", "tool-type", "tool-schema", "tool-choice",
        "zero-tokens", "too-many-tokens", "too-long", "bad-schema", "unknown-model"])
@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
def test_bad_requests_get_openai_errors(server, body, param, stream) -> None:
    prompt_tokens = server.metric("pagellm:prompt_tokens_total")
    r = httpx.post(server.url + "/v1/responses", json={**body, "stream": stream}, timeout=60,
                   headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert server.metric("pagellm:prompt_tokens_total") == prompt_tokens
    assert server.metric("pagellm:kv_cache_usage_perc") == 0.0


def test_store_is_bounded_on_the_server() -> None:
    srv = ServerProcess("--max-stored-responses", "2", "--disable-ui")
    try:
        client, model = _client(srv), _model(srv)
        ids = [client.responses.create(model=model, input=f"Count to {i}.", max_output_tokens=1).id
               for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    finally:
        srv.stop()


# -- the OpenAI Agents SDK's default model ---------------------------------------------------------


def _weather_agent(srv: ServerProcess, calls: list[str]):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return RESULT

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0)
    return Agent(
        name="weather",
        model=OpenAIResponsesModel(model=_model(srv), openai_client=client),
        tools=[get_weather],
        # the first turn must call; the SDK then resets tool_choice to auto
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )


def test_agents_sdk_responses_agent_runs_a_tool(server) -> None:
    from agents import Runner

    calls: list[str] = []
    result = Runner.run_sync(_weather_agent(server, calls), ASK, max_turns=3)
    assert calls == ["Paris"] and "21" in result.final_output
    assert [i.output for i in result.new_items if i.type == "tool_call_output_item"] == [RESULT]


def test_agents_sdk_responses_agent_streamed(server) -> None:
    from agents import Runner

    calls: list[str] = []

    async def run() -> tuple[str, list[str]]:
        result = Runner.run_streamed(_weather_agent(server, calls), ASK, max_turns=3)
        kinds = [event.type async for event in result.stream_events()]
        return result.final_output, kinds

    final, kinds = asyncio.run(run())
    assert calls == ["Paris"] and "21" in final
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
