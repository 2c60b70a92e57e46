"""`pagellm serve [MODEL]`: the OpenAI-compatible server (flags generated from EngineArgs)."""

from __future__ import annotations

import argparse
from typing import Any

from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.openai.serving_limits import ServingLimits


def _non_negative(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    return parse


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="Start the OpenAI-compatible HTTP server.")
    p.add_argument("model_tag", nargs="?", default=None, help="Model to serve (default: SmolLM2-135M-Instruct).")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    p.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    p.add_argument("--api-key", default=None, help="Require this key as 'Authorization: Bearer KEY'.")
    p.add_argument("--chat-template", default=None, help="Chat template (file path or Jinja text).")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="Let requests bring their own chat template (chat_template, or "
                        "chat_template_kwargs.chat_template); refused with 400 otherwise, since "
                        "the server runs it. It renders in a bounded sandbox: no Python internals, "
                        "1 MiB of output (plus twice the conversation), 1 s.")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Accepted for vLLM scripts: tool_choice 'auto' (OpenAI's default with tools) "
                        "works without it, in the format the chat template teaches (hermes, "
                        "llama3_json, mistral, pythonic), or, for a template without one, with the generic "
                        "tool prompt and the reply held to text or tool calls.")
    p.add_argument("--tool-call-parser", default=None,
                   help="How the model writes tool calls, instead of the format read from the chat "
                        "template: hermes (<tool_call>{...}</tool_call>, also what the generic tool "
                        "prompt asks for), llama3_json, mistral or pythonic. The reply is then not held to a "
                        "grammar (vLLM's behaviour).")
    p.add_argument("--max-stored-responses", type=_non_negative(int), default=1000,
                   help="Responses kept in memory for GET /v1/responses/{id} and previous_response_id "
                        "(those created with store: true, OpenAI's default); past it the oldest is "
                        "dropped. 0 stores none.")
    p.add_argument("--disable-ui", action="store_true",
                   help="Serve the API only: no chat page at / and no dashboard at /dashboard.")
    p.add_argument("--max-num-queued-requests", type=_non_negative(int), default=None,
                   help="Requests (sequences) allowed to wait for a place in the running batch; past "
                        "it a new request gets 503 with Retry-After. Default: no limit (vLLM's behaviour).")
    p.add_argument("--shutdown-timeout", type=_non_negative(float), default=5.0,
                   help="On SIGTERM: seconds in-flight responses may take to finish before they are "
                        "aborted (new connections are refused at once).")
    p.add_argument("--metrics-require-api-key", action="store_true",
                   help="Guard /metrics with --api-key too (the API routes, /tokenize and /detokenize "
                        "always are).")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="Accepted for vLLM scripts; pagellm does not log individual requests.")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="Log level of uvicorn's own messages.")
    p.add_argument("--headless", action="store_true",
                   help="Run engine cores only, no server: ranks --data-parallel-start-rank onwards "
                        "(--data-parallel-size-local of them) connect to the head node's "
                        "--data-parallel-address and --data-parallel-rpc-port. Give the model flags "
                        "the head has: it refuses a core whose config differs.")
    ServingLimits.add_cli_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run, starts_engine=True)


def run(args: argparse.Namespace) -> int:
    from pagellm.entrypoints.openai.api_server import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit("Give the model either positionally or with --model, not both.")
        args.model = args.model_tag
    if args.headless:
        return _run_headless(args)
    if args.data_parallel_start_rank != 0:
        raise ValueError("--data-parallel-start-rank is for --headless nodes (the head runs ranks from 0); "
                         "add --headless.")
    return run_server(args)


def _run_headless(args: argparse.Namespace) -> int:
    from pagellm.distributed.headless import run_headless

    if args.data_parallel_address is None:
        raise ValueError("--headless needs --data-parallel-address: the head node's address, where its "
                         "engine cores connect.")
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.data_parallel_size_local == 0:
        raise ValueError("--headless with --data-parallel-size-local 0 would run no engine core.")
    return run_headless(engine_args.create_engine_config())
