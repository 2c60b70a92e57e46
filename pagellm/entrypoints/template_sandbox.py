"""The bounded sandbox that renders a chat template sent in a request (only with
`--trust-request-chat-template`): template text and the conversation in, prompt text out.

Jinja's sandbox already keeps a template from Python's internals; this one refuses such an
access outright (Jinja would render it as an empty value), and bounds what the template
may cost: its output and every value it builds stay under a size budget, and it must
finish within a deadline. The server's own templates (the model's, --chat-template) are
trusted and rendered by transformers as before; nothing here knows the engine.

How the bounds are enforced, since one Python operation cannot be interrupted once begun:
every operation that can make a large value (`*`, `**`, `+`, `%`, `~`, a filter, a method
call, a macro's or block's output) has its inputs measured, and its result estimated,
*before* it runs; every loop iteration, call, attribute lookup and output chunk checks the
deadline. Both failures are a `SecurityError` naming the bound.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.visitor import NodeTransformer

MAX_OUTPUT_CHARS = 1024**2
"""A request's template may write 1 MiB of text, plus twice the size of the conversation
(messages, tools and chat_template_kwargs) it renders; no value it builds may be larger."""
MAX_RENDER_SECONDS = 1.0
"""A request's template must render within this many seconds."""
MAX_COMPUTED_FACTOR = 32
"""What a render computes in all (every value made, every block and macro output, so a loop
that piles values up is stopped long before memory runs out) stays under this many times
the output budget."""
MAX_TEMPLATE_CHARS = 256 * 1024
"""Longest template text a request may send (the Hub's chat templates are under 20 KiB)."""
MAX_WORDWRAP_CHARS = 64 * 1024
"""Longest text the wordwrap filter may wrap (it cannot be stopped once it runs)."""
MAX_INT_BITS = 4096
"""Integers a template computes with `*` or `**` stay under this many bits."""


class TemplateBoundError(SecurityError):
    """A request's chat template went past a size or time bound, or reached for Python's internals."""


@dataclass
class _Budget:
    """The bounds of one render (held in a ContextVar, so renders in threads don't mix)."""

    max_chars: int
    deadline: float
    written: int = 0
    computed: int = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBoundError(
                f"the chat template ran past its time limit of {MAX_RENDER_SECONDS:g} s and was stopped."
            )

    def fits(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise TemplateBoundError(
                f"the chat template would build {what} of over {self.max_chars} characters, "
                f"past its size limit, and was stopped."
            )

    def made(self, value: Any, size: int | None = None) -> None:
        """A value the template just computed: it must fit, and its new characters (a
        container's own slots; its items were counted when made) count toward the total."""
        full = _size(value, self.max_chars) if size is None else size
        self.fits(full, "a value")
        self.computed += full if isinstance(value, (str, bytes)) or size is not None else _shallow(value)
        if self.computed > MAX_COMPUTED_FACTOR * self.max_chars:
            raise TemplateBoundError(
                f"the chat template computed over {MAX_COMPUTED_FACTOR * self.max_chars} characters in all, "
                f"past its limit, and was stopped."
            )


_budget: ContextVar[_Budget | None] = ContextVar("template_budget", default=None)


def _active() -> _Budget:
    budget = _budget.get()
    if budget is None:  # compile-time constant folding: leave the expression to run time
        raise TemplateBoundError("bounded template operations run only while rendering.")
    return budget


def _size(value: Any, limit: int) -> int:
    """Characters `value` takes as text, counted up to just past `limit` (containers
    count each reference to a shared item again, as printing them would)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    elif not isinstance(value, (list, tuple, set, frozenset)):
        return 1
    total = len(value)
    for item in value:
        if total > limit:
            break
        total += _size(item, limit - total)
    return total


def _shallow(value: Any) -> int:
    return len(value) if isinstance(value, (list, tuple, set, frozenset, dict)) else 1


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, (list, tuple)):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


_NUMBER = re.compile(r"\d+")


def _format_bound(fmt: str | bytes, args: Any, limit: int) -> int:
    """`fmt % args` or `fmt.format(args)`: each placeholder may print all of the args, and
    widths and precisions written in `fmt` add their own padding."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    places = text.count("%") + text.count("{")
    return len(text) + places * _size(args, limit) + sum(int(n) for n in _NUMBER.findall(text))


def _text_bound(name: str, target: Any, args: tuple, kwargs: dict, limit: int) -> int:
    """An upper bound on the size of what str/bytes method or filter `name` returns for
    `target` (its first argument); the sizes of the arguments are checked by the caller."""
    n = _size(target, limit)

    def arg(i: int, key: str, default: Any) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    def width(value: Any) -> int:
        return value if isinstance(value, int) else _size(value, limit)

    if name in ("center", "ljust", "rjust"):
        return max(n, width(arg(0, "width", 80)))
    if name == "zfill":
        return max(n, width(arg(0, "width", 0)))
    if name == "expandtabs":
        return n + str(target).count("\t") * width(arg(0, "tabsize", 8))
    if name == "replace":
        old, new = arg(0, "old", ""), arg(1, "new", "")
        return n + (n // max(_size(old, limit), 1) + 1) * _size(new, limit)
    if name == "translate":  # a table may map one character to a long string
        table = arg(0, "table", {})
        return n * (1 + max((_size(v, limit) for v in getattr(table, "values", list)()), default=1))
    if name in ("format", "format_map"):
        return _format_bound(target, (args, kwargs), limit) if isinstance(target, (str, bytes)) else n
    if name == "indent":
        return n + (str(target).count("\n") + 1) * width(arg(0, "width", 4))
    if name == "wordwrap":
        wrap = arg(2, "wrapstring", None) or "\n"
        return n + (n // max(width(arg(0, "width", 79)), 1) + 1) * _size(wrap, limit)
    if name == "tojson":
        indent = arg(1, "indent", None)
        return n * 4 * (1 + (width(indent) if indent else 0) * _depth(target))
    if name == "to_bytes":
        return width(arg(0, "length", 1))
    return n


class _BoundLoops(NodeTransformer):
    """Rewrites `{% for x in seq %}` to iterate `environment.bounded_iter(seq)` (one
    deadline check per item) and `a ~ b` to `environment.bounded_concat((a, b))`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("bounded_concat"),
                          [nodes.Tuple(node.nodes, "load", lineno=node.lineno)], [], None, None,
                          lineno=node.lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Transformers' chat-template environment (trim_blocks, lstrip_blocks, loop controls,
    tojson without HTML escaping, raise_exception, strftime_now) with the bounds above."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         finalize=self._finalize)
        self.concat = self._concat_output  # macros, {% set %} and {% filter %} blocks
        self.filters["tojson"] = _tojson
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_TemplateNamespace)

    # -- refusing internals ----------------------------------------------------------------

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """Jinja renders an unsafe attribute as an empty value; a request's template that
        reaches for one is refused instead."""
        raise TemplateBoundError(
            f"the chat template tried to reach Python internals (attribute {attribute!r} of a "
            f"{type(obj).__name__!r} object) and was refused."
        )

    def getattr(self, obj: Any, attribute: str) -> Any:
        _active().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _active().tick()
        return super().getitem(obj, argument)

    # -- bounding what a template builds -------------------------------------------------------

    def _check_inputs(self, budget: _Budget, values: Iterable[Any]) -> None:
        budget.tick()
        for value in values:
            budget.fits(_size(value, budget.max_chars), "an argument")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _active()
        __self._check_inputs(budget, (*args, *kwargs.values()))
        # a bound method's object; str.format comes wrapped by Jinja's sandbox
        target = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(target, (str, bytes, int)) and not isinstance(target, bool):
            budget.fits(_size(target, budget.max_chars), "a string")
            budget.fits(_text_bound(__obj.__name__, target, args, kwargs, budget.max_chars), "a string")
            if __obj.__name__ == "join":
                items = tuple(args[0]) if args else ()
                budget.fits(sum(_size(x, budget.max_chars) for x in items)
                            + len(items) * len(target), "a string")
                args = (items, *args[1:])
        result = super().call(__context, __obj, *args, **kwargs)
        budget.made(result)
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _active()
        self._check_inputs(budget, (left, right))
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0:
            bits = max(left.bit_length(), 1) * right
            if bits > MAX_INT_BITS:
                raise TemplateBoundError(f"the chat template would compute a {bits}-bit integer and was stopped.")
        elif operator == "*" and ints:
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateBoundError("the chat template would compute a huge integer and was stopped.")
        elif operator == "*":
            seq, times = (right, left) if isinstance(left, int) else (left, right)
            if isinstance(times, int):
                budget.fits(_size(seq, budget.max_chars) * max(times, 0), "a repeated value")
        elif operator == "+":
            budget.fits(_size(left, budget.max_chars) + _size(right, budget.max_chars), "a value")
        elif operator == "%" and isinstance(left, (str, bytes)):
            budget.fits(_format_bound(left, right, budget.max_chars), "a formatted string")
        result = super().call_binop(context, operator, left, right)
        budget.made(result)
        return result

    def _bounded_filter(self, name: str, f: Callable) -> Callable:
        @functools.wraps(f)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            budget = _active()
            # a filter is called as f(value, ...), or f(context_or_env, value, ...)
            values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.Environment,
                                                              nodes.EvalContext))]
            self._check_inputs(budget, (*values, *kwargs.values()))
            if values:
                budget.fits(_text_bound(name, values[0], tuple(values[1:]), kwargs, budget.max_chars), "a value")
            if name == "join" and values:
                sep = values[1] if len(values) > 1 else kwargs.get("d", "")
                items = tuple(values[0])
                budget.fits(sum(_size(x, budget.max_chars) for x in items) + len(items) * _size(sep, budget.max_chars),
                            "a joined string")
                args = tuple(items if a is values[0] else a for a in args)
            if name == "wordwrap" and values and _size(values[0], budget.max_chars) > MAX_WORDWRAP_CHARS:
                # textwrap runs in one uninterruptible call, seconds long for 300k characters
                raise TemplateBoundError(f"the chat template's wordwrap filter takes at most "
                                         f"{MAX_WORDWRAP_CHARS} characters.")
            if name == "sum" and not isinstance(kwargs.get("start", values[2] if len(values) > 2 else 0), (int, float)):
                raise TemplateBoundError("the chat template's sum filter may add numbers only.")
            result = f(*args, **kwargs)
            budget.made(result)
            return result

        return bounded

    def bounded_iter(self, iterable: Any) -> Iterator[Any]:
        budget = _active()
        for item in iterable:
            budget.tick()
            yield item

    def bounded_concat(self, parts: tuple) -> str:
        budget = _active()
        self._check_inputs(budget, parts)
        texts = [str(p) for p in parts]
        budget.fits(sum(map(len, texts)), "a string")
        result = "".join(texts)
        budget.made(result)
        return result

    def _concat_output(self, chunks: Iterable[str]) -> str:
        budget = _budget.get()
        if budget is None:
            return "".join(chunks)
        pieces, total = [], 0
        for chunk in chunks:
            budget.tick()
            total += len(chunk)
            budget.fits(total, "a block's output")
            pieces.append(chunk)
        budget.made("", size=total)
        return "".join(pieces)

    def _finalize(self, value: Any) -> Any:
        """Sees every `{{ expression }}` before it is turned into text."""
        budget = _active()
        budget.made(value, size=_size(value, budget.max_chars))  # what str(value) will make
        return value

    # -- compiling and rendering ----------------------------------------------------------------

    @functools.lru_cache(maxsize=32)  # noqa: B019 - one environment for the process
    def compile_template(self, source: str) -> jinja2.Template:
        tree = _BoundLoops().visit(self.parse(source))
        tree.set_environment(self)
        return self.from_string(tree)

    def render_bounded(self, source: str, variables: dict[str, Any], input_size: int) -> str:
        """Renders `source` with `variables`; `input_size` (the conversation's size) widens
        the output budget. Raises TemplateBoundError past a bound, jinja2's errors otherwise."""
        template = self.compile_template(source)
        budget = _Budget(max_chars=MAX_OUTPUT_CHARS + 2 * input_size,
                         deadline=time.monotonic() + MAX_RENDER_SECONDS)
        token = _budget.set(budget)
        try:
            pieces: list[str] = []
            for chunk in template.generate(**variables):
                budget.tick()
                budget.written += len(chunk)
                budget.fits(budget.written, "an output")
                pieces.append(chunk)
            return "".join(pieces)
        finally:
            _budget.reset(token)


@functools.cache
def bounded_sandbox() -> BoundedSandbox:
    return BoundedSandbox()


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_request_template(source: str, tokenizer: Any, messages: list[dict[str, Any]], tools: Any,
                            add_generation_prompt: bool, continue_final_message: bool,
                            kwargs: dict[str, Any]) -> str:
    """Renders a request's chat template with the variables transformers gives one: the
    tokenizer's special tokens (bos_token, eos_token, ...), chat_template_kwargs, messages,
    tools and add_generation_prompt. `source` is always template text, never a file name.
    A continued final message is cut where its content ends, as transformers does."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateBoundError(f"the chat template is {len(source)} characters long; a request's "
                                 f"template may have at most {MAX_TEMPLATE_CHARS}.")
    final = ""
    if continue_final_message:
        final = messages[-1].get("content") or ""
        messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    variables = {**special, **kwargs, "messages": messages, "tools": tools, "documents": None,
                 "add_generation_prompt": add_generation_prompt}
    unbounded = 1 << 62
    input_size = _size(messages, unbounded) + _size(tools, unbounded) + _size(kwargs, unbounded)
    text = bounded_sandbox().render_bounded(source, variables, input_size)
    if not continue_final_message:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message is set, but the chat template does not render the "
                         "final message's content.")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


# -- what transformers' chat-template environment offers a template --------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)`, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that stores no underscore-prefixed attribute."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise TemplateBoundError(f"the chat template may not store {name!r} on a namespace.")
