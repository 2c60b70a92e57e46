"""`tool_choice` "auto" (given, or implied by `tools`) on a server started with no tool
flags (issue #34): the call format comes from the chat template, and for a template
without one (the default model's) the generic prompt with the reply held to "text, or
calls that fit the tools' schemas". Driven by real clients: the `openai` SDK, LangChain's
`bind_tools` and the OpenAI Agents SDK's chat-completions model."""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # before agents is imported

import httpx
import openai
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts

from pagellm.entrypoints.openai.tool_parsers.generic_prompt import generic_tool_reply_grammar
from pagellm.entrypoints.openai.tool_parsers.tool_format import template_tool_parser
from tests.entrypoints.openai.conftest import ServerProcess

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
            "required": ["city"],
        },
    },
}
NOW_TOOL = {"type": "function", "function": {"name": "now", "description": "The time."}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_RESULT = "Sunny, 21 C"
LT_TOKEN = "44"
"""The default model's token id of "<": a logit bias on it makes the model open a reply
with `<`, which the "text or tool calls" grammar only lets go on as a `<tool_call>`."""

# -- which format a template teaches -----------------------------------------------------

QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}"
    "{{- t | tojson }}{%- endfor %}{{- '</tools>\\nFor each function call, return a json object "
    "within <tool_call></tool_call> XML tags' }}{%- endif %}"
    "{%- for m in messages %}{{- m['content'] }}{%- endfor %}"
)
LLAMA31_LIKE = (
    "{%- if tools is not none %}{{- 'Given the following functions, please respond with a JSON for "
    "a function call with its proper arguments that best answers the given prompt.' }}"
    "{%- for t in tools %}{{- t | tojson }}{%- endfor %}{%- endif %}"
    "{%- for m in messages %}{%- if m.tool_calls %}{{- '<|python_tag|>' }}{%- endif %}"
    "{{- m['content'] }}{%- endfor %}"
)
LLAMA4_PYTHONIC_LIKE = (
    "{%- if tools %}{{- 'If you decide to invoke any of the function(s), you MUST put it in the "
    "format of [func_name1(params_name1=params_value1, params_name2=params_value2...)]' }}"
    "{%- endif %}{%- for m in messages %}{{- m['content'] }}{%- endfor %}"
)
MISTRAL_LIKE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS]{%- endif %}{{ m['content'] }}"
    "{%- endfor %}"
)
UNKNOWN_FORMAT = (
    "{%- if tools %}<functions>{{ tools | tojson }}</functions>{%- endif %}"
    "{%- for m in messages %}{{ m['content'] }}{%- endfor %}"
)
NO_TOOLS = "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{%- endfor %}"


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (QWEN_LIKE, "hermes"),
        (LLAMA31_LIKE, "llama3_json"),
        (LLAMA4_PYTHONIC_LIKE, "pythonic"),
        (MISTRAL_LIKE, "mistral"),
        (UNKNOWN_FORMAT, None),  # tools rendered, no format read here: the generic prompt
        (NO_TOOLS, None),
        ("{{ '<tool_call>' }}{%- for m in messages %}{{ m['content'] }}{%- endfor %}", None),
    ],
    ids=["hermes", "llama3_json", "pythonic", "mistral", "unknown", "no-tools", "marker-without-tools"],
)
def test_the_template_names_the_tool_call_parser(template, parser) -> None:
    assert template_tool_parser(template) == parser


# -- the "text or tool calls" grammar -----------------------------------------------------


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize(
    ("reply", "accepted"),
    [
        ("The weather is fine.", True),
        ("", True),
        ("  Some text, then <tool_call> is only text", True),
        (_call("get_weather", {"city": "Paris"}), True),
        ("\n" + _call("now", {}) + "\n" + _call("get_weather", {"city": "London"}) + "\n", True),
        (_call("now", {}) + "\n\n", False),  # the calls end the reply
        (_call("get_weather", {"city": "Rome"}), False),  # not in the enum
        (_call("get_weather", {}), False),  # city is required
        (_call("send_mail", {}), False),  # no such tool
        ('<tool_call>{"name": "now"}</tool_call>', False),  # arguments are required
        ("<b>bold</b>", False),  # a reply that opens with "<" is a call
        (_call("now", {}) + " and then text", False),
    ],
)
def test_generic_reply_grammar_is_text_or_calls_that_fit(reply, accepted) -> None:
    grammar = xgr.Grammar.from_ebnf(generic_tool_reply_grammar([WEATHER_TOOL, NOW_TOOL]))
    assert grammar_accepts(grammar, reply) is accepted


def test_generic_reply_grammar_without_parallel_calls_takes_one() -> None:
    grammar = xgr.Grammar.from_ebnf(generic_tool_reply_grammar([WEATHER_TOOL, NOW_TOOL], False))
    assert grammar_accepts(grammar, _call("now", {}))
    assert not grammar_accepts(grammar, _call("now", {}) + "\n" + _call("now", {}))


def test_generic_reply_grammar_keeps_literals_named_root() -> None:
    # a tool named "root" must not be renamed with the JSON grammar's root rule
    tool = {"type": "function", "function": {"name": "root"}}
    grammar = xgr.Grammar.from_ebnf(generic_tool_reply_grammar([tool]))
    assert grammar_accepts(grammar, _call("root", {}))


# -- a server started with no tool flags ---------------------------------------------------


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0, timeout=120)


def _model(srv: ServerProcess) -> str:
    return _client(srv).models.list().data[0].id


@pytest.mark.parametrize("tool_choice", [None, "auto"], ids=["implied", "given"])
def test_auto_without_flags_answers_in_text(server, tool_choice) -> None:
    client = _client(server)
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    body = dict(model=_model(server), messages=ASK_WEATHER, tools=[WEATHER_TOOL], temperature=0,
                max_tokens=40, **extra)
    client.chat.completions.create(**{**body, "max_tokens": 1})  # both runs below hit the cache
    choice = client.chat.completions.create(**body).choices[0]
    # The 135M model answers this question itself; the grammar lets text through.
    assert choice.message.tool_calls == [] and choice.finish_reason == "stop"
    assert choice.message.content and not choice.message.content.startswith("<")
    streamed = list(client.chat.completions.create(**body, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"


def test_auto_without_flags_answers_from_a_tool_result(server) -> None:
    history = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": WEATHER_RESULT},
    ]
    choice = _client(server).chat.completions.create(
        model=_model(server), messages=history, tools=[WEATHER_TOOL], temperature=0, max_tokens=40,
    ).choices[0]
    assert choice.message.tool_calls == [] and choice.finish_reason == "stop"
    assert "21" in choice.message.content and "sunny" in choice.message.content.lower()


def test_auto_without_flags_holds_a_call_to_the_schemas(server) -> None:
    """A reply pushed to open with "<" can only go on as a call that fits a tool: the name
    is one of the tools', the arguments fit its schema; parsed, streamed and not."""
    client = _client(server)
    body = dict(model=_model(server), messages=ASK_WEATHER, tools=[WEATHER_TOOL, NOW_TOOL],
                parallel_tool_calls=False, temperature=0, max_tokens=60,
                logit_bias={LT_TOKEN: 100})
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "now")
    args = json.loads(call.function.arguments)
    assert args in ({"city": "Paris"}, {"city": "London"}) if call.function.name == "get_weather" else args == {}
    chunks = list(client.chat.completions.create(**body, stream=True))
    frags = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert frags[0].function.name == call.function.name
    assert "".join(f.function.arguments or "" for f in frags) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_request_constraint_wins_over_the_generic_grammar(server) -> None:
    choice = _client(server).chat.completions.create(
        model=_model(server), messages=ASK_WEATHER, tools=[WEATHER_TOOL], temperature=0,
        max_tokens=10, extra_body={"structured_outputs": {"choice": ["<sunny>"]}},
    ).choices[0]
    assert choice.message.content == "<sunny>" and choice.message.tool_calls == []


def test_bad_tools_under_auto_are_a_400(server) -> None:
    prompt_tokens = server.metric("pagellm:prompt_tokens_total")
    bad = {"type": "function", "function": {"name": "x", "parameters": {"type": "object",
                                                                         "properties": 3}}}
    r = httpx.post(server.url + "/v1/chat/completions",
                   headers={"Authorization": f"Bearer {server.api_key}"},
                   json={"messages": ASK_WEATHER, "tools": [bad], "max_tokens": 5}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools[0].function.parameters"
    assert server.metric("pagellm:prompt_tokens_total") == prompt_tokens  # nothing ran


# -- LangChain -------------------------------------------------------------------------------


def _langchain(srv: ServerProcess, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, model=_model(srv),
                      temperature=0, max_retries=0, timeout=120, **kwargs)


def test_langchain_bind_tools_without_tool_choice_reads_a_call(server) -> None:
    llm = _langchain(server, max_tokens=60, logit_bias={int(LT_TOKEN): 100})
    message = llm.bind_tools([WEATHER_TOOL], parallel_tool_calls=False).invoke(
        "What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"] in ({"city": "Paris"}, {"city": "London"})
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_tool_loop_without_tool_choice_answers_from_the_result(server) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    llm = _langchain(server, max_tokens=40).bind_tools([WEATHER_TOOL])
    first = llm.invoke("What is the weather in Paris?")
    assert first.tool_calls == [] and first.content  # the model answered itself
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}
    answer = llm.invoke([HumanMessage("What is the weather in Paris?"),
                         AIMessage("", tool_calls=[call]),
                         ToolMessage(WEATHER_RESULT, tool_call_id="call_1")])
    assert answer.tool_calls == [] and "21" in answer.content


# -- the OpenAI Agents SDK, chat-completions model -----------------------------------------------


def test_agents_sdk_chat_completions_agent_runs_a_tool(server) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return WEATHER_RESULT

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
    agent = Agent(
        name="weather",
        model=OpenAIChatCompletionsModel(model=_model(server), openai_client=client),
        tools=[get_weather],
        # the first turn must call; the SDK then resets tool_choice to auto
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls == ["Paris"]
    assert "21" in result.final_output
    tool_items = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert [i.output for i in tool_items] == [WEATHER_RESULT]


# -- the generic format's history ------------------------------------------------------------

TOOL_HISTORY = [
    *ASK_WEATHER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": WEATHER_RESULT},
]


def test_a_conversation_ending_in_tool_results_continues_the_callers_turn() -> None:
    from pagellm.entrypoints.chat_utils import apply_chat_template
    from pagellm.model_executor.loader import default_model_path, load_tokenizer

    tok = load_tokenizer(default_model_path())  # the default model's template knows no tools
    text = apply_chat_template(tok, TOOL_HISTORY, tools=[WEATHER_TOOL])
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call>\n<tool_response>\nSunny, 21 C\n</tool_response>"
    )
    followed = apply_chat_template(tok, [*TOOL_HISTORY, {"role": "user", "content": "Thanks"}],
                                   tools=[WEATHER_TOOL])
    assert followed.endswith("</tool_response><|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
                             "<|im_start|>assistant\n")


# -- a template that teaches a format: its parser, no flags ---------------------------------------

MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("mistral") / "template.jinja"
    template.write_text(MISTRAL_LIKE + "{{ '[/INST]' }}")
    srv = ServerProcess("--chat-template", str(template), "--disable-ui")
    yield srv
    srv.stop()


def test_the_template_format_is_parsed_without_flags(mistral_server) -> None:
    client = _client(mistral_server)
    model = _model(mistral_server)
    # The small model does not write Mistral's syntax by itself: a regex makes it.
    regex = {"structured_outputs": {"regex": re.escape(MISTRAL_CALL)}}
    body = dict(model=model, messages=ASK_WEATHER, tools=[WEATHER_TOOL], temperature=0, max_tokens=40,
                extra_body=regex)
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    chunks = list(client.chat.completions.create(**body, stream=True))
    frags = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert frags[0].function.name == "get_weather"
    assert "".join(f.function.arguments or "" for f in frags) == call.function.arguments
    # the template rendered the tools itself (no generic prompt): the prompt the server ran
    from pagellm.entrypoints.chat_utils import apply_chat_template
    from pagellm.model_executor.loader import default_model_path, load_tokenizer

    tok = load_tokenizer(default_model_path())
    text = apply_chat_template(tok, ASK_WEATHER, MISTRAL_LIKE + "{{ '[/INST]' }}", tools=[WEATHER_TOOL])
    assert text.startswith("[AVAILABLE_TOOLS]") and "# Tools" not in text
    with_tools = client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                                max_tokens=1)
    assert with_tools.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_an_unknown_tool_call_parser_is_refused_before_loading() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pagellm", "serve", "--tool-call-parser", "granite",
                          "--enable-auto-tool-choice", "--port", "0"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    assert "hermes, llama3_json, mistral, pythonic" in out.stderr.strip().splitlines()[-1]


def test_agents_sdk_tool_round_trip_prefills_only_the_new_turn(server) -> None:
    """The turn after a tool call finds the whole first turn's prompt in the prefix cache
    (the generic format keeps the history's text as it was): it computes only what the
    call and its result added, give or take a block (16 tokens)."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool

    def cache() -> tuple[float, float]:
        return server.metric("pagellm:prefix_cache_queries_total"), server.metric("pagellm:prefix_cache_hits_total")

    marks = [cache()]

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        marks.append(cache())  # after the first turn, before the second
        return WEATHER_RESULT

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
    agent = Agent(name="weather", model=OpenAIChatCompletionsModel(model=_model(server), openai_client=client),
                  tools=[get_weather], instructions="You tell the weather.",
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
    result = Runner.run_sync(agent, "What is the weather like in London today?", max_turns=3)
    marks.append(cache())
    first, second = (r.usage.input_tokens for r in result.raw_responses)
    queries = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    computed = [q - (b[1] - a[1]) for q, a, b in zip(queries, marks, marks[1:])]
    assert queries == [first, second]  # nothing else ran meanwhile
    assert computed[0] == first  # a new conversation: all of it
    assert computed[1] <= second - first + 16
