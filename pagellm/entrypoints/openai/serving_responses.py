"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat
machinery. A request becomes a chat request (responses_protocol.py), is rendered, tool-
planned, constrained and parsed as chat is, and its output goes back as Responses items
(`message` with `output_text`, `function_call`, `reasoning`), whole or as the Responses
stream events. Stored responses (`store`, default true) live in a bounded in-memory store;
`previous_response_id` continues one (its input and output come before the new input).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, random_id
from pagellm.entrypoints.openai.responses_protocol import (
    ResponsesInputError,
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
    responses_param,
)
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    as_openai_error,
    final_output,
    merge_generators,
    sse_data,
)

DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass
class StoredResponse:
    response: dict[str, Any]
    # the conversation up to and including this response's output, as chat messages
    # (without its instructions, which a continuation does not inherit)
    history: list[dict[str, Any]]


class ResponseStore:
    """Stored responses by id, the oldest evicted past `max_entries` (0: store nothing)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_entries <= 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def __len__(self) -> int:
        return len(self._entries)


def not_found(response_id: str, param: str | None) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found (never stored, not stored with "
                       "store: true, or evicted from this server's store).", HTTPStatus.NOT_FOUND, param)


@dataclass
class _Turn:
    """One request, made ready: the chat request it became and what to echo back."""

    request: ResponsesRequest
    chat: ChatCompletionRequest
    history: list[dict[str, Any]]  # input messages, without instructions
    response_id: str
    created_at: int = field(default_factory=lambda: int(time.time()))


class OpenAIServingResponses(OpenAIServingChat):
    def __init__(self, *args: Any, max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store = ResponseStore(max_stored_responses)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id, None)
        return entry.response

    # -- request -> chat request ---------------------------------------------------------

    def _turn(self, request: ResponsesRequest, request_id: str | None) -> _Turn:
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise not_found(request.previous_response_id, "previous_response_id")
            history = list(previous.history)
        try:
            history += input_messages(request.input)
            system = [{"role": "system", "content": request.instructions}] if request.instructions else []
            chat = ChatCompletionRequest(
                model=request.model, messages=system + history, tools=chat_tools(request.tools),
                tool_choice=chat_tool_choice(request.tool_choice),
                parallel_tool_calls=request.parallel_tool_calls,
                max_completion_tokens=request.max_output_tokens, temperature=request.temperature,
                top_p=request.top_p, response_format=chat_response_format(request.text),
                stream=request.stream, priority=request.priority,
            )
        except ResponsesInputError as e:
            raise OpenAIError(str(e), param=e.param) from e
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ()))
            raise OpenAIError(f"Invalid request: {err.get('msg')}", param=responses_param(loc) or None) from e
        response_id = f"resp_{request_id}" if request_id else random_id("resp").replace("-", "_")
        return _Turn(request, chat, history, response_id)

    async def create(self, request: ResponsesRequest,
                     request_id: str | None = None) -> Any:
        turn = self._turn(request, request_id)
        try:
            prompt, ids, params, plan = self._prepare(turn.chat)
            constraint, field_name = await self._constraint(turn.chat, plan)
            await self.attach_structured_outputs(params, constraint, field_name)
        except OpenAIError as e:
            e.param = responses_param(e.param)
            raise
        gen = self.engine.generate({"prompt_token_ids": ids, "prompt": prompt}, params, turn.response_id,
                                   priority=request.priority)
        if request.stream:
            return self._stream(turn, plan, ids, gen)
        final = await final_output(gen)
        c = final.outputs[0]
        message, finish_reason = self._message(turn.chat, plan, c.text, c.finish_reason)
        output = _output_items(message)
        usage = _usage(len(ids), len(c.token_ids), final.num_cached_tokens or 0)
        return self._finish(turn, message, output, finish_reason, usage)

    # -- output ---------------------------------------------------------------------------

    def _response(self, turn: _Turn, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        r = turn.request
        text_format = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format \
            else {"type": "text"}
        return {
            "id": turn.response_id, "object": "response", "created_at": turn.created_at,
            "model": r.model or self.served_model_names[0], "status": status,
            "output": output, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions, "tools": r.tools or [],
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "temperature": r.temperature, "top_p": r.top_p, "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id, "store": r.store, "metadata": r.metadata or {},
            "text": {"format": text_format}, "truncation": "disabled", "background": False,
            "reasoning": None, "user": r.user, "usage": usage,
        }

    def _finish(self, turn: _Turn, message: ChatMessage, output: list[dict[str, Any]],
                finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        """The final response, stored when the request asked for it."""
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        response = self._response(turn, "incomplete" if incomplete else "completed", output, usage, incomplete)
        if turn.request.store:
            said: dict[str, Any] = {"role": "assistant", "content": message.content}
            if message.tool_calls:
                said["tool_calls"] = message.tool_calls
            self.store.put(turn.response_id, StoredResponse(response, [*turn.history, said]))
        return response

    async def _stream(self, turn: _Turn, plan: Any, ids: list[int], gen: Any) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events.emit("response.created", response=self._response(turn, "in_progress", []))
        yield events.emit("response.in_progress", response=self._response(turn, "in_progress", []))
        state = self._stream_state(turn.chat, plan)
        items = _StreamedItems(events)
        completion_tokens, finish_reason, cached = 0, None, 0
        text_parts: list[str] = []
        try:
            async for _, out in merge_generators([gen]):
                c = out.outputs[0]
                completion_tokens += len(c.token_ids)
                cached = out.num_cached_tokens or cached
                finished = c.finish_reason is not None
                delta = self._delta(turn.chat, state, c.text, finished)
                if delta.reasoning_content:
                    for event in items.reasoning_text(delta.reasoning_content):
                        yield event
                if delta.content:
                    text_parts.append(delta.content)
                    for event in items.text(delta.content):
                        yield event
                for frag in delta.tool_calls or []:
                    for event in items.call_fragment(frag):
                        yield event
                if finished:
                    finish_reason = c.finish_reason
        except Exception as e:
            err = as_openai_error(e).response().error.model_dump()
            yield events.emit("error", code=err["code"], message=err["message"], param=err["param"], error=err)
            yield SSE_DONE
            return
        for event in items.close():
            yield event
        calls = [item["call"] for item in items.calls.values()]
        message = ChatMessage(role="assistant", content="".join(text_parts) or None, tool_calls=calls)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        response = self._finish(turn, message, items.output, finish_reason,
                                _usage(len(ids), completion_tokens, cached))
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield events.emit(kind, response=response)
        yield SSE_DONE


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": random_id("msg").replace("-", "_"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": random_id("fc").replace("-", "_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def _reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": random_id("rs").replace("-", "_"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _output_items(message: ChatMessage) -> list[dict[str, Any]]:
    items = [_reasoning_item(message.reasoning_content)] if message.reasoning_content else []
    if message.content:
        items.append(_message_item(message.content, "completed"))
    return items + [_call_item(call, "completed") for call in message.tool_calls]


class _EventWriter:
    """Responses stream events: `event: <type>` and a JSON `data` with a sequence number."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def emit(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {sse_data(json.dumps(payload, ensure_ascii=False))}\n\n"


class _StreamedItems:
    """The output items of a stream as they open, grow and close: a reasoning item, one
    message item (its output_text part streamed), then function_call items (their
    arguments streamed). An item opening closes the reasoning or text item before it."""

    def __init__(self, events: _EventWriter) -> None:
        self.events = events
        self.output: list[dict[str, Any]] = []
        self._reasoning: dict[str, Any] | None = None  # the open reasoning item
        self._text: dict[str, Any] | None = None  # the open message item
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item and call

    def reasoning_text(self, piece: str) -> list[str]:
        out = []
        if self._reasoning is None:
            item = {**_reasoning_item(""), "status": "in_progress"}
            self._reasoning = {"item": item, "index": len(self.output), "text": ""}
            self.output.append(item)
            out.append(self.events.emit("response.output_item.added", output_index=self._reasoning["index"],
                                        item=item))
        r = self._reasoning
        r["text"] += piece
        out.append(self.events.emit("response.reasoning_text.delta", item_id=r["item"]["id"],
                                    output_index=r["index"], content_index=0, delta=piece))
        return out

    def _close_reasoning(self) -> list[str]:
        if self._reasoning is None:
            return []
        r, self._reasoning = self._reasoning, None
        item = r["item"]
        item.update(status="completed", content=[{"type": "reasoning_text", "text": r["text"]}])
        return [
            self.events.emit("response.reasoning_text.done", item_id=item["id"], output_index=r["index"],
                             content_index=0, text=r["text"]),
            self.events.emit("response.output_item.done", output_index=r["index"], item=item),
        ]

    def text(self, piece: str) -> list[str]:
        out = self._close_reasoning()
        if self._text is None:
            item = _message_item("", "in_progress")
            self._text = {"item": item, "index": len(self.output), "text": ""}
            self.output.append(item)
            out.append(self.events.emit("response.output_item.added", output_index=self._text["index"], item=item))
            out.append(self.events.emit("response.content_part.added", item_id=item["id"],
                                        output_index=self._text["index"], content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": []}))
        self._text["text"] += piece
        out.append(self.events.emit("response.output_text.delta", item_id=self._text["item"]["id"],
                                    output_index=self._text["index"], content_index=0, delta=piece,
                                    logprobs=[]))
        return out

    def _close_text(self) -> list[str]:
        if self._text is None:
            return []
        t, self._text = self._text, None
        item, text = t["item"], t["text"]
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item.update(status="completed", content=[part])
        return [
            self.events.emit("response.output_text.done", item_id=item["id"], output_index=t["index"],
                             content_index=0, text=text, logprobs=[]),
            self.events.emit("response.content_part.done", item_id=item["id"], output_index=t["index"],
                             content_index=0, part=part),
            self.events.emit("response.output_item.done", output_index=t["index"], item=item),
        ]

    def call_fragment(self, frag: dict[str, Any]) -> list[str]:
        out = []
        index = frag["index"]
        piece = frag["function"].get("arguments") or ""
        if index not in self.calls:
            out += self._close_reasoning() + self._close_text()
            call = {"id": frag["id"], "type": "function",
                    "function": {"name": frag["function"]["name"], "arguments": ""}}
            item = {**_call_item(call, "in_progress"), "arguments": ""}
            self.calls[index] = {"item": item, "call": call, "index": len(self.output)}
            self.output.append(item)
            out.append(self.events.emit("response.output_item.added", output_index=len(self.output) - 1,
                                        item=item))
        entry = self.calls[index]
        if piece:
            entry["call"]["function"]["arguments"] += piece
            entry["item"]["arguments"] += piece
            out.append(self.events.emit("response.function_call_arguments.delta", item_id=entry["item"]["id"],
                                        output_index=entry["index"], delta=piece))
        return out

    def close(self) -> list[str]:
        out = self._close_reasoning() + self._close_text()
        for entry in self.calls.values():
            item = entry["item"]
            item["status"] = "completed"
            out.append(self.events.emit("response.function_call_arguments.done", item_id=item["id"],
                                        output_index=entry["index"], arguments=item["arguments"]))
            out.append(self.events.emit("response.output_item.done", output_index=entry["index"], item=item))
        return out
