"""Structured outputs and tool calling through the OpenAI server (issue #17), driven by
the official `openai` client on a real `pagellm serve`: constrained replies parse and
validate, tool calls stream as OpenAI's fragments, bad constraints are a 400 naming the
field before anything reaches the engine, and `<think>` text becomes reasoning_content."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.entrypoints.openai.conftest import ServerProcess

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
TOOLS = [ADD_TOOL, WEATHER_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_SUM = [{"role": "user", "content": "What is 2 plus 3?"}]
HERMES_REGEX = r'<tool_call>\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>'


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=10**8)


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0, timeout=120)


def _headers(srv: ServerProcess) -> dict[str, str]:
    return {"Authorization": f"Bearer {srv.api_key}"}


def _assert_engine_empty(srv: ServerProcess) -> None:
    assert srv.metric("pagellm:num_requests_running") == 0.0
    assert srv.metric("pagellm:num_requests_waiting") == 0.0
    assert srv.metric("pagellm:kv_cache_usage_perc") == 0.0


def _streamed_calls(chunks: list) -> tuple[list[dict], list[str | None], str]:
    """Reassembles streamed `delta.tool_calls` per index: [{id, type, name, arguments}],
    the finish reasons seen and the streamed content. The first fragment of each call
    carries its id, type and name; later ones only arguments text."""
    calls: dict[int, dict] = {}
    finishes, content = [], ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
        for frag in choice.delta.tool_calls or []:
            if frag.index not in calls:
                assert frag.id and frag.type == "function" and frag.function.name, frag
                calls[frag.index] = {
                    "id": frag.id,
                    "type": frag.type,
                    "name": frag.function.name,
                    "arguments": "",
                }
            else:
                assert frag.id is None and (frag.function.name is None), frag
            calls[frag.index]["arguments"] += frag.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in range(len(calls))], finishes, content


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return _client(server)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


# -- response_format and structured_outputs ---------------------------------------------------


def test_parse_with_a_pydantic_model_and_json_object(client, model) -> None:
    completion = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=40,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed

    reply = client.chat.completions.create(
        model=model,
        # a small object: how long a free-form object runs is the model's choice (asked only
        # for "your name", it kept adding fields past 120 tokens on some numeric paths)
        messages=[{"role": "user", "content": 'Return a JSON object with one key, "name", and your name as its value.'}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    ).choices[0]
    assert reply.finish_reason == "stop"
    assert isinstance(json.loads(reply.message.content), dict)


def test_completions_regex_and_choice_full_match(client, model) -> None:
    regex = r"(19|20)[0-9]{2}"
    for prompt in ("The year Paris hosted the Olympics:", "The year I was born:"):
        c = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            extra_body={"structured_outputs": {"regex": regex}},
        ).choices[0]
        assert re.fullmatch(regex, c.text) and c.finish_reason == "stop", c
    choices = ["yes", "no", "maybe"]
    for prompt in ("Is the sky blue? Answer:", "Is ice hot? Answer:"):
        c = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            extra_body={"structured_outputs": {"choice": choices}},
        ).choices[0]
        assert c.text in choices and c.finish_reason == "stop", c


# -- tool_choice "required" and named ----------------------------------------------------------


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "add"}}],
    ids=["required", "named"],
)
def test_constrained_tool_calls_streamed_equal_unstreamed(client, model, tool_choice) -> None:
    body = dict(
        model=model,
        messages=ASK_SUM,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=60,
        temperature=0,
        parallel_tool_calls=False,
    )
    # Both compared runs find the prompt in the prefix cache: a first, uncached run may
    # differ in a near-tie (its last prompt token's logits come from the whole prefill).
    client.chat.completions.create(**{**body, "max_tokens": 1})
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1  # parallel_tool_calls=False: maxItems 1 under "required"
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    streamed, finishes, content = _streamed_calls(
        list(client.chat.completions.create(**body, stream=True))
    )
    assert finishes == ["tool_calls"] and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (call.function.name, call.function.arguments)
    ]


# -- "auto" with a tool-call parser ------------------------------------------------------------


@pytest.fixture(scope="module")
def hermes_server():
    srv = ServerProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


def test_auto_parses_hermes_calls_streamed_and_not(hermes_server) -> None:
    client = _client(hermes_server)
    # The small model does not write hermes syntax by itself: a regex makes it.
    body = dict(
        messages=ASK_SUM,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=40,
        temperature=0,
        model=client.models.list().data[0].id,
        extra_body={"structured_outputs": {"regex": HERMES_REGEX}},
    )
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"a", "b"}
    jsonschema.validate(args, SCHEMAS["add"])

    streamed, finishes, content = _streamed_calls(
        list(client.chat.completions.create(**body, stream=True))
    )
    assert finishes == ["tool_calls"] and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [("add", call.function.arguments)]

    # a reply without a call stays content
    plain = client.chat.completions.create(
        **{**body, "extra_body": {"structured_outputs": {"regex": "Five"}}}
    )
    assert plain.choices[0].message.content == "Five" and plain.choices[0].message.tool_calls == []
    assert plain.choices[0].finish_reason == "stop"


# -- tool calls and results in the history -----------------------------------------------------

HISTORY = [
    *ASK_SUM,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "RESULT-XJ7"},
]


def test_history_with_tool_calls_and_results_renders(server, client, model) -> None:
    reply = client.chat.completions.create(
        model=model, messages=HISTORY, max_tokens=3, temperature=0
    )
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.tool_calls == []
    with httpx.Client(base_url=server.url, headers=_headers(server), timeout=60) as http:
        tok = http.post("/tokenize", json={"messages": HISTORY}).json()
        text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    # the default template knows no tools: the call and its result are rendered as text
    assert reply.usage.prompt_tokens == tok["count"]
    assert "RESULT-XJ7" in text and '{"name": "add", "arguments": {"a": 2, "b": 3}}' in text
    with_tools = client.chat.completions.create(
        model=model,
        messages=HISTORY,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=30,
        temperature=0,
    )
    assert with_tools.usage.prompt_tokens > tok["count"]  # plus the generic tool prompt
    jsonschema.validate(
        json.loads(with_tools.choices[0].message.tool_calls[0].function.arguments), SCHEMAS["add"]
    )


# -- bad input ---------------------------------------------------------------------------------

_HI = [{"role": "user", "content": "hi"}]
_BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
BAD_STRUCTURED = [
    # (path, body, param)
    ("/v1/chat/completions", {"messages": _HI, "response_format": _BAD_SCHEMA}, "response_format"),
    (
        "/v1/chat/completions",
        {
            "messages": _HI,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"minimum": "zero"}}},
                },
            },
        },
        "response_format",
    ),
    ("/v1/completions", {"prompt": "x", "response_format": _BAD_SCHEMA}, "response_format"),
    (
        "/v1/chat/completions",
        {"messages": _HI, "structured_outputs": {"regex": "(ab"}},
        "structured_outputs",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"regex": "[a-"}},
        "structured_outputs",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"json": {"type": "objekt"}}},
        "structured_outputs",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": _HI,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "mul"}},
        },
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": _HI,
            "tool_choice": "required",
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": 12}}},
                    },
                }
            ],
        },
        "tools[0].function.parameters",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": _HI,
            "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}],
        },
        "tools[0].function.parameters",
    ),
    (
        "/v1/chat/completions",
        {"messages": _HI, "response_format": {"type": "xml"}},
        "response_format.type",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "response_format": {"type": "xml"}},
        "response_format.type",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": _HI,
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        },
        "tool_choice",
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
def test_bad_constraints_are_a_400_naming_the_field(server, stream) -> None:
    prompt_tokens = server.metric("pagellm:prompt_tokens_total")
    with httpx.Client(base_url=server.url, headers=_headers(server), timeout=60) as http:
        for path, body, param in BAD_STRUCTURED:
            r = http.post(path, json={**body, "max_tokens": 5, "stream": stream})
            # a stream is refused before it starts: a 400 with JSON, not a 200 and an error event
            assert r.status_code == 400, (body, r.text)
            assert r.headers["content-type"] == "application/json"
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
            assert err["type"] == "BadRequestError" and err["param"] == param, (body, err)
    assert server.metric("pagellm:prompt_tokens_total") == prompt_tokens  # none reached the engine
    _assert_engine_empty(server)


# -- reasoning ---------------------------------------------------------------------------------

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def reasoning_server(tiny_model, tmp_path_factory):
    """A tiny random Qwen3 whose tokenizer has `<think>` and `</think>` as single tokens
    (two ids past the default vocabulary) and whose template opens `<think>`, served
    with the deepseek_r1 reasoning parser."""
    from transformers import AutoTokenizer

    from pagellm.model_executor.loader import default_model_path, load_tokenizer

    base = len(load_tokenizer(default_model_path()))
    path = tmp_path_factory.mktemp("think") / "model"
    shutil.copytree(tiny_model("qwen3", vocab_size=base + 2), path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(path)
    assert [tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")] == [base, base + 1]
    template = path / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    srv = ServerProcess(
        "--model",
        str(path),
        "--max-model-len",
        "512",
        "--chat-template",
        str(template),
        "--reasoning-parser",
        "deepseek_r1",
    )
    yield srv
    srv.stop()


def test_reasoning_content_and_grammar_after_think(reasoning_server) -> None:
    srv = reasoning_server
    client = _client(srv)
    model = client.models.list().data[0].id
    with httpx.Client(base_url=srv.url, headers=_headers(srv), timeout=60) as http:
        ids = http.post("/tokenize", json={"messages": ASK_SUM}).json()["tokens"]
        think, end = http.post(
            "/tokenize", json={"prompt": "<think></think>", "add_special_tokens": False}
        ).json()["tokens"]
    assert ids[-2] == think  # the template opened reasoning (then a newline)

    # Inside reasoning the grammar does not apply yet: a one-digit regex does not stop the
    # output, which the raw completions endpoint returns as it is.
    digit = {"structured_outputs": {"regex": "[0-9]"}}
    raw = client.completions.create(
        model=model, prompt=ids, max_tokens=8, temperature=0, extra_body=digit
    ).choices[0]
    assert (
        raw.finish_reason == "length"
        and "</think>" not in raw.text
        and not re.fullmatch("[0-9]", raw.text)
    )

    body = dict(model=model, messages=ASK_SUM, max_tokens=8, temperature=0, extra_body=digit)
    reply = client.chat.completions.create(**body)
    message = reply.choices[0].message
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 8
    assert message.reasoning_content == raw.text.strip() and message.content is None

    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert streamed == message.reasoning_content
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # the role chunk has ""

    hidden = client.chat.completions.create(
        **{**body, "extra_body": {**digit, "include_reasoning": False}}
    )
    assert (
        hidden.choices[0].message.reasoning_content is None
        and hidden.choices[0].message.content is None
    )

    # Once `</think>` is in the prompt the grammar applies from the first token.
    after = client.completions.create(
        model=model,
        prompt=[*ids, end],
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    ).choices[0]
    assert re.fullmatch("[0-9]{3}", after.text) and after.finish_reason == "stop"


def test_responses_api_returns_reasoning_items(reasoning_server) -> None:
    """/v1/responses (issue #34): the reasoning parser's text is a `reasoning` output
    item, whole and streamed as response.reasoning_text.delta events."""
    client = _client(reasoning_server)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=ASK_SUM, max_tokens=8, temperature=0)
    body = dict(model=model, input=ASK_SUM[0]["content"], max_output_tokens=8, temperature=0)
    r = client.responses.create(**body)
    [item] = r.output
    assert item.type == "reasoning" and [c.text for c in item.content] == [chat.choices[0].message.reasoning_content]
    assert r.status == "incomplete" and r.output_text == ""
    events = list(client.responses.create(**body, stream=True))
    pieces = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        *["response.reasoning_text.delta"] * len(pieces),
                                        "response.reasoning_text.done", "response.output_item.done",
                                        "response.incomplete"]
    assert "".join(pieces) == item.content[0].text == events[-1].response.output[0].content[0].text
