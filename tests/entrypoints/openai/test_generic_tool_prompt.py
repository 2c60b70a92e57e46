"""The generic tool prompt for chat templates without tools support, and the history
rewrite that lets such a template render tool calls and results."""

from __future__ import annotations

import json

import jinja2
import pytest

from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.generic_prompt import (
    add_generic_tool_prompt,
    ends_in_tool_results,
    flatten_tool_messages,
    render_generic_tool_prompt,
    template_supports_tools,
)
from pagellm.entrypoints.openai.tool_parsers.tool_choice import InvalidToolRequest

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
NOARGS_TOOL = {"type": "function", "function": {"name": "now"}}

NO_TOOLS_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n"
    "{% endfor %}<|assistant|>"
)
TOOLS_TEMPLATE = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"


def test_template_supports_tools():
    assert template_supports_tools(TOOLS_TEMPLATE)
    assert template_supports_tools("{%- set ns = namespace(t=tools) -%}")
    assert not template_supports_tools(NO_TOOLS_TEMPLATE)
    # `tools` only as a literal or a set variable is not tools support
    assert not template_supports_tools("{% set tools = [] %}{{ tools }} {{ 'tools' }}")
    assert template_supports_tools("{% if tools %")  # unparsable: falls back to the word


def test_generic_prompt_lists_tools_and_the_hermes_format():
    prompt = render_generic_tool_prompt([WEATHER_TOOL, NOARGS_TOOL])
    assert json.dumps(
        {"name": "get_weather", "description": "Weather for a city",
         "parameters": WEATHER_TOOL["function"]["parameters"]}
    ) in prompt  # fmt: skip
    assert '{"name": "now"}' in prompt
    assert '<tool_call>{"name": "<function name>", "arguments":' in prompt
    with pytest.raises(InvalidToolRequest, match=r"tools\[0\]\.function\.parameters"):
        render_generic_tool_prompt(
            [{"type": "function", "function": {"name": "x", "parameters": 1}}]
        )


HISTORY = [
    {"role": "user", "content": "Weather in SF and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "SF"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, fog"},
    {"role": "tool", "tool_call_id": "call_2", "name": "now",
     "content": [{"type": "text", "text": "09:30"}]},
]  # fmt: skip


def test_flatten_tool_messages_exact():
    # the results join the turn with the calls, without the (random) call ids or names
    assert flatten_tool_messages(HISTORY) == [
        {"role": "user", "content": "Weather in SF and the time?"},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "SF"}}</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
            "<tool_response>\n18 C, fog\n</tool_response>\n<tool_response>\n09:30\n</tool_response>",
        },
    ]
    assert ends_in_tool_results(HISTORY)
    assert not ends_in_tool_results([*HISTORY, {"role": "user", "content": "Thanks"}])
    assert not ends_in_tool_results(HISTORY[:2])


def test_tool_results_without_a_call_are_a_user_turn():
    orphans = [HISTORY[0], HISTORY[2], HISTORY[3]]
    assert flatten_tool_messages(orphans) == [
        HISTORY[0],
        {
            "role": "user",
            "content": "<tool_response>\n18 C, fog\n</tool_response>\n<tool_response>\n09:30\n</tool_response>",
        },
    ]
    assert not ends_in_tool_results(orphans)


def test_flattened_history_renders_in_a_template_without_tools_and_parses_back():
    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env = jinja2.Environment()
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(NO_TOOLS_TEMPLATE)
    with pytest.raises(jinja2.TemplateError):
        template.render(messages=HISTORY)
    messages = add_generic_tool_prompt(
        [{"role": "system", "content": "Be brief."}, *HISTORY], [WEATHER_TOOL, NOARGS_TOOL]
    )
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools\n")
    text = template.render(messages=messages)
    assert "</tool_call>\n<tool_response>" in text and text.endswith("<|assistant|>")
    # the assistant turn, as rendered, is what the hermes parser reads back
    result = get_tool_parser("hermes")().extract_tool_calls(messages[2]["content"])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "SF"}),
        ("now", {}),
    ]
    assert result.content.startswith("<tool_response>")  # results are not calls
    without_system = add_generic_tool_prompt(HISTORY[:1], [NOARGS_TOOL])
    assert without_system[0]["role"] == "system" and without_system[1] == HISTORY[0]


def test_assistant_text_before_tool_calls_is_kept():
    msg = {
        "role": "assistant",
        "content": "Checking. ",
        "tool_calls": [HISTORY[1]["tool_calls"][1]],
    }
    assert flatten_tool_messages([msg]) == [
        {
            "role": "assistant",
            "content": 'Checking.\n<tool_call>{"name": "now", "arguments": {}}</tool_call>',
        }
    ]
