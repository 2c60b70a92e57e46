"""Structured outputs on the engine-core side (vLLM's structured output manager).

The frontend validates a request's constraint and names the backend that accepted it
(`validate_structured_outputs`). Here, the manager compiles it in a thread pool off the
busy loop (the request waits in the scheduler until its grammar is ready), keeps one
matcher per request, fills the step's token bitmask for the constrained rows that sample,
and advances the matchers with the sampled tokens. The tokenizer and the grammar
libraries load at the first constrained request, not at start-up.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import msgspec

from pagellm.config import STRUCTURED_OUTPUTS_BACKENDS
from pagellm.logger import init_logger
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_types import (
    Grammar,
    StructuredOutputBackend,
    allocate_token_bitmask,
)

if TYPE_CHECKING:  # torch: the frontend imports this package to validate, without torch
    import torch

    from pagellm.config import EngineConfig
    from pagellm.core.request import Request

logger = init_logger(__name__)

_VALIDATED_CACHE_SIZE = 1024


def validate_structured_outputs(params: StructuredOutputsParams, backend: str = "auto") -> str:
    """Checks the constraint with the backend that will compile it and returns that
    backend's name. 'auto' takes xgrammar and falls back to guidance where xgrammar
    refuses (unless params.disable_fallback). ValueError names what is wrong.

    Constraints that passed are remembered (a server validates off its event loop first,
    so the engine's own check of the same request is a lookup)."""
    if params.backend is not None:
        backend = params.backend
    key = (backend, msgspec.json.encode(params))
    accepted = _validated.get(key)
    if accepted is None:
        accepted = _validate(params, backend)
        if len(_validated) >= _VALIDATED_CACHE_SIZE:
            _validated.pop(next(iter(_validated)))
        _validated[key] = accepted
    return accepted


_validated: dict[tuple[str, bytes], str] = {}


def check_json_schema(schema: Any) -> None:
    """ValueError unless `schema` is valid JSON Schema (the grammar backends accept some
    invalid ones, such as {"minimum": "zero"}, and would generate without the bound)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise ValueError(f"invalid JSON schema{path}: {e.message}") from None


def _validate(params: StructuredOutputsParams, backend: str) -> str:
    from pagellm.structured_output import backend_guidance, backend_xgrammar

    if params.kind == "json":
        try:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        except json.JSONDecodeError as e:
            raise ValueError(f"the schema is not valid JSON: {e}") from None
        check_json_schema(schema)
    if backend not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"structured outputs backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}; "
                         f"got {backend!r}.")
    if params.kind == "structural_tag":
        raise ValueError("structured_outputs.structural_tag is not supported by pagellm.")
    if backend == "guidance":
        backend_guidance.validate(params)
        return "guidance"
    try:
        backend_xgrammar.validate(params)
        return "xgrammar"
    except ValueError as xgr_error:
        if backend == "xgrammar" or params.disable_fallback:
            raise
        try:
            backend_guidance.validate(params)
        except ValueError:
            raise xgr_error from None
        return "guidance"


class StructuredOutputRequest:
    """A request's constraint and, once compiled, its matcher."""

    def __init__(self, params: StructuredOutputsParams, future: Future[Grammar]) -> None:
        self.params = params
        self.future = future
        self.grammar: Grammar | None = None
        self.error: str | None = None
        # With a reasoning parser, the grammar applies only after the reasoning ends.
        self.reasoning_ended = True

    def is_ready(self) -> bool:
        """True once compiling ended (successfully or not)."""
        if self.grammar is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            self.grammar = self.future.result()
        except Exception as e:  # the frontend validated it; report, do not crash the core
            self.error = f"{type(e).__name__}: {e}"
        return True


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, tokenizer_loader: Callable[[], Any],
                 max_workers: int = 1) -> None:
        self.model_config = config.model_config
        self._load_tokenizer = tokenizer_loader
        """Loads the model's tokenizer, once, when the first backend is built (the engine
        core's: a layer above this package)."""
        self.vocab_size = config.model_config.vocab_size
        self.reasoning_parser_name = config.structured_outputs_config.reasoning_parser
        self._reasoner: Any = None
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pagellm-grammar")
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._bitmask: torch.Tensor | None = None

    # -- compiling -----------------------------------------------------------------------

    def grammar_init(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        assert params is not None
        future = self._executor.submit(self._compile, params)
        request.structured_output_request = StructuredOutputRequest(params, future)
        if self.reasoning_parser_name:
            # Decided once the grammar is ready (the tokenizer is loaded by then).
            request.structured_output_request.reasoning_ended = False

    def _compile(self, params: StructuredOutputsParams) -> Grammar:
        return self._backend(params.backend or "xgrammar").compile(params)

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._lock:
            if name not in self._backends:
                self._backends[name] = self._load_backend(name)
            return self._backends[name]

    def _load_backend(self, name: str) -> StructuredOutputBackend:
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        eos, extra = self.model_config.eos_token_ids(self._tokenizer)
        stop_ids = ([eos] if eos is not None else []) + extra
        if name == "xgrammar":
            from pagellm.structured_output.backend_xgrammar import XgrammarBackend

            backend: StructuredOutputBackend = XgrammarBackend(self._tokenizer, self.vocab_size, stop_ids, max_threads=1)
        elif name == "guidance":
            from pagellm.structured_output.backend_guidance import GuidanceBackend

            backend = GuidanceBackend(self._tokenizer, self.vocab_size, stop_ids)
        else:
            raise ValueError(f"unknown structured outputs backend {name!r}")
        logger.info("Structured outputs: %s backend ready for a vocabulary of %d", name, self.vocab_size)
        return backend

    def wait_for_any(self, requests: list[Request], timeout: float) -> None:
        """Blocks up to `timeout` s until one of the requests' grammars is compiled (so an
        engine with nothing else to do does not spin while grammars compile)."""
        futures = [r.structured_output_request.future for r in requests if r.structured_output_request]
        if futures:
            wait_futures(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    # -- stepping ------------------------------------------------------------------------

    def should_constrain(self, request: Request) -> bool:
        """The grammar applies to the request's next token (its reasoning, if any, ended:
        the last reasoning end marker in prompt + output comes after the last start)."""
        so = request.structured_output_request
        if so is None or so.grammar is None:
            return False
        if not so.reasoning_ended:
            if self._reasoner is None:
                from pagellm.reasoning import get_reasoning_parser

                self._reasoner = get_reasoning_parser(self.reasoning_parser_name)(self._tokenizer)
            so.reasoning_ended = self._reasoner.is_reasoning_end(request.all_token_ids)
        return so.reasoning_ended

    def grammar_bitmask(self, requests: list[Request]) -> tuple[torch.Tensor | None, dict[str, int]]:
        """The bitmask rows of the requests that sample this step under a grammar, and
        the row of each (by request id)."""
        constrained = [r for r in requests if self.should_constrain(r)]
        if not constrained:
            return None, {}
        if self._bitmask is None or self._bitmask.shape[0] < len(constrained):
            self._bitmask = allocate_token_bitmask(max(len(constrained), 8), self.vocab_size)
        bitmask = self._bitmask[: len(constrained)]
        rows = {}
        for i, request in enumerate(constrained):
            grammar = request.structured_output_request.grammar  # type: ignore[union-attr]
            grammar.fill_bitmask(bitmask, i)
            rows[request.request_id] = i
        return bitmask.clone(), rows

    def accept_token(self, request: Request, token_id: int) -> bool:
        """Advances the request's matcher over a sampled token if the grammar applies to
        it; False when the grammar refuses it."""
        so = request.structured_output_request
        if so is None or so.grammar is None or not so.reasoning_ended:
            return True
        return so.grammar.accept_tokens([token_id])

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
