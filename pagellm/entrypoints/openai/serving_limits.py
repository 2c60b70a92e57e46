"""Per-request caps of the OpenAI server: ServingLimits (one `pagellm serve` flag per
field) checked on a parsed request before it is admitted, and RequestBodyLimit, the ASGI
middleware that refuses a body over its cap before it is buffered.

Requests in, a 400 naming the field (or a 413) out; the engine is never consulted here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from http import HTTPStatus
from typing import Any

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# serving_engine (OpenAIError) is imported where an error is raised: it loads the engine,
# and `pagellm serve --help` builds its flags from this module.


@dataclass(frozen=True)
class ServingLimits:
    """What one request may ask of the server. The logprobs cap is the engine's
    (`--max-logprobs`, ModelConfig.max_logprobs), so `LLM` refuses the same requests."""

    max_n: int = 128
    """Most completions one prompt may ask for (`n`)."""
    max_prompts_per_request: int = 1024
    """Most prompts in one /v1/completions request (`prompt` given as a list)."""
    max_stop_strings: int = 64
    """Most stop strings in one request (`stop`)."""
    max_stop_string_length: int = 1024
    """Longest stop string, in characters (each one is matched against the text every step)."""
    max_request_body_bytes: int = 32 * 1024**2
    """Largest request body in bytes (k, m, g suffixes: 32m); a larger one gets 413 without being read to its end."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        from pagellm.engine.arg_utils import get_attr_docs

        docs = get_attr_docs(cls)
        group = parser.add_argument_group("per-request limits")
        for f in fields(cls):
            group.add_argument("--" + f.name.replace("_", "-"), type=_positive_size, default=f.default,
                               help=docs[f.name])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServingLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def check(self, request: Any, max_logprobs: int) -> None:
        """Raises OpenAIError (400, `param` set) for the first cap the request exceeds;
        `max_logprobs` is the engine's cap with -1 already resolved to the vocabulary."""
        _at_most("n", request.n, self.max_n, "--max-n")
        prompt = getattr(request, "prompt", None)  # completions: a list of prompts, or of token ids
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            _at_most("prompt", len(prompt), self.max_prompts_per_request, "--max-prompts-per-request",
                     what="prompts")
        # completions' logprobs is a count; chat's is a flag, and top_logprobs the count
        for name in ("logprobs", "top_logprobs"):
            value = getattr(request, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                _at_most(name, value, max_logprobs, "--max-logprobs")
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        _at_most("stop", len(stop), self.max_stop_strings, "--max-stop-strings", what="stop strings")
        for i, s in enumerate(stop):
            if len(s) > self.max_stop_string_length:
                raise _bad_request(
                    f"stop[{i}] is {len(s)} characters long; this server takes stop strings of at most "
                    f"{self.max_stop_string_length} characters (--max-stop-string-length).", "stop")


def _at_most(param: str, value: int, cap: int, flag: str, what: str | None = None) -> None:
    if value <= cap:
        return
    if what is None:
        message = f"{param} must be at most {cap} on this server ({flag}), got {value}."
    else:
        message = f"{param} holds {value} {what}; this server takes at most {cap} ({flag})."
    raise _bad_request(message, param)


def _bad_request(message: str, param: str) -> Exception:
    from pagellm.entrypoints.openai.serving_engine import OpenAIError

    return OpenAIError(message, param=param)


def _positive_size(text: str) -> int:
    scale = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(text[-1:].lower(), 1)
    try:
        value = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


_DRAIN_FACTOR = 4
"""A sized body up to this many times the cap is read and dropped before the 413."""


class RequestBodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 in OpenAI's error shape.
    A Content-Length over the cap is answered without keeping any of the body; a body
    without one (chunked) is counted as it arrives, and the read stops at the first chunk
    past the cap, so no more than the cap plus one chunk is ever buffered."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return (f"The request body is larger than this server's limit of {self.max_bytes} bytes "
                "(--max-request-body-bytes).")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            from pagellm.entrypoints.openai.serving_engine import OpenAIError

            error = OpenAIError(self._message(), HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            response = JSONResponse(error.response().model_dump(), status_code=int(error.status),
                                    headers={"Connection": "close"})
            if int(length) <= _DRAIN_FACTOR * self.max_bytes:
                # Read (and drop) a body that is not far over: closing with unread bytes
                # makes the kernel reset the connection, and the client may lose the 413.
                while (await receive()).get("more_body"):
                    pass
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException raised while it reads the body on to
                    # the app's handler, which answers in OpenAI's error shape.
                    raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._message())
            return message

        await self.app(scope, limited_receive, send)
