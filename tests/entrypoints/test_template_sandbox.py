"""A chat template sent in a request renders in the bounded sandbox: reaching for Python's
internals is refused (not rendered as an empty value), and a template that would write,
build or loop without end is stopped by the size or time bound quickly, before memory
runs out. Ordinary templates render exactly as transformers renders them."""

from __future__ import annotations

import time

import pytest
from transformers import PreTrainedTokenizerFast

from pagellm.entrypoints import template_sandbox
from pagellm.entrypoints.chat_utils import ChatTemplateError, apply_chat_template
from pagellm.entrypoints.template_sandbox import TemplateBoundError, render_request_template

MESSAGES = [{"role": "user", "content": "Hi"}]


class _Tok:
    special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>"}


def _render(source: str) -> str:
    return render_request_template(source, _Tok(), MESSAGES, None, True, False, {})


INTERNALS = [
    "{{ ''.__class__.__mro__ }}",
    "{% if ''.__class__ %}rendered as empty in plain Jinja{% endif %}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ namespace.__init__ }}",
    "{{ messages.__class__.__subclasses__() }}",
]


@pytest.mark.parametrize("source", INTERNALS)
def test_reaching_python_internals_is_refused(source: str) -> None:
    with pytest.raises(TemplateBoundError, match=r"tried to reach Python internals \(attribute '_"):
        _render(source)


HUGE = [
    # (template, the bound that stops it)
    ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "an output of over"),
    ("{{ 'x' * 10000000000 }}", "a repeated value of over"),
    ("{{ 'x'|center(10000000000) }}", "a value of over"),
    ("{{ 'x'.ljust(10000000000) }}", "a string of over"),
    ("{% set s = 'x' * 1000000 %}{{ s.replace('x', s) }}", "a string of over"),
    ("{% set s = 'x' * 1000000 %}{{ s|replace('x', s) }}", "a value of over"),
    ("{% set s = 'x' * 1000000 %}{{ [s, s, s, s]|join }}", "an argument of over"),
    ("{% set s = 'x' * 1000000 %}{{ s ~ s }}", "an argument of over"),
    ("{{ '%999999999s' % 'x' }}", "a formatted string of over"),
    ("{{ '{:>999999999}'.format('x') }}", "a string of over"),
    ("{{ 'a\tb'.expandtabs(100000000) }}", "a string of over"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "an argument of over"),
    ("{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ d('x', 60) }}",
     "an argument of over"),
    # values piled up (a macro's output, a growing list) count toward what a render computes in all
    ("{% macro m() %}{% for i in range(100000) %}{{ 'y' * 1000000 }}{% endfor %}{% endmacro %}{{ m() }}",
     "computed over"),
    ("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x, 'y' * 1000000] %}"
     "{% endfor %}", "computed over"),
    ("{{ 9**99999 }}", "would compute a 399996-bit integer"),
    ("{{ ('x' * 300000)|wordwrap(1) }}", "wordwrap filter takes at most 65536 characters"),
    # no output at all: the inner loops' items are counted against the deadline
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit of 1 s"),
    ("{% set a = range(100000)|list %}{% for i in a %}{% for j in a %}{% endfor %}{% endfor %}", "time limit of 1 s"),
]


@pytest.mark.parametrize(("source", "bound"), HUGE)
def test_huge_or_endless_templates_are_stopped_by_a_bound(source: str, bound: str) -> None:
    start = time.monotonic()
    with pytest.raises(TemplateBoundError, match=bound):
        _render(source)
    assert time.monotonic() - start < template_sandbox.MAX_RENDER_SECONDS + 0.5


def test_the_size_bound_is_one_mib_plus_twice_the_conversation() -> None:
    mib = template_sandbox.MAX_OUTPUT_CHARS
    assert len(_render(f"{{{{ 'x' * {mib} }}}}")) == mib
    with pytest.raises(TemplateBoundError, match="a repeated value of over 1048"):
        _render(f"{{{{ 'x' * {mib + 100} }}}}")
    # a long conversation may be written out twice (and a little more)
    long = [{"role": "user", "content": "y" * mib}]
    twice = "{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}"
    assert len(render_request_template(twice, _Tok(), long, None, True, False, {})) == 2 * mib
    with pytest.raises(TemplateBoundError, match="an output of over 3145"):
        render_request_template("{{ messages[0].content * 3 }}" + twice, _Tok(), long, None, True, False, {})


def test_template_text_is_never_a_file_name() -> None:
    assert _render("/etc/hostname") == "/etc/hostname"
    for tag in ('include "/etc/hostname"', 'import "/etc/hostname" as h', 'extends "/etc/hostname"'):
        # the sandbox has no loader: nothing is read from disk
        with pytest.raises(ChatTemplateError, match="TypeError: no loader for this environment specified"):
            apply_chat_template(_Tok(), MESSAGES, f"{{% {tag} %}}", bounded=True)
    with pytest.raises(TemplateBoundError, match="a request's template may have at most 262144"):
        _render("x" * (template_sandbox.MAX_TEMPLATE_CHARS + 1))


def test_a_failing_request_template_is_a_chat_template_error() -> None:
    """Whatever a request's template raises is the request's fault (a 400), never a 500."""
    for source, name in [("{{ raise_exception('roles must alternate') }}", "TemplateError"),
                         ("{{ 1 / 0 }}", "ZeroDivisionError"),
                         ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
                         ("{{ ''.__class__ }}", "TemplateBoundError")]:
        with pytest.raises(ChatTemplateError, match=f"^The chat template failed: {name}: "):
            apply_chat_template(_Tok(), MESSAGES, source, bounded=True)


@pytest.fixture(scope="module")
def tokenizer(default_model_path: str) -> PreTrainedTokenizerFast:
    from pagellm.model_executor.loader import load_tokenizer

    return load_tokenizer(default_model_path)


def test_the_servers_own_templates_are_not_bounded(tokenizer) -> None:
    """Only a request's template is bounded; the operator's render as transformers renders them."""
    big = template_sandbox.MAX_OUTPUT_CHARS * 2
    text = apply_chat_template(tokenizer, MESSAGES, f"{{{{ 'x' * {big} }}}}")
    assert len(text) == big


TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{%- macro header(role) %}{{ '<|start|>' ~ role ~ '<|sep|>\\n' }}{% endmacro %}
{{- header('system') }}{{- "Today: " + strftime_now("%Y")[:0] + "\\n" }}
{%- if tools %}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}{%- endif %}
{{- system_message }}<|end|>
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message.content is string %}
        {{- header(message['role']) + message['content'] | trim }}{{ ' (%d)' % loop.index }}<|end|>
    {%- else %}{{- raise_exception("bad content") }}{%- endif %}
{%- endfor %}
{{- "turns=" ~ ns.turns|string }}
{%- if add_generation_prompt %}{{- header('assistant') }}{%- endif %}
"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("continue_final", [False, True])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_bounded_rendering_equals_transformers(tokenizer, tools, continue_final: bool) -> None:
    tok = tokenizer
    assert isinstance(tok, PreTrainedTokenizerFast) and tok.chat_template
    conv = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather in Paris?"}]
    if continue_final:
        conv.append({"role": "assistant", "content": "It is"})
    for source in (TEMPLATE, tok.chat_template):
        plain = apply_chat_template(tok, conv, source, True, continue_final, tools=tools)
        bounded = apply_chat_template(tok, conv, source, True, continue_final, tools=tools, bounded=True)
        assert bounded == plain
        assert plain.endswith("It is" if continue_final else "assistant<|sep|>\n" if source is TEMPLATE
                              else "<|im_start|>assistant\n")
