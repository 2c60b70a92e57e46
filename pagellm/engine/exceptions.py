"""Errors the frontend raises to callers of LLM / AsyncLLM when the engine fails.

EngineDeadError: the engine-core process died and the engine cannot recover.
EngineRestartingError: an engine-core process died and is being restarted
    (restart_engine_on_failure); its requests are lost, later ones may succeed.
EngineGenerateError: one generate() call failed; the engine itself is still fine.
EngineStartupError: the engine core did not start (its error is in the message).
StreamTooSlowError: a stream's consumer fell too far behind; the request was aborted.
"""

from __future__ import annotations


class EngineGenerateError(Exception):
    """A single request failed (bad input, or an error while it was being processed)."""


class EngineDeadError(Exception):
    """The engine core is gone; every in-flight and future request fails with this."""

    def __init__(self, *args: object, suppress_context: bool = False) -> None:
        if not args:
            args = ("EngineCore encountered an issue. See stack trace (above) for the root cause.",)
        super().__init__(*args)
        # Hide the chained ZMQ/IPC exception: it says nothing the message does not.
        self.__suppress_context__ = suppress_context


class EngineRestartingError(EngineDeadError):
    """An engine core died and a new one is starting: this request failed, a retry may not."""


class EngineStartupError(RuntimeError):
    """The engine-core process failed to start; the message carries its error."""


class StreamTooSlowError(Exception):
    """A streamed request's consumer (an HTTP client that stopped reading) left more than
    PAGELLM_STREAM_BUFFER_TOKENS tokens waiting: the request was aborted in the engine."""
