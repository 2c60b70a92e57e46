"""The OpenAI-compatible HTTP server: a FastAPI app holding one AsyncLLM.

`build_app(engine, ...)` wires the routes; `run_server(args)` builds the engine from CLI
args, runs uvicorn, logs throughput periodically and shuts the engine down on exit.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import signal
import socket
import weakref
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm import __version__, envs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.input_processor import generate_on_pooling
from pagellm.entrypoints.anthropic.protocol import MessagesRequest
from pagellm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagellm.entrypoints.chat_utils import apply_chat_template, load_chat_template
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from pagellm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagellm.entrypoints.openai.serving_engine import (
    Admission,
    OpenAIError,
    as_openai_error,
    engine_dead_error,
)
from pagellm.entrypoints.openai.serving_limits import RequestBodyLimit, ServingLimits
from pagellm.entrypoints.openai.serving_responses import (
    DEFAULT_MAX_STORED_RESPONSES,
    OpenAIServingResponses,
)
from pagellm.entrypoints.openai.serving_score import OpenAIServingScore
from pagellm.entrypoints.ui import mount_ui
from pagellm.logger import init_logger
from pagellm.metrics.loggers import LoggingStatLogger, PrometheusStatLogger

logger = init_logger(__name__)


def _error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.response().model_dump(), status_code=int(e.status), headers=e.headers)


_REQUEST_ID_CHARS = re.compile(r"[^A-Za-z0-9._:-]")
MAX_REQUEST_ID_LEN = 128


def request_id_header(request: Request) -> str | None:
    """X-Request-Id as vLLM honours it (the response echoes it, the request runs under
    it), limited to letters, digits and ._:- and to 128 characters."""
    raw = request.headers.get("x-request-id")
    if not raw:
        return None
    return _REQUEST_ID_CHARS.sub("", raw)[:MAX_REQUEST_ID_LEN] or None


def _num_sequences(request: Any) -> int:
    """Sequences a request puts in the engine: n per prompt."""
    prompt = getattr(request, "prompt", None)
    prompts = 1 if prompt is None or isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)
    return prompts * request.n


async def _released(stream: AsyncIterator[str], slot: Any) -> AsyncIterator[str]:
    try:
        async for chunk in stream:
            yield chunk
    finally:
        slot.release()


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|list|dict)$|[(\[]")
"""A pydantic location part naming the union member tried (`str`, `list[int]`), not a field."""


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(p for p in loc if not _UNION_MEMBER.search(p)) or None
    if err.get("type") == "json_invalid":
        return f"Invalid JSON in the request body: {err.get('msg')}", None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if param:
        got = repr(err.get("input"))
        if len(got) > 100:
            got = got[:100] + "..."
        return f"Invalid value for '{param}': {msg} (got {got}).", param
    return msg, None


async def _cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Runs a handler until it answers or the client goes away; a client that disconnects
    before a (non-streaming) answer cancels the handler, which aborts its requests and
    frees their KV blocks instead of generating for nobody."""
    handler = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not handler.done():
        handler.cancel()
        return Response(status_code=499)  # nobody reads it; uvicorn drops it
    return handler.result()


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              chat_template: str | None = None, metrics: PrometheusStatLogger | None = None,
              trust_request_chat_template: bool = False, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, enable_ui: bool = True,
              model_aliases: list[str] | None = None, max_num_queued_requests: int | None = None,
              metrics_require_api_key: bool = False, limits: ServingLimits | None = None,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> FastAPI:
    app = FastAPI(title="pagellm OpenAI-compatible server", version=__version__)
    completions = OpenAIServingCompletion(engine, served_model_names, chat_template, metrics,
                                          model_aliases=model_aliases)
    chat = OpenAIServingChat(engine, served_model_names, chat_template, metrics,
                             trust_request_chat_template=trust_request_chat_template,
                             tool_call_parser=tool_call_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                             reasoning_parser=engine.config.structured_outputs_config.reasoning_parser or None,
                             model_aliases=model_aliases)
    responses = OpenAIServingResponses(
        engine, served_model_names, chat_template, metrics, trust_request_chat_template=trust_request_chat_template,
        tool_call_parser=tool_call_parser, enable_auto_tool_choice=enable_auto_tool_choice,
        reasoning_parser=engine.config.structured_outputs_config.reasoning_parser or None,
        model_aliases=model_aliases, max_stored_responses=max_stored_responses)
    messages = AnthropicServingMessages(
        engine, served_model_names, chat_template, metrics, trust_request_chat_template=trust_request_chat_template,
        tool_call_parser=tool_call_parser, enable_auto_tool_choice=enable_auto_tool_choice,
        reasoning_parser=engine.config.structured_outputs_config.reasoning_parser or None,
        model_aliases=model_aliases)
    embeddings = OpenAIServingEmbedding(engine, served_model_names, model_aliases=model_aliases)
    scores = OpenAIServingScore(engine, served_model_names, model_aliases=model_aliases)
    generators = (completions, chat, responses, messages)
    pooling = engine.model_config.runner_type == "pooling"
    app.state.engine = engine
    app.state.tool_format = chat.tool_format().describe()
    sched = engine.config.scheduler_config
    admission = Admission(max_num_queued_requests,
                          sched.max_num_seqs * engine.config.parallel_config.data_parallel_size)
    # Every API route needs the key; /health, /version, /metrics (unless asked) and the
    # pages do not.
    guarded: tuple[str, ...] = ("/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank")
    guarded += ("/metrics",) if metrics_require_api_key else ()
    # Per-request caps (serving_limits.py); the logprobs cap is the engine's, -1 the vocabulary.
    limits = limits or ServingLimits()
    max_logprobs = engine.model_config.max_logprobs
    max_logprobs = engine.model_config.vocab_size if max_logprobs == -1 else max_logprobs
    app.add_middleware(RequestBodyLimit, max_bytes=limits.max_request_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(OpenAIError(message, param=param))

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # unknown routes, wrong methods, bodies that cannot be read: OpenAI's shape too
        message = str(exc.detail)
        if exc.status_code == HTTPStatus.NOT_FOUND and message == "Not Found":
            message = (f"Not Found: {request.method} {request.url.path} is not an endpoint of this server. "
                       f"Its API: {_endpoints(app)}.")
        return _error(OpenAIError(message, HTTPStatus(exc.status_code), headers=exc.headers))

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if api_key and (path.startswith("/v1") or path in guarded):
            given = request.headers.get("authorization", "")
            if not given and request.headers.get("x-api-key"):  # Anthropic's clients send the key so
                given = f"Bearer {request.headers['x-api-key']}"
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(OpenAIError("Invalid or missing API key.", HTTPStatus.UNAUTHORIZED,
                                          err_type="AuthenticationError"))
        response = await call_next(request)
        rid = request_id_header(request)
        if rid is not None:
            response.headers["X-Request-Id"] = rid
        return response

    async def respond(serving: Any, request: Any, raw: Request) -> Response:
        """Runs a handler under admission control; a stream becomes SSE, any failure
        OpenAI's error JSON."""
        if pooling and serving in generators:
            raise OpenAIError(generate_on_pooling(engine.model_config), param="model")
        limits.check(request, max_logprobs)  # before admission: a refused request holds no slot
        slot = admission.take(_num_sequences(request))
        try:
            result = await serving.create(request, request_id_header(raw))
        except Exception as e:
            slot.release()
            raise as_openai_error(e) from e
        if isinstance(result, AsyncIterator):
            stream = _released(result, slot)
            weakref.finalize(stream, slot.release)  # a stream never started still frees its slot
            return StreamingResponse(stream, media_type="text/event-stream")
        slot.release()
        return JSONResponse(result if isinstance(result, dict) else result.model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await _cancel_on_disconnect(raw, respond(completions, request, raw))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await _cancel_on_disconnect(raw, respond(chat, request, raw))

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw: Request) -> Response:
        return await _cancel_on_disconnect(raw, respond(responses, request, raw))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id))

    @app.post("/v1/messages")
    async def create_message(request: MessagesRequest, raw: Request) -> Response:
        return await _cancel_on_disconnect(raw, respond(messages, request, raw))

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw: Request) -> Response:
        return await _cancel_on_disconnect(raw, respond(embeddings, request, raw))

    # vLLM's scoring APIs: /score (pairs) and /rerank (Jina's and Cohere's), each also
    # under the versioned paths vLLM serves them at.
    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(request: ScoreRequest, raw: Request) -> Response:
        return await _cancel_on_disconnect(raw, respond(scores, request, raw))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(request: RerankRequest, raw: Request) -> Response:
        return await _cancel_on_disconnect(raw, respond(scores, request, raw))

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [ModelCard(id=name, root=engine.model_config.model, max_model_len=engine.model_config.max_model_len)
                 for name in served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return _error(engine_dead_error())
        restarting = engine.restarting_engines
        if not restarting:
            return Response(status_code=200)
        if len(restarting) == len(engine.engine_core.ranks):  # nothing serves
            return _error(OpenAIError(f"Engine core(s) {restarting} restarting after a failure.",
                                      HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "5"}))
        return JSONResponse({"status": "degraded", "restarting_engines": restarting})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        completions.check_model(request.model)
        tok = engine.tokenizer
        if request.messages is not None:
            try:
                text = apply_chat_template(tok, request.messages, chat_template, request.add_generation_prompt)
            except ValueError as e:
                raise OpenAIError(str(e), param="messages") from e
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.model_config.max_model_len, "tokens": ids}
        if request.return_token_strs:
            body["token_strs"] = tok.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        completions.check_model(request.model)
        completions.check_token_ids(request.tokens, "tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(request.tokens)})

    if enable_ui:  # the chat page at / and the dashboard at /dashboard
        mount_ui(app)
    return app


def _endpoints(app: FastAPI) -> str:
    """The API's routes (those of its OpenAPI schema), as 'POST /v1/completions, ...'."""
    return ", ".join(f"{method} {route.path}" for route in app.routes
                     if isinstance(route, APIRoute) and route.include_in_schema
                     for method in sorted(route.methods - {"HEAD"}))


async def _log_periodically(stat_logger: LoggingStatLogger, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        stat_logger.log()


def run_server(args: Any) -> int:
    import uvicorn

    from pagellm.engine.arg_utils import EngineArgs

    chat_template = load_chat_template(args.chat_template)
    _check_tool_flags(args)
    _check_server_envs()
    engine_args = EngineArgs.from_cli_args(args)
    _raise_open_file_limit()
    # The port is taken before the model loads: a port in use fails at once, not after
    # minutes of start-up.
    sock = _listen(args.host, args.port)
    try:
        config = engine_args.create_engine_config()
        model_names = config.model_config.served_names
        names = model_names.served
        num_engines = config.parallel_config.data_parallel_size
        # --disable-log-stats turns statistics off everywhere: no log line, no /metrics
        # series (the engine core stops counting, so gauges would only read stale zeros).
        prometheus = None if engine_args.disable_log_stats else PrometheusStatLogger(names[0], num_engines)
        log_logger = LoggingStatLogger(num_engines)
        loggers: list[Any] = [] if prometheus is None else [prometheus, log_logger]
        engine = AsyncLLM(config, log_stats=not engine_args.disable_log_stats, stat_loggers=loggers)
    except BaseException:
        sock.close()
        raise
    mc = engine.model_config
    logger.info("Model %s (%s), dtype %s, max_model_len %d, %d KV blocks of %d tokens, %d engine(s)",
                mc.model, mc.architecture, mc.dtype, mc.max_model_len,
                engine.config.cache_config.num_gpu_blocks, engine.config.cache_config.block_size, num_engines)
    _log_tokenizer_directory(engine)
    app = build_app(engine, names, args.api_key, chat_template, prometheus,
                    trust_request_chat_template=args.trust_request_chat_template,
                    tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                    enable_ui=not args.disable_ui, model_aliases=model_names.aliases,
                    max_num_queued_requests=args.max_num_queued_requests,
                    metrics_require_api_key=args.metrics_require_api_key,
                    limits=ServingLimits.from_cli_args(args), max_stored_responses=args.max_stored_responses)
    logger.info("Tool calls with tool_choice auto: %s", app.state.tool_format)

    server: Any = None
    exit_status = 0

    async def _exit_when_engine_dead() -> None:
        """Without --restart-engine-on-failure (or once restarts gave up) a dead engine
        ends the server with status 1, for a supervisor to restart it."""
        nonlocal exit_status
        while not engine.errored:
            await asyncio.sleep(0.1)
        logger.error("The engine core is dead (see the error above); exiting with status 1. Run the server "
                     "under a supervisor, or with --restart-engine-on-failure to restart the engine in place.")
        exit_status = 1
        if server is not None:
            server.should_exit = True

    @app.on_event("startup")
    async def _start_logging() -> None:
        engine.start()
        app.state.watchdog = asyncio.create_task(_exit_when_engine_dead())
        if prometheus is not None:
            app.state.log_task = asyncio.create_task(_log_periodically(log_logger, config.observability_config.log_stats_interval))
        logger.info("Serving %s at http://%s:%d/v1", names[0], args.host, args.port)
        if not args.disable_ui:
            logger.info("Chat page at http://%s:%d/ and engine dashboard at /dashboard", args.host, args.port)

    def on_stop(signum: int, frame: Any) -> None:
        # uvicorn stops serving on SIGTERM or Ctrl-C (a second Ctrl-C: at once) and then
        # raises the signal again once its own handler is gone; landing here (not in the
        # default handler, which kills the process) lets the engine shut down below.
        raise SystemExit(0)

    previous = {sig: signal.signal(sig, on_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # On SIGTERM uvicorn stops accepting, lets in-flight responses finish for
        # --shutdown-timeout seconds, then cancels them (which aborts their requests).
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.uvicorn_log_level,
                                               timeout_graceful_shutdown=args.shutdown_timeout,
                                               timeout_keep_alive=envs.PAGELLM_HTTP_TIMEOUT_KEEP_ALIVE))
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
        engine.shutdown()
    return exit_status


OPEN_FILES_WANTED = 65536
"""The open-file limit the server raises its own soft limit to (within the hard limit):
each connection is a file, and a soft limit of 1024, common, would refuse the 1000th
idle client's neighbour, /health included (vLLM raises it the same way)."""


def _raise_open_file_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(OPEN_FILES_WANTED, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            logger.warning("Could not raise the open-file limit from %d to %d (%s): at most ~%d "
                           "connections at once.", soft, want, e, soft)


def _log_tokenizer_directory(engine: AsyncLLM) -> None:
    """At every start: where the tokenizer loads from, for other tools' --tokenizer (a
    GGUF's converted vocabulary lives in a hashed cache directory)."""
    from pagellm.entrypoints.cli.tokenizer import tokenizer_directory

    mc = engine.model_config
    try:
        directory = tokenizer_directory(mc.model_path, mc.tokenizer, engine.tokenizer)
    except (ValueError, OSError) as e:
        logger.warning("Cannot tell the tokenizer's directory: %s", e)
        return
    logger.info("Tokenizer %s (for other tools' --tokenizer; `pagellm tokenizer MODEL` prints it)", directory)


def _check_tool_flags(args: Any) -> None:
    from pagellm.entrypoints.openai.tool_parsers import get_tool_parser

    # --enable-auto-tool-choice alone is vLLM's spelling of what pagellm always does.
    if args.tool_call_parser:
        get_tool_parser(args.tool_call_parser)  # ValueError naming the accepted parsers


def _check_server_envs() -> None:
    """The server's environment knobs, before the model loads (a ValueError names the bad one)."""
    for name in ("PAGELLM_HTTP_TIMEOUT_KEEP_ALIVE", "PAGELLM_HTTP_SEND_BUFFER_BYTES", "PAGELLM_STREAM_BUFFER_TOKENS"):
        if (value := getattr(envs, name)) < 0:
            raise ValueError(f"{name} must be >= 0, got {value}.")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if envs.PAGELLM_HTTP_SEND_BUFFER_BYTES > 0:
        # Connections inherit it: a client that stops reading fills this much kernel
        # buffer (Linux doubles it), then blocks its stream's writer, and the stream's
        # own bound (PAGELLM_STREAM_BUFFER_TOKENS) ends the request.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, envs.PAGELLM_HTTP_SEND_BUFFER_BYTES)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock
