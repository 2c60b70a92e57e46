"""Tools for chat templates that know nothing of tools (like llama.cpp server's generic
format): a system-prompt text describing the tools, a rewrite of the history's assistant
`tool_calls` and `role: "tool"` turns into plain user/assistant text, and the grammar
that holds a reply with `tool_choice` "auto" to "text, or tool calls that fit the tools".

The prompt asks for hermes syntax (`<tool_call>{...}</tool_call>`), so the `hermes` parser
reads the replies. Messages come in as OpenAI dicts and go out as OpenAI dicts.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagellm.entrypoints.openai.tool_parsers.hermes_tool_parser import (
    TOOL_CALL_END,
    TOOL_CALL_START,
)
from pagellm.entrypoints.openai.tool_parsers.tool_choice import (
    InvalidToolRequest,
    call_object_schemas,
    validate_tools,
)

TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

_PROMPT = """\
# Tools

You can call these functions (JSON: name, description, parameters schema):

{tools}

To call a function, reply with only:
{start}{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}{end}
The result comes back inside {response_start}...{response_end}; then answer the user with it \
in plain text. If no function is needed, answer directly.
Example: {start}{{"name": "{first}", "arguments": {{...}}}}{end}"""
"""Kept short and ending on an example with a real tool's name: the default 135M model
then answers from a result in plain text instead of repeating the call."""


def template_supports_tools(template_source: str) -> bool:
    """Whether a Jinja chat template reads a `tools` variable (so it renders tools itself)."""
    try:
        import jinja2
        import jinja2.meta

        ast = jinja2.Environment().parse(template_source)
        return "tools" in jinja2.meta.find_undeclared_variables(ast)
    except Exception:  # a template jinja2 cannot parse: fall back to the word
        return re.search(r"\btools\b", template_source) is not None


def render_generic_tool_prompt(tools: list[Any]) -> str:
    """The system-prompt text describing `tools` and the `<tool_call>` reply format."""
    specs = validate_tools(tools)
    listing = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in specs)
    return _PROMPT.format(
        tools=listing,
        start=TOOL_CALL_START,
        end=TOOL_CALL_END,
        response_start=TOOL_RESPONSE_START,
        response_end=TOOL_RESPONSE_END,
        first=specs[0]["name"] if specs else "",
    )


def _text(content: Any) -> str:
    """Message content as text: a string, None, or OpenAI content parts (text parts kept)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        part.get("text", "")
        for part in content
        if isinstance(part, dict) and part.get("type") == "text"
    )


def _tool_call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    arguments: Any = fn.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: shown to the model as the string it was
    body = json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}{body}{TOOL_CALL_END}"


def flatten_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history with tool turns as plain text a tool-less template can render.

    An assistant turn with `tool_calls` becomes its text, one `<tool_call>` line per call,
    then one `<tool_response>` block holding each `tool` message's content that follows it,
    in order (Hermes' and Qwen's own layout). Call ids are left out: they are random, and
    the prompt (hence a greedy reply) should not depend on them. Results in the caller's turn keep the roles alternating, and when
    they end the conversation the reply continues that turn (`ends_in_tool_results`): a
    small model then answers from them rather than repeating its call. A `tool` message
    with no call before it becomes a user turn of `<tool_response>` blocks. Other
    messages pass through unchanged.
    """
    out: list[dict[str, Any]] = []
    takes_results: int | None = None  # the index in `out` of the turn the next results join
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"{TOOL_RESPONSE_START}\n{_text(message.get('content'))}\n{TOOL_RESPONSE_END}"
            if takes_results is None:  # no call before it
                out.append({"role": "user", "content": block})
                takes_results = len(out) - 1
            else:
                turn = out[takes_results]
                out[takes_results] = {**turn, "content": f"{turn['content']}\n{block}"}
            continue
        calls = message.get("tool_calls") or []
        if role != "assistant" or not calls:
            out.append(message)
            takes_results = None
            continue
        lines = [_text(message.get("content")).strip()] + [_tool_call_text(c) for c in calls]
        plain = {k: v for k, v in message.items() if k != "tool_calls"}
        plain["content"] = "\n".join(line for line in lines if line)
        out.append(plain)
        takes_results = len(out) - 1
    return out


def ends_in_tool_results(messages: list[dict[str, Any]]) -> bool:
    """Whether the (unflattened) conversation ends with tool results that follow the
    assistant's calls: flattened, its last turn is that assistant's, to be continued."""
    if not messages or messages[-1].get("role") != "tool":
        return False
    last_other = next((m for m in reversed(messages) if m.get("role") != "tool"), {})
    return last_other.get("role") == "assistant" and bool(last_other.get("tool_calls"))


def add_generic_tool_prompt(
    messages: list[dict[str, Any]], tools: list[Any]
) -> list[dict[str, Any]]:
    """`flatten_tool_messages(messages)` with the tool prompt appended to the first system
    message's text, or in a new leading system message when there is none."""
    prompt = render_generic_tool_prompt(tools)
    out = flatten_tool_messages(messages)
    if out and out[0].get("role") == "system":
        system_text = _text(out[0].get("content")).rstrip()
        joined = f"{system_text}\n\n{prompt}" if system_text else prompt
        return [{**out[0], "content": joined}, *out[1:]]
    return [{"role": "system", "content": prompt}, *out]


# A reply under the generic prompt with tool_choice "auto" (xgrammar's EBNF). `tool_reply_
# call_object` is the JSON grammar of `{"name": ..., "arguments": {...}}` for one of the
# tools, its own `root` renamed; its other rules are named basic_*, root_* and defs_*.
_REPLY_GRAMMAR = r"""root ::= tool_reply_text | tool_reply_calls
tool_reply_text ::= tool_reply_ws | (tool_reply_ws [^< \t\r\n] [\0-\U0010ffff]*)
tool_reply_ws ::= [ \t\r\n]*
tool_reply_calls ::= tool_reply_ws tool_reply_call {more} "\n"?
tool_reply_call ::= "<tool_call>" tool_reply_call_object "</tool_call>"
"""
_EBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\b[A-Za-z_][A-Za-z0-9_]*\b')
"""A string literal, a character class or a name, in xgrammar's printed EBNF."""


def _renamed(ebnf: str, old: str, new: str) -> str:
    """`ebnf` with the rule `old` renamed (definition and references; literals untouched)."""
    return _EBNF_TOKEN.sub(lambda m: new if m.group(0) == old else m.group(0), ebnf)


def generic_tool_reply_grammar(tools: list[Any], parallel_tool_calls: bool | None = True) -> str:
    """The grammar (xgrammar EBNF, as `structured_outputs.grammar` takes it) of a reply to
    the generic tool prompt: text that does not open with `<`, or one or more (one without
    parallel tool calls) lines `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
    whose name is one of the tools' and whose arguments fit that tool's parameters schema
    (compact JSON, as the prompt shows it). The role llama.cpp's generic handler gives its
    grammar. Raises InvalidToolRequest for bad tools."""
    from pagellm.structured_output.backend_xgrammar import json_schema_ebnf

    items, defs = call_object_schemas(validate_tools(tools), "arguments")
    call_schema = json.dumps({"anyOf": items, **defs})
    try:
        call_object = json_schema_ebnf(call_schema, any_whitespace=False)
    except RuntimeError as e:  # a schema xgrammar cannot take
        raise InvalidToolRequest("tools", f"cannot constrain tool calls to these tools: {e}") from None
    # One newline between calls and at most one after them: the end of the calls is the
    # end of the reply (a model that went on with blank lines would run to max_tokens).
    more = '("\\n" tool_reply_call)*' if parallel_tool_calls is not False else ""
    return _REPLY_GRAMMAR.replace("{more}", more) + _renamed(call_object, "root", "tool_reply_call_object")
