"""Draft-model proposals (vLLM's method "draft_model"): a second, smaller model of the
target's vocabulary decodes each speculating request's next k tokens greedily; the target
verifies them in its next step as it verifies n-gram proposals.

In: before each schedule(), the requests that may propose (their token ids so far and k).
Out: up to k token ids per request. Owns the draft model, its own paged KV cache (as many
blocks as the target's, counted in the same memory budget, see EngineCore) and, per
request, which of its tokens that cache holds. Knows no scheduling: a request whose
proposals were rejected is seen to have other tokens than the draft ran, and the draft
computes again from the first that differs (its KV past there is no longer read).

Greedy drafts make each proposal a function of the context alone, so the rejection sampler
treats it as a one-hot draft distribution (vLLM's draft_sample_method "greedy"): keep the
target's sample where it equals the proposal, else take the sample and stop. The kept
tokens follow the target's distribution exactly (see sample/rejection_sampler.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.attention import get_attn_backend
from pagellm.attention.backend import (
    AttentionGroups,
    CommonAttentionMetadata,
    cache_torch_dtype,
    model_layer_windows,
    set_forward_context,
)
from pagellm.config import EngineConfig, ModelConfig, q8_kv_cache_refusal
from pagellm.logger import init_logger
from pagellm.spec_decode import MAX_STEP_ROWS
from pagellm.utils import cdiv

logger = init_logger(__name__)


@dataclass(slots=True)
class DraftRequest:
    """One request to draft for: its tokens so far (prompt, then output; the last one has
    no KV in the target yet) and how many tokens to propose after them."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_tokens: int  # how many to propose (>= 1)


@dataclass
class _DraftState:
    """What the draft's cache holds for one request: the KV of `fed` (its first len(fed)
    tokens, positions 0 .. len(fed) - 1), in `blocks` (position p in blocks[p // block_size])."""

    fed: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    confirmed: int = 0
    """fed[:confirmed] were the request's own tokens when run (not proposals): a request's
    tokens only grow, so they still are, and only the rest is compared again."""


@dataclass
class _Run:
    """One request during one propose() call: its tokens with the proposals so far."""

    req: DraftRequest
    state: _DraftState
    tokens: list[int]
    proposals: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        self.model_config: ModelConfig = spec.draft_model_config
        self.device = torch.device(config.device_config.device)
        self.block_size = config.cache_config.block_size
        cache_dtype = config.cache_config.cache_dtype
        if cache_dtype == "q8_0" and q8_kv_cache_refusal(self.model_config, config.device_config.device,
                                                         self.block_size):
            cache_dtype = "float16"  # the target's q8_0 cache cannot serve the draft's heads
        self.kv_dtype: torch.dtype = cache_torch_dtype(cache_dtype)
        self.attn_backend = get_attn_backend(config.attention_config.backend)
        self.max_chunk = config.scheduler_config.max_num_batched_tokens
        """Most tokens of one request run in one draft forward (a long prompt goes in chunks)."""
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._states: dict[str, _DraftState] = {}
        self._free_blocks: list[int] = []
        self.num_forwards = 0
        """Draft forwards run since start (tests and benchmarks read it)."""

    # -- start-up ------------------------------------------------------------------------

    def load_model(self) -> None:
        from pagellm.model_executor.loader import get_model, weights_summary

        start = time.perf_counter()
        self.model = get_model(self.model_config, self.device, self.attn_backend)
        self.model.eval()
        self.attn_groups = AttentionGroups(self.attn_backend, self.block_size, self.device,
                                           model_layer_windows(self.model))
        logger.info("Loaded draft model %s (%s, weights %s) in %.2f s", self.model_config.model,
                    self.model_config.architecture, weights_summary(self.model), time.perf_counter() - start)

    def kv_bytes_per_block(self) -> int:
        m = self.model_config
        return m.num_layers * self.attn_backend.kv_cache_block_bytes(
            self.block_size, m.num_kv_heads, m.head_dim, self.kv_dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """As many blocks as the target's pool (block 0 the padding target of block
        tables, zeroed now; the others zeroed when first handed out, see _take_blocks)."""
        m = self.model_config
        self.kv_caches = [
            self.attn_backend.allocate_kv_cache(num_blocks, self.block_size, m.num_kv_heads, m.head_dim,
                                                self.kv_dtype, self.device)
            for _ in range(m.num_layers)
        ]
        self._zeroed = np.zeros(num_blocks, dtype=bool)
        self._zero([0])
        self._free_blocks = list(range(num_blocks - 1, 0, -1))  # popped from the end: 1, 2, ...
        self.num_blocks = num_blocks
        logger.info("Draft KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * self.kv_bytes_per_block() / (1 << 20))

    # -- requests ------------------------------------------------------------------------

    def keep_only(self, req_ids: set[str]) -> None:
        """Frees the cache of every request not in req_ids (finished, aborted, preempted:
        a preempted request drafts from its first token again when it runs again)."""
        for req_id in [r for r in self._states if r not in req_ids]:
            self._free_blocks.extend(reversed(self._states.pop(req_id).blocks))

    @property
    def num_used_blocks(self) -> int:
        return sum(len(s.blocks) for s in self._states.values())

    # -- proposing -----------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """1. each request's cache rolled back to the first token it differs in (rejected
        proposals) and blocks taken for what it will write; 2. forwards until each has its
        k proposals: per request, its tokens not yet in the cache (a prompt chunk, or the
        generated tokens after it, then each proposal), the argmax at the last row when that
        row is its last token. A request short of blocks proposes nothing this step."""
        started = [run for run in map(self._begin, requests) if run is not None]
        runs = started
        while runs:
            self._forward(runs)
            runs = [run for run in runs if len(run.proposals) < run.req.num_tokens]
        return {run.req.req_id: run.proposals for run in started}

    def _begin(self, req: DraftRequest) -> _Run | None:
        n = len(req.token_ids)
        # A draft of a shorter context than the target's drafts within it (positions up to
        # n + k - 2 are run, the last proposal's is n + k - 1).
        req.num_tokens = min(req.num_tokens, self.model_config.max_model_len - n)
        if req.num_tokens < 1:
            return None
        state = self._states.setdefault(req.req_id, _DraftState())
        # Keep the tokens the cache holds that are still the request's, but not the last
        # one: its row gives the first proposal.
        sure = state.confirmed
        keep = min(sure + _common_prefix(state.fed[sure:], req.token_ids[sure:]), n - 1)
        del state.fed[keep:]
        state.confirmed = min(sure, keep)
        # Positions 0 .. n + k - 2 get written (the last proposal is never run).
        if not self._take_blocks(state, cdiv(n + req.num_tokens - 1, self.block_size)):
            return None
        return _Run(req, state, list(req.token_ids))

    def _take_blocks(self, state: _DraftState, needed: int) -> bool:
        more = needed - len(state.blocks)
        if more <= 0:
            return True
        if more > len(self._free_blocks):
            return False
        new = [self._free_blocks.pop() for _ in range(more)]
        self._zero(new)
        state.blocks.extend(new)
        return True

    def _zero(self, block_ids: list[int]) -> None:
        """Zeroes blocks never handed out before: attention reads a block's padded slots
        under a mask, and 0 times uninitialised NaN is NaN."""
        ids = np.asarray(block_ids, dtype=np.int64)
        ids = ids[~self._zeroed[ids]]
        if len(ids) == 0:
            return
        self._zeroed[ids] = True
        index = torch.from_numpy(ids).to(self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_fill_(0, index, 0.0)
            v_cache.index_fill_(0, index, 0.0)

    def _forward(self, runs: list[_Run]) -> None:
        """One draft forward over every run's next tokens.

        Run r's cache holds c = len(fed) tokens; it runs tokens[c : e], positions c .. e-1:
            e = the end of its prompt (or c + max_chunk) while c is in the prompt: prompt rows;
            e = len(tokens) after it: generated rows, each attending as a one-token decode
                (as the target ran them), so the draft's numbers match its own decodes.
        A run samples at its last row when e = len(tokens).
        """
        chunks: list[tuple[int, int]] = []
        for run in runs:
            c, p, n = len(run.state.fed), run.req.num_prompt_tokens, len(run.tokens)
            chunks.append((c, min(p if c < p else n, n, c + self.max_chunk)))
        num_sched = np.array([e - c for c, e in chunks], dtype=np.int64)
        cu = np.zeros(len(runs) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        positions = np.concatenate([np.arange(c, e) for c, e in chunks])
        input_ids = np.concatenate([np.asarray(run.tokens[c:e], dtype=np.int64) for run, (c, e) in zip(runs, chunks)])
        seq_lens = np.array([e for _, e in chunks], dtype=np.int64)
        max_blocks = int(cdiv(int(seq_lens.max()), self.block_size))
        table = np.zeros((len(runs), max_blocks), dtype=np.int64)
        for i, run in enumerate(runs):
            blocks = run.state.blocks[:max_blocks]
            table[i, : len(blocks)] = blocks
        req_idx = np.repeat(np.arange(len(runs)), num_sched)
        bs = self.block_size
        slot_mapping = table[req_idx, positions // bs] * bs + positions % bs
        generated = [i for i, (run, (c, _)) in enumerate(zip(runs, chunks)) if c >= run.req.num_prompt_tokens]
        dev = self.device
        common = CommonAttentionMetadata(
            num_reqs=len(runs),
            num_actual_tokens=int(cu[-1]),
            query_start_loc=torch.from_numpy(cu).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_table=torch.from_numpy(table).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
            verify_reqs=frozenset(i for i in generated if num_sched[i] > 1),
        )
        attn_metadata, by_window = self.attn_groups.build(common)
        with set_forward_context(attn_metadata, self.kv_caches, _rows(cu, generated), by_window):
            hidden = self.model(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev))
        self.num_forwards += 1
        for run, (c, e) in zip(runs, chunks):
            run.state.fed.extend(run.tokens[c:e])
            if c == run.state.confirmed:
                run.state.confirmed = min(e, len(run.req.token_ids))
        sampling = [i for i, (run, (_, e)) in enumerate(zip(runs, chunks)) if e == len(run.tokens)]
        if not sampling:
            return
        last_rows = torch.from_numpy(cu[1:][sampling] - 1).to(dev)
        # the head in calls of at most 16 rows, as the target's verify takes it
        picked = [t for part in hidden[last_rows].split(MAX_STEP_ROWS)
                  for t in self.model.compute_logits(part).argmax(dim=-1).tolist()]
        for i, token in zip(sampling, picked):
            runs[i].proposals.append(token)
            runs[i].tokens.append(token)


def _rows(cu: np.ndarray, reqs: list[int]) -> slice | torch.Tensor:
    """The flattened rows of the given requests (ascending): a slice where contiguous."""
    if not reqs:
        return slice(0, 0)
    picked = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in reqs])
    if picked[-1] - picked[0] == len(picked) - 1:
        return slice(int(picked[0]), int(picked[-1]) + 1)
    return torch.from_numpy(picked)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
