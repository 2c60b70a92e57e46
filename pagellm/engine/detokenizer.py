"""Incremental detokenization and stop-string matching for one request.

In: the request's new token ids each step. Out: text deltas that never split a UTF-8
character, and the stop string that matched, if any. Knows nothing of engine or batching.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pagellm.core.protocol import EngineCoreRequest
from pagellm.outputs import Logprob, LogprobsLists, SampleLogprobs
from pagellm.sampling_params import ALL_LOGPROBS

try:  # tokenizers >= 0.21
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - old tokenizers: the slow path is used
    DecodeStream = None  # type: ignore[assignment,misc]
    Tokenizer = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

# Prompt tokens fed to the decoder before the first output token, so that the first
# output token is decoded in context (leading-space rules of some tokenizers).
_PROMPT_CONTEXT_MIN = 4
_PROMPT_CONTEXT_MAX = 16


class IncrementalDetokenizer:
    """Tracks output token ids without producing text (no tokenizer, or detokenize=False)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def output_text(self) -> str:
        return ""

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Appends new tokens; returns the stop string that matched, if any."""
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""

    @classmethod
    def from_new_request(cls, tokenizer: Any, request: EngineCoreRequest) -> IncrementalDetokenizer:
        if tokenizer is None or not request.sampling_params.detokenize:
            return IncrementalDetokenizer()
        backend = _fast_backend(tokenizer)
        if backend is not None:
            return FastIncrementalDetokenizer(backend, request)
        return SlowIncrementalDetokenizer(tokenizer, request)


def _fast_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer, if DecodeStream exists."""
    if DecodeStream is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    return backend if isinstance(backend, Tokenizer) else None


class BaseIncrementalDetokenizer(IncrementalDetokenizer):
    """Text accumulation, stop strings and streaming hold-back; subclasses decode tokens."""

    def __init__(self, request: EngineCoreRequest) -> None:
        super().__init__()
        params = request.sampling_params
        self.stop: list[str] = list(params.stop or [])
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        # While streaming, keep back enough characters to hide a partly matched stop string.
        self.stop_buffer_length = 0
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        self._output_text = ""
        self._last_output_text_offset = 0

    @property
    def output_text(self) -> str:
        return self._output_text

    def decode_next(self, token_id: int) -> str:
        """Text that token_id completes ("" while a multi-byte character is incomplete)."""
        raise NotImplementedError

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Decodes new tokens one at a time, checking stop strings after each.

        stop_terminated: the last token is EOS or a stop token id; its text is left out
        unless include_stop_str_in_output. On a stop-string match, tokens after the one
        that completed it are dropped and the text is cut at the stop string.
        """
        stop_token: int | None = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            *new_token_ids, stop_token = new_token_ids
        for token_id in new_token_ids:
            offset = len(self._output_text)
            self.token_ids.append(token_id)
            self._output_text += self.decode_next(token_id)
            stop_str = self._check_stop(len(self._output_text) - offset)
            if stop_str is not None:
                return stop_str
        if stop_token is not None:
            self.token_ids.append(stop_token)
        return None

    def _check_stop(self, new_char_count: int) -> str | None:
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        match = check_stop_strings(
            self._output_text, new_char_count, self.stop, self.include_stop_str_in_output
        )
        if match is None:
            return None
        stop_str, truncate_to = match
        if truncate_to != -1:
            self._output_text = self._output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """All text so far (delta=False) or the text since the last call (delta=True),
        minus the stop-string hold-back unless finished."""
        end = len(self._output_text)
        if not finished:
            end -= self.stop_buffer_length
        if not delta:
            return self._output_text[:end]
        start = self._last_output_text_offset
        if end <= start:
            return ""
        self._last_output_text_offset = end
        return self._output_text[start:end]


class FastIncrementalDetokenizer(BaseIncrementalDetokenizer):
    """Uses tokenizers' DecodeStream, which buffers incomplete UTF-8 sequences itself."""

    def __init__(self, backend: Any, request: EngineCoreRequest) -> None:
        super().__init__(request)
        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for token_id in self._prompt_context(request.prompt_token_ids):
            self._step(token_id)

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The shortest prompt suffix (of at least a few tokens) that decodes cleanly."""
        n = len(prompt_token_ids)
        for length in range(min(_PROMPT_CONTEXT_MIN, n), min(_PROMPT_CONTEXT_MAX, n) + 1):
            suffix = prompt_token_ids[n - length :]
            if "\ufffd" not in self.backend.decode(suffix, skip_special_tokens=False):
                return suffix
        return []

    def _step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.backend, token_id)
        except Exception as e:  # tokenizers rejects some byte prefixes; start over
            logger.warning("DecodeStream failed on token %d (%s); resetting it.", token_id, e)
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            try:
                return self.stream.step(self.backend, token_id)
            except Exception:
                return None

    def decode_next(self, token_id: int) -> str:
        return self._step(token_id) or ""


class SlowIncrementalDetokenizer(BaseIncrementalDetokenizer):
    """Prefix/read offsets over token strings, for tokenizers without DecodeStream.

    tokens: [ ...context... | prefix_offset ... read_offset | unread ]
    The text of tokens[prefix_offset:] minus that of tokens[prefix_offset:read_offset]
    is new, unless it ends in U+FFFD (an unfinished character): then wait for more.
    """

    def __init__(self, tokenizer: Any, request: EngineCoreRequest) -> None:
        super().__init__(request)
        self.tokenizer = tokenizer
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        context = request.prompt_token_ids[-_PROMPT_CONTEXT_MIN:]
        self.tokens: list[str] = list(tokenizer.convert_ids_to_tokens(context))
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def decode_next(self, token_id: int) -> str:
        if self.skip_special_tokens and token_id in self.special_ids:
            return ""
        self.tokens.append(self.tokenizer.convert_ids_to_tokens(token_id))
        to_string = self.tokenizer.convert_tokens_to_string
        prefix_text = to_string(self.tokens[self.prefix_offset : self.read_offset])
        full_text = to_string(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full_text[len(prefix_text) :]


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Finds the earliest stop string that ends inside the last new_char_count characters.

    Only the new text plus an overlap of len(stop) - 1 is searched. Returns the stop
    string and the length to cut the text to (-1: nothing to cut), or None.
    """
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        # A match must end after the old text, so it starts at or after this index.
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    truncate_to = index + len(stop_str) if include_stop_str_in_output else index
    return stop_str, (-1 if truncate_to >= len(output_text) else truncate_to)


def convert_logprobs(tokenizer: Any, logprobs: LogprobsLists, num_logprobs: int) -> SampleLogprobs:
    """One {token_id: Logprob} per position: the chosen token (with its rank) first, then
    the top num_logprobs (ALL_LOGPROBS: all given) ranked 1..k. Decoded text needs a tokenizer."""
    decode = _token_decoder(tokenizer)
    result: SampleLogprobs = []
    for ids, lps, rank in zip(logprobs.logprob_token_ids, logprobs.logprobs, logprobs.ranks):
        width = len(ids) if num_logprobs == ALL_LOGPROBS else min(len(ids), 1 + num_logprobs)
        position = {ids[0]: Logprob(lps[0], rank, decode(ids[0]))}
        for top_rank, (token_id, lp) in enumerate(zip(ids[1:width], lps[1:width]), start=1):
            if token_id not in position:
                position[token_id] = Logprob(lp, top_rank, decode(token_id))
        result.append(position)
    return result


def _token_decoder(tokenizer: Any) -> Callable[[int], str | None]:
    cache: dict[int, str | None] = {}

    def decode(token_id: int) -> str | None:
        if tokenizer is None:
            return None
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id])
        return cache[token_id]

    return decode
