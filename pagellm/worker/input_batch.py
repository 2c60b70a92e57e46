"""InputBatch: the model runner's persistent per-request state, one row per request.

Rows live across steps; each step only applies the scheduler's diffs (rows added,
removed, blocks appended, tokens sampled), so host work is proportional to what changed.
Arrays are numpy on the host; the runner turns slices of them into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.sample.metadata import SamplingMetadata
from pagellm.sampling_params import ALL_LOGPROBS, SamplingParams, SamplingType

# num_logprobs of a row that asked for no logprobs (ALL_LOGPROBS, -1, is the vocabulary).
NO_LOGPROBS = -2


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.states: dict[str, CachedRequestState] = {}

        # Token ids of prompt + output per row; num_tokens[row] of them are valid.
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Block table: the first num_blocks[row] entries are the row's blocks.
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)

        # Sampling parameters per row.
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        self.greedy = np.zeros(max_num_reqs, dtype=bool)
        # Per row: NO_LOGPROBS, ALL_LOGPROBS or how many top logprobs it asked for.
        self.num_logprobs = np.full(max_num_reqs, NO_LOGPROBS, dtype=np.int64)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    # -- rows ------------------------------------------------------------------------

    def add_request(self, state: CachedRequestState, block_ids: list[int], num_computed: int) -> int:
        row = self._free_rows.pop()
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self.states[state.req_id] = state

        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        self.num_computed_tokens[row] = num_computed
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)

        p = state.sampling_params
        greedy = p.sampling_type == SamplingType.GREEDY
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k if p.top_k > 0 else 0
        self.min_p[row] = p.min_p
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.num_logprobs[row] = NO_LOGPROBS if p.logprobs is None else p.logprobs
        return row

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        self.req_ids[row] = None
        del self.states[req_id]
        self._free_rows.append(row)

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.req_id_to_index[req_id]
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
        self.states[self.req_ids[row]].output_token_ids.append(token_id)  # type: ignore[index]

    # -- sampling metadata -------------------------------------------------------------

    def make_sampling_metadata(self, rows: np.ndarray, device: torch.device,
                               proposed: list[list[int]] | None = None) -> SamplingMetadata:
        """SamplingMetadata for the given rows, in that order (the order of the logits).
        A row may repeat (a request verifying proposals): `proposed[i]` are the tokens
        that logits row i follows beyond its request's output (penalties, min_tokens and
        bad words see them); a seeded request's rows draw from its generator in turn."""
        greedy = self.greedy[rows]
        all_greedy = bool(greedy.all())
        states = [self.states[self.req_ids[r]] for r in rows]  # type: ignore[index]
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        outputs = [s.output_token_ids for s in states]
        if proposed is not None:
            outputs = [out + extra if extra else out for out, extra in zip(outputs, proposed)]

        def tensor(arr: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(arr[rows]).to(device)

        temperature = None if all_greedy else tensor(self.temperature)
        if temperature is not None:
            # Greedy rows in a mixed batch: the sampler takes argmax where temperature < eps.
            temperature[torch.from_numpy(greedy).to(device)] = 0.0
        top_p = tensor(self.top_p) if not all_greedy and (self.top_p[rows] < 1.0).any() else None
        top_k = tensor(self.top_k) if not all_greedy and (self.top_k[rows] > 0).any() else None
        min_p = tensor(self.min_p) if not all_greedy and (self.min_p[rows] > 0).any() else None
        no_penalties = not (
            (self.presence[rows] != 0).any()
            or (self.frequency[rows] != 0).any()
            or (self.repetition[rows] != 1).any()
        )
        num_logprobs = self.num_logprobs[rows]
        max_num_logprobs = None
        if (num_logprobs == ALL_LOGPROBS).any():  # one row wants the vocabulary: every row's k fits in it
            max_num_logprobs = self.vocab_size
        elif (num_logprobs != NO_LOGPROBS).any():
            max_num_logprobs = int(num_logprobs.max())
        prompt_ids = None
        if not no_penalties:
            max_prompt = int(self.num_prompt_tokens[rows].max())
            padded = np.full((len(rows), max_prompt), self.vocab_size, dtype=np.int64)
            for i, r in enumerate(rows):
                n = self.num_prompt_tokens[r]
                padded[i, :n] = self.token_ids[r, :n]
            prompt_ids = torch.from_numpy(padded).to(device)
        return SamplingMetadata(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=not greedy.any(),
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            generators=generators,
            max_num_logprobs=max_num_logprobs,
            no_penalties=no_penalties,
            presence_penalties=None if no_penalties else tensor(self.presence),
            frequency_penalties=None if no_penalties else tensor(self.frequency),
            repetition_penalties=None if no_penalties else tensor(self.repetition),
            prompt_token_ids=prompt_ids,
            output_token_ids=outputs,
            **self._sparse_constraints(states, outputs, device),
        )

    def _sparse_constraints(self, states: list[CachedRequestState], outputs: list[list[int]],
                            device: torch.device) -> dict:
        min_tokens: dict[int, tuple[int, set[int]]] = {}
        logit_bias: dict[int, dict[int, float]] = {}
        bad_words: dict[int, list[list[int]]] = {}
        allowed_rows: dict[int, list[int]] = {}
        for i, s in enumerate(states):
            p = s.sampling_params
            if p.min_tokens and len(outputs[i]) < p.min_tokens:
                stop_ids = set(p.all_stop_token_ids)
                if p.eos_token_id is not None:  # blocked even with ignore_eos, as in vLLM
                    stop_ids.add(p.eos_token_id)
                min_tokens[i] = (p.min_tokens, stop_ids)
            if p.logit_bias:
                logit_bias[i] = p.logit_bias
            if p.bad_words_token_ids:
                bad_words[i] = p.bad_words_token_ids
            if p.allowed_token_ids:
                allowed_rows[i] = p.allowed_token_ids
        mask = None
        if allowed_rows:
            mask = torch.zeros(len(states), self.vocab_size, dtype=torch.bool, device=device)
            for i, ids in allowed_rows.items():
                mask[i] = True
                mask[i, ids] = False
        return {
            "min_tokens": min_tokens,
            "logit_bias": logit_bias,
            "bad_words_token_ids": bad_words,
            "allowed_token_ids_mask": mask,
        }
