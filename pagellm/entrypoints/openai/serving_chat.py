"""POST /v1/chat/completions: messages -> chat template -> AsyncLLM -> OpenAI chat JSON
or SSE chunks (first chunk carries the role, the last one the finish reason).

Tools: `tool_choice` "required" or a named function constrains the output with a JSON
schema (structured outputs) and reads it back as tool calls; "auto" parses the model's
own tool-call syntax, read with the parser of the format its chat template teaches
(tool_format.py) or the server's `--tool-call-parser`. A template with no format read
here gets the generic tool prompt, and under "auto" a grammar holds the reply to text
or calls that fit the tools (llama.cpp's generic handler). With `--reasoning-parser`,
`<think>` text is returned as `reasoning_content`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.chat_utils import ChatTemplateError, apply_chat_template, validate_messages
from pagellm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobContent,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTopLogprob,
    DeltaMessage,
    random_id,
)
from pagellm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    as_openai_error,
    final_output,
    merge_generators,
    prompt_logprobs_json,
    sse,
    usage,
)
from pagellm.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParser, get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.generic_prompt import generic_tool_reply_grammar
from pagellm.entrypoints.openai.tool_parsers.tool_choice import (
    InvalidToolRequest,
    constrained_tool_call_streamer,
    tool_calls_from_constrained_output,
    tool_choice_json_schema,
    validate_tool_choice,
    validate_tools,
)
from pagellm.entrypoints.openai.tool_parsers.tool_format import template_tool_parser
from pagellm.outputs import CompletionOutput
from pagellm.reasoning import ReasoningParser, ReasoningStreamer, get_reasoning_parser
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams

_RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bounded", "tokenize", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
})
"""Names chat_template_kwargs may not use: apply_chat_template's own parameters and
transformers', which would change how the prompt is made rather than what the template sees."""


@dataclass
class _ToolPlan:
    """How one request's tools are handled."""

    choice: str | dict[str, Any] = "none"
    # "required" or a named tool: the output is constrained to tool calls.
    constrained: bool = False
    # "auto": the parser that reads tool calls from the model's text.
    parser: ToolParser | None = None
    # The tools go in the generic prompt even if the template renders tools (it teaches
    # a format no parser here reads).
    generic: bool = False
    # "auto" under the generic prompt: the reply is held to text or calls to the tools.
    reply_grammar: bool = False


@dataclass(frozen=True)
class _ToolFormat:
    """How "auto" tool calls are written and read for one chat template."""

    parser: str
    # "flag": --tool-call-parser's (vLLM's path: the template renders tools if it can, else
    # the generic prompt, and no grammar); "template": the format the template teaches;
    # "generic": the generic prompt, its replies held to text or calls
    source: str

    def describe(self) -> str:
        if self.source == "flag":
            return f"{self.parser} (--tool-call-parser)"
        if self.source == "template":
            return f"{self.parser}, the chat template's format"
        return "the generic tool prompt (hermes syntax), replies held to text or tool calls"


@dataclass
class _StreamState:
    """Per choice of a stream: the parsers' held-back text and whether a call went out."""

    reasoning: ReasoningStreamer | None
    tools: ToolCallStreamer | None
    called: bool = False


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's flags, accepted and overriding the format read from the template; "auto"
        # works without them (a deliberate difference: vLLM refuses it).
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self._parsers: dict[str, ToolParser] = {}
        self.reasoner: ReasoningParser | None = (
            get_reasoning_parser(reasoning_parser)(self.tokenizer) if reasoning_parser else None
        )

    # -- request -> prompt and params ----------------------------------------------------

    def _tool_plan(self, request: ChatCompletionRequest) -> _ToolPlan:
        try:
            specs = validate_tools(request.tools) if request.tools else []
            choice = validate_tool_choice(request.tool_choice, specs)
        except InvalidToolRequest as e:
            raise OpenAIError(str(e), param=e.param) from e
        if not specs or choice == "none":
            return _ToolPlan(choice=choice)
        if choice != "auto":
            return _ToolPlan(choice=choice, constrained=True)
        fmt = self.tool_format(request.chat_template or (request.chat_template_kwargs or {}).get("chat_template"))
        generic = fmt.source == "generic"
        return _ToolPlan(choice=choice, parser=self._parser(fmt.parser), generic=generic, reply_grammar=generic)

    def tool_format(self, request_template: str | None = None) -> _ToolFormat:
        """The format of "auto" tool calls: --tool-call-parser's, else the one the chat
        template teaches, else the generic prompt's (hermes syntax)."""
        if self.tool_call_parser:
            return _ToolFormat(self.tool_call_parser, "flag")
        template = request_template or self.chat_template or getattr(self.tokenizer, "chat_template", None)
        name = template_tool_parser(template) if isinstance(template, str) else None
        return _ToolFormat(name, "template") if name else _ToolFormat("hermes", "generic")

    def _parser(self, name: str) -> ToolParser:
        if name not in self._parsers:
            self._parsers[name] = get_tool_parser(name)(self.tokenizer)
        return self._parsers[name]

    def _render(self, request: ChatCompletionRequest, plan: _ToolPlan) -> str:
        kwargs = dict(request.chat_template_kwargs or {})
        sent_template = request.chat_template or kwargs.pop("chat_template", None)
        if sent_template is not None and not self.trust_request_chat_template:
            # A template is code run by the server: only the operator's are trusted.
            raise OpenAIError(
                "chat_template in the request is refused: this server runs only its own chat "
                "template unless it is started with --trust-request-chat-template.",
                param="chat_template",
            )
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise OpenAIError(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own "
                              "fields do.", param="chat_template_kwargs")
        try:
            return apply_chat_template(
                self.tokenizer, request.messages, sent_template or self.chat_template,
                request.add_generation_prompt, request.continue_final_message,
                tools=request.tools if plan.choice != "none" else None, generic_tools=plan.generic,
                bounded=sent_template is not None, **kwargs,  # a request's template: bounded sandbox
            )
        except ChatTemplateError as e:
            raise OpenAIError(str(e), param="chat_template" if sent_template is not None else "messages") from e
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from e

    def _prepare(self, request: ChatCompletionRequest) -> tuple[str, list[int], SamplingParams, _ToolPlan]:
        self.check_model(request.model)
        self.check_alive()
        self.check_prompt_logprobs(request)
        plan = self._tool_plan(request)
        prompt = self._render(request, plan)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.validate_length(ids, request.requested_max_tokens, param)
        params = request.to_sampling_params(max_tokens)
        if plan.parser is not None:
            params.skip_special_tokens = False  # tool-call markers may be special tokens
        self.check_sampling_params(params)
        return prompt, ids, params, plan

    async def _constraint(self, request: ChatCompletionRequest, plan: _ToolPlan) -> tuple[StructuredOutputsParams | None, str | None]:
        constraint, field_name = self.requested_constraint(request)
        if plan.reply_grammar and constraint is None:  # a request's own constraint wins
            try:
                grammar = await asyncio.to_thread(generic_tool_reply_grammar, request.tools,
                                                  request.parallel_tool_calls)
            except InvalidToolRequest as e:
                raise OpenAIError(str(e), param=e.param) from e
            return StructuredOutputsParams(grammar=grammar), "tools"
        if not plan.constrained:
            return constraint, field_name
        if constraint is not None:
            raise OpenAIError(f"tool_choice {_choice_name(plan.choice)} constrains the output to tool calls; "
                              f"it cannot be combined with {field_name}.", param="tool_choice")
        schema = tool_choice_json_schema(request.tools, plan.choice, request.parallel_tool_calls)
        return StructuredOutputsParams(json=schema), "tool_choice"

    async def create(self, request: ChatCompletionRequest,
                     request_id: str | None = None) -> ChatCompletionResponse | AsyncIterator[str]:
        prompt, ids, params, plan = self._prepare(request)
        constraint, field_name = await self._constraint(request, plan)
        await self.attach_structured_outputs(params, constraint, field_name)
        request_id = f"chatcmpl-{request_id}" if request_id else random_id("chatcmpl")
        gen = self.engine.generate({"prompt_token_ids": ids, "prompt": prompt}, params, request_id,
                                   priority=request.priority)
        if request.stream:
            return self._stream(request, request_id, ids, gen, plan)
        final = await final_output(gen)
        echo = _echoed(request)
        choices = []
        completion_tokens = 0
        for c in sorted(final.outputs, key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            message, finish_reason = self._message(request, plan, c.text, c.finish_reason)
            if echo:
                message.content = echo + (message.content or "")
            choices.append(ChatChoice(
                index=c.index,
                message=message,
                logprobs=self._logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            ))
        prompt_lps = prompt_logprobs_json(final.prompt_logprobs) if request.prompt_logprobs is not None else None
        return ChatCompletionResponse(id=request_id, model=request.model or self.served_model_names[0],
                                      choices=choices, usage=usage(len(ids), completion_tokens),
                                      prompt_logprobs=prompt_lps)

    # -- output text -> message -------------------------------------------------------------

    def _message(self, request: ChatCompletionRequest, plan: _ToolPlan, text: str,
                 finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        reasoning, content = self.reasoner.extract_reasoning(text) if self.reasoner else (None, text)
        if not request.include_reasoning:
            reasoning = None
        calls: list[dict[str, Any]] = []
        if plan.constrained and content is not None:
            try:
                calls = [c.to_dict() for c in tool_calls_from_constrained_output(content, request.tools, plan.choice)]
                content = None
            except ValueError:
                pass  # cut short (max_tokens): the text is returned as it is
        elif plan.parser is not None and content:
            extracted = plan.parser.extract_tool_calls(content)
            calls = [c.to_dict() for c in extracted.tool_calls]
            content = extracted.content  # stripped, as the streamed pieces are
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return ChatMessage(role="assistant", content=content, reasoning_content=reasoning, tool_calls=calls), finish_reason

    def _logprobs(self, c: CompletionOutput, top: int) -> ChatLogprobs:
        """Per token: the sampled token's logprob and exactly `top` alternatives, the most
        likely first (the engine's entry may hold one more: the sampled token itself)."""
        content = []
        for tok, entry in zip(c.token_ids, c.logprobs or []):
            token = self.tokenizer.decode([tok])
            ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top),
                            key=lambda kv: kv[1].rank or 0)
            tops = [
                ChatTopLogprob(token=(lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([t])),
                               logprob=lp.logprob, bytes=list(self.tokenizer.decode([t]).encode()))
                for t, lp in ranked
            ]
            sampled = entry.get(tok)
            content.append(ChatLogprobContent(
                token=token, logprob=sampled.logprob if sampled else float("-inf"),
                bytes=list(token.encode()), top_logprobs=tops,
            ))
        return ChatLogprobs(content=content)

    # -- streaming ---------------------------------------------------------------------------

    def _stream_state(self, request: ChatCompletionRequest, plan: _ToolPlan) -> _StreamState:
        tools: ToolCallStreamer | None = None
        if plan.constrained:
            tools = constrained_tool_call_streamer(request.tools, plan.choice)
        elif plan.parser is not None:
            tools = plan.parser.streamer()
        return _StreamState(reasoning=self.reasoner.streamer() if self.reasoner else None, tools=tools)

    @staticmethod
    def _delta(request: ChatCompletionRequest, state: _StreamState, text: str, final: bool) -> DeltaMessage:
        """Runs a text delta through the reasoning parser, then the tool-call parser."""
        reasoning_parts: list[str] = []
        content_parts: list[str] = []
        calls: list[dict[str, Any]] = []
        pieces = []
        if state.reasoning is not None:
            pieces.append(state.reasoning.feed(text))
            if final:
                pieces.append(state.reasoning.finish())
        else:
            pieces.append((None, text))
        for reasoning, content in pieces:
            if reasoning:
                reasoning_parts.append(reasoning)
            if content:
                if state.tools is not None:
                    d = state.tools.feed(content)
                    content_parts.append(d.content or "")
                    calls += d.tool_calls
                else:
                    content_parts.append(content)
        if final and state.tools is not None:
            d = state.tools.finish()
            content_parts.append(d.content or "")
            calls += d.tool_calls
        state.called = state.called or bool(calls)
        return DeltaMessage(
            content="".join(content_parts) or None,
            reasoning_content=("".join(reasoning_parts) or None) if request.include_reasoning else None,
            tool_calls=calls or None,
        )

    async def _stream(self, request: ChatCompletionRequest, request_id: str, ids: list[int], gen,
                      plan: _ToolPlan) -> AsyncIterator[str]:
        model = request.model or self.served_model_names[0]
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        echo = _echoed(request)
        completion_tokens = 0
        states: dict[int, _StreamState] = {}

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice],
                                           usage=usage(len(ids), completion_tokens) if continuous else None))

        try:
            async for _, out in merge_generators([gen]):
                for c in out.outputs:
                    if c.index not in states:
                        states[c.index] = self._stream_state(request, plan)
                        yield chunk(ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=echo)))
                    state = states[c.index]
                    completion_tokens += len(c.token_ids)
                    finished = c.finish_reason is not None
                    delta = self._delta(request, state, c.text, finished)
                    wants_logprobs = request.logprobs and bool(c.token_ids)
                    if delta == DeltaMessage() and not finished and not wants_logprobs:
                        continue
                    finish_reason = c.finish_reason
                    if state.called and finish_reason == "stop":
                        finish_reason = "tool_calls"
                    yield chunk(ChatStreamChoice(
                        index=c.index, delta=delta,
                        logprobs=self._logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                        finish_reason=finish_reason, stop_reason=c.stop_reason,
                    ))
            if include_usage:
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[],
                                              usage=usage(len(ids), completion_tokens)))
        except Exception as e:
            yield sse(as_openai_error(e).response())
        yield SSE_DONE


def _choice_name(choice: str | dict[str, Any]) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice['function']['name']!r}"


def _echoed(request: ChatCompletionRequest) -> str:
    """With echo, the reply starts with the last message when that is the assistant's own
    (a reply being continued); otherwise nothing is echoed."""
    if not request.echo:
        return ""
    last = validate_messages(request.messages[-1:])[0]
    return last["content"] if last.get("role") == "assistant" else ""
