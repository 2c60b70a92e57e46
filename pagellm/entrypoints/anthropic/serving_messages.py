"""POST /v1/messages: Anthropic's Messages API (the subset vLLM and llama.cpp serve) over
the chat machinery. A request becomes a chat request (protocol.py), is rendered, tool-
planned, constrained and parsed as chat is, and its output goes back as `text` and
`tool_use` content blocks, whole or as Anthropic's stream events (message_start,
content_block_start / _delta / _stop, message_delta, message_stop). Errors keep the
server's OpenAI error JSON (the status codes are Anthropic's too).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from pagellm.entrypoints.anthropic.protocol import (
    MessagesInputError,
    MessagesRequest,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    messages_param,
    system_messages,
)
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, random_id
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_engine import (
    OpenAIError,
    as_openai_error,
    final_output,
    merge_generators,
    sse_data,
)


def _stop_reason(finish_reason: str | None, stop_reason: Any, called: bool) -> str | None:
    if called:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "stop":
        return "stop_sequence" if isinstance(stop_reason, str) else "end_turn"
    return finish_reason


def _tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:  # a call cut short: what was written, as text
        return {"_raw": arguments}


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {sse_data(json.dumps({'type': kind, **fields}, ensure_ascii=False))}\n\n"


class AnthropicServingMessages(OpenAIServingChat):
    def _chat_request(self, request: MessagesRequest) -> ChatCompletionRequest:
        try:
            choice, parallel = chat_tool_choice(request.tool_choice)
            return ChatCompletionRequest(
                model=request.model, messages=system_messages(request.system) + chat_messages(request.messages),
                tools=chat_tools(request.tools), tool_choice=choice,
                parallel_tool_calls=parallel if parallel is not None else True,
                max_completion_tokens=request.max_tokens, temperature=request.temperature,
                top_p=request.top_p, top_k=request.top_k, stop=request.stop_sequences, stream=request.stream,
            )
        except MessagesInputError as e:
            raise OpenAIError(str(e), param=e.param) from e
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ()))
            raise OpenAIError(f"Invalid request: {err.get('msg')}", param=messages_param(loc) or None) from e

    async def create(self, request: MessagesRequest, request_id: str | None = None) -> Any:
        chat = self._chat_request(request)
        try:
            prompt, ids, params, plan = self._prepare(chat)
            constraint, field_name = await self._constraint(chat, plan)
            await self.attach_structured_outputs(params, constraint, field_name)
        except OpenAIError as e:
            e.param = messages_param(e.param)
            raise
        message_id = f"msg_{request_id}" if request_id else random_id("msg").replace("-", "_")
        gen = self.engine.generate({"prompt_token_ids": ids, "prompt": prompt}, params, message_id)
        model = request.model or self.served_model_names[0]
        if request.stream:
            return self._stream(chat, plan, message_id, model, ids, gen)
        final = await final_output(gen)
        c = final.outputs[0]
        message, _ = self._message(chat, plan, c.text, c.finish_reason)
        content: list[dict[str, Any]] = []
        if message.content:
            content.append({"type": "text", "text": message.content})
        for call in message.tool_calls:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": _tool_input(call["function"]["arguments"])})
        return {
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": _stop_reason(c.finish_reason, c.stop_reason, bool(message.tool_calls)),
            "stop_sequence": c.stop_reason if isinstance(c.stop_reason, str) else None,
            "usage": {"input_tokens": len(ids), "output_tokens": len(c.token_ids)},
        }

    async def _stream(self, chat: ChatCompletionRequest, plan: Any, message_id: str, model: str,
                      ids: list[int], gen: Any) -> AsyncIterator[str]:
        yield _event("message_start", message={
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(ids), "output_tokens": 0}})
        yield _event("ping")
        state = self._stream_state(chat, plan)
        blocks = _Blocks()
        output_tokens, finish_reason, stop_reason = 0, None, None
        try:
            async for _, out in merge_generators([gen]):
                c = out.outputs[0]
                output_tokens += len(c.token_ids)
                delta = self._delta(chat, state, c.text, c.finish_reason is not None)
                if delta.content:
                    for event in blocks.text(delta.content):
                        yield event
                for frag in delta.tool_calls or []:
                    for event in blocks.call_fragment(frag):
                        yield event
                if c.finish_reason is not None:
                    finish_reason, stop_reason = c.finish_reason, c.stop_reason
        except Exception as e:
            err = as_openai_error(e)
            yield _event("error", error={"type": err.err_type, "message": err.message})
            return
        for event in blocks.close():
            yield event
        yield _event("message_delta", delta={
            "stop_reason": _stop_reason(finish_reason, stop_reason, blocks.called),
            "stop_sequence": stop_reason if isinstance(stop_reason, str) else None},
            usage={"output_tokens": output_tokens})
        yield _event("message_stop")


class _Blocks:
    """The content blocks of a stream: a text block grows by text_delta; a tool_use block
    by input_json_delta. A new block stops the open one."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" | "tool_use"
        self.called = False
        self._call_index: int | None = None  # the streamed tool call the open block holds

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        return out + [_event("content_block_start", index=self.index, content_block=block)]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open, self._call_index = None, None
        return [_event("content_block_stop", index=self.index)]

    def text(self, piece: str) -> list[str]:
        out = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        return out + [_event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": piece})]

    def call_fragment(self, frag: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if "id" in frag:  # a new call
            self.called = True
            out += self._start({"type": "tool_use", "id": frag["id"], "name": frag["function"]["name"],
                                "input": {}})
            self._call_index = frag["index"]
        piece = frag["function"].get("arguments") or ""
        if piece and self._call_index == frag["index"]:
            out.append(_event("content_block_delta", index=self.index,
                              delta={"type": "input_json_delta", "partial_json": piece}))
        return out

    def close(self) -> list[str]:
        return self._stop()
