"""ModelRunner: turns a SchedulerOutput into one model forward and sampled tokens.

In: the scheduler's per-step diffs. Out: ModelRunnerOutput (sampled ids, logprobs).
Owns the model, the paged KV cache tensors and the persistent InputBatch; knows no
scheduling policy.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention import get_attn_backend
from pagellm.attention.backend import (
    AttentionBackend,
    AttentionGroups,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    cache_torch_dtype,
    model_layer_windows,
    set_forward_context,
)
from pagellm.config import EngineConfig
from pagellm.logger import init_logger
from pagellm.model_executor.layers.pooler import Pooler
from pagellm.model_executor.parallel_state import SINGLE, TensorParallelGroup, building_with
from pagellm.outputs import LogprobsLists, ModelRunnerOutput
from pagellm.platforms import platform_of
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.rejection_sampler import accepted_tokens
from pagellm.sample.sampler import Sampler, compute_prompt_logprobs
from pagellm.sampling_params import ALL_LOGPROBS
from pagellm.scheduler_output import SchedulerOutput
from pagellm.spec_decode import MAX_STEP_ROWS
from pagellm.utils import PROGRESS, cdiv
from pagellm.worker.huge_pages import KVHugePages
from pagellm.worker.input_batch import NO_LOGPROBS, CachedRequestState, InputBatch

logger = init_logger(__name__)

@functools.cache
def _pause_progress_while_compiling() -> None:
    """torch.compile builds the model's code inside the first steps that meet a new shape
    (minutes for a large model), when no layer runs to count: PROGRESS is paused
    meanwhile, so the frontend's watchdog does not take a compile for a hang."""
    from torch._dynamo.callback import callback_handler

    def start(*_: object) -> None:
        PROGRESS.paused += 1

    def end(*_: object) -> None:
        PROGRESS.paused -= 1

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TensorParallelGroup = SINGLE):
        self.config = config
        self.tp = tp
        """The tensor-parallel group whose shard of the model this runner holds (SINGLE: the
        whole model); every rank runs the same calls on the same scheduler outputs."""
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.device = torch.device(config.device_config.device)
        self.platform = platform_of(self.device)
        self.dtype = self.model_config.torch_dtype
        self.kv_dtype: torch.dtype = cache_torch_dtype(self.cache_config.cache_dtype)
        self.block_size = self.cache_config.block_size
        self.attn_backend: type[AttentionBackend] = get_attn_backend(config.attention_config.backend)
        """The attention backend: the model's layers make its impl, this runner its KV cache."""
        self.max_model_len = self.model_config.max_model_len
        self.sampler = Sampler()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.input_batch: InputBatch | None = None
        self.model: torch.nn.Module | None = None
        self._forward = None
        # What outlives a preemption (the batch row does not), kept until the request
        # finishes: its seeded generator, so a resumed request samples on from where it
        # was, and how far its prompt logprobs were sent, so recomputing the prompt does
        # not send them twice.
        self._parked_generators: dict[str, torch.Generator] = {}
        self._prompt_logprobs_end: dict[str, int] = {}
        pooler_config = self.model_config.pooler_config
        self.pooler: Pooler | None = None
        """Pools the prompts of pooling requests (a pooling engine only)."""
        if self.model_config.runner_type == "pooling":
            assert pooler_config is not None and pooler_config.pooling_type is not None
            self.pooler = Pooler(pooler_config.pooling_type)

    # -- start-up ------------------------------------------------------------------------

    def load_model(self) -> None:
        from pagellm.model_executor.loader import get_model, weights_summary

        start = time.perf_counter()
        with building_with(self.tp):
            self.model = get_model(self.model_config, self.device, self.attn_backend)
        self.model.eval()
        self._forward = self.model.forward
        if self.config.compilation_config.mode >= 1:
            _pause_progress_while_compiling()
            self._forward = torch.compile(
                self.model.forward, backend=self.config.compilation_config.backend, dynamic=True
            )
        self.attn_groups = AttentionGroups(self.attn_backend, self.block_size, self.device,
                                           model_layer_windows(self.model))
        """A metadata builder per distinct sliding window of the model's layers."""
        self.attn_builder: AttentionMetadataBuilder = self.attn_groups.primary
        logger.info(
            "Loaded %s (%s, %s activations, weights %s) on %s%s in %.2f s",
            self.model_config.model,
            self.model_config.architecture,
            str(self.dtype).removeprefix("torch."),
            weights_summary(self.model),
            self.device,
            f" (tensor parallel rank {self.tp.rank} of {self.tp.size})" if self.tp.size > 1 else "",
            time.perf_counter() - start,
        )

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank's cache holds (all of them on one rank)."""
        return self.model_config.num_kv_heads // self.tp.size

    def kv_bytes_per_block(self) -> int:
        m = self.model_config
        if m.is_encoder_only:
            return 0
        per_layer = self.attn_backend.kv_cache_block_bytes(self.block_size, self.num_kv_heads, m.head_dim,
                                                           self.kv_dtype)
        return m.num_layers * per_layer

    def determine_num_blocks(self, extra_bytes_per_block: int = 0) -> int:
        """Blocks of the KV cache: the override, else the memory budget over the bytes of a
        block (plus `extra_bytes_per_block`: a draft model's block, kept beside each)."""
        cc = self.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        # More blocks than max_num_seqs full-length sequences can never be used.
        useful = self.config.scheduler_config.max_num_seqs * cdiv(self.max_model_len, self.block_size) + 1
        if self.model_config.is_encoder_only:
            return useful  # blocks that only count tokens: no memory behind them
        budget = cc.kv_cache_memory_bytes
        if budget is None:
            budget = self.platform.kv_cache_budget(self.device, cc)
        # the budget is the machine's: a block's bytes on every tensor-parallel rank
        block_bytes = self.kv_bytes_per_block() * self.tp.size + extra_bytes_per_block
        num_blocks = min(budget // block_bytes, useful)
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds fewer than 2 blocks of "
                f"{block_bytes} bytes; raise kv_cache_memory_bytes."
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        m = self.model_config
        # Allocated lazily (torch.empty: no page is touched until used, so start-up does
        # not pay for gigabytes of zeros). Attention reads padded slots under a mask, and
        # a weight of 0 times uninitialised NaN is NaN, so every block is zeroed the first
        # time the scheduler hands it out (see _zero_blocks); block 0 is the padding
        # target of block tables and is zeroed now.
        # An encoder attends within each step's whole prompts and keeps no KV: its blocks
        # only count tokens for the scheduler.
        self.kv_caches = [] if m.is_encoder_only else [
            self.attn_backend.allocate_kv_cache(
                num_blocks, self.block_size, self.num_kv_heads, m.head_dim, self.kv_dtype, self.device
            )
            for _ in range(m.num_layers)
        ]
        self._block_zeroed = np.zeros(num_blocks, dtype=bool)
        self._huge_pages = None
        if self.platform.kv_in_host_memory and self.kv_caches:
            self._huge_pages = KVHugePages(
                [(t.data_ptr(), t.untyped_storage().nbytes()) for kv in self.kv_caches for t in kv],
                self.kv_caches[0][0].stride(0) * self.kv_caches[0][0].element_size(), num_blocks,
            )  # a block's pieces are the storage's units of one block stride (see huge_pages)
        self._zero_blocks([0])
        max_blocks = cdiv(self.max_model_len, self.block_size)
        self.input_batch = InputBatch(
            max_num_reqs=self.config.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            max_blocks_per_req=max_blocks,
            vocab_size=m.vocab_size,
        )
        if not self.kv_caches:
            logger.info("No KV cache (an encoder: whole prompts per step, so chunked prefill and prefix "
                        "caching are off): %d blocks of %d tokens count the scheduled tokens",
                        num_blocks, self.block_size)
            return
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens, %s)",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_bytes_per_block() / (1 << 20),
            num_blocks * self.block_size,
            self.cache_config.cache_dtype,
        )

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = self._prepare_inputs(sched)
        # an encoder attends within its own step and reads no attention metadata
        attn_metadata, by_window = self.attn_groups.build(inputs.common) if self.kv_caches else (None, None)
        with set_forward_context(attn_metadata, self.kv_caches, self._generated_rows(inputs),
                                 by_window):
            hidden = self._forward(inputs.input_ids, inputs.positions)
        return self._sample_and_collect(sched, inputs, hidden)

    def _zero_blocks(self, block_ids: list[int]) -> bool:
        """Zeroes the blocks never handed out before; whether there were any."""
        ids = np.asarray(block_ids, dtype=np.int64)
        ids = ids[~self._block_zeroed[ids]]
        if len(ids) == 0:
            return False
        self._block_zeroed[ids] = True
        index = torch.from_numpy(ids).to(self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_fill_(0, index, 0.0)
            v_cache.index_fill_(0, index, 0.0)
        return True

    def _update_states(self, sched: SchedulerOutput) -> None:
        batch = self.input_batch
        assert batch is not None
        new_blocks = [b for new in sched.scheduled_new_reqs for b in new.block_ids]
        new_blocks += [b for ids in sched.scheduled_cached_reqs.new_block_ids for b in ids]
        fresh = self._zero_blocks(new_blocks) if new_blocks else False
        if self._huge_pages is not None and (fresh or self._huge_pages.backlog):
            self._huge_pages.update(self._block_zeroed)
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            if self.pooler is not None:
                self.pooler.drop(req_id)
        # in sorted order, not the sets' (which follows each process's string hashing): the
        # freed rows are handed out again in the order they were freed, and every tensor-
        # parallel rank must put each request in the same row
        for req_id in sorted(sched.finished_req_ids):
            batch.remove_request(req_id)
            self._parked_generators.pop(req_id, None)
            self._prompt_logprobs_end.pop(req_id, None)
        for req_id in sorted(sched.preempted_req_ids):
            state = batch.states.get(req_id)
            if state is not None and state.generator is not None:
                self._parked_generators[req_id] = state.generator
            batch.remove_request(req_id)
        for new in sched.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # resumed after preemption: start afresh
            params = new.sampling_params
            generator = self._parked_generators.pop(new.req_id, None)
            if generator is None and params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=params,
                generator=generator,
                output_token_ids=list(new.output_token_ids),
            )
            batch.add_request(state, new.block_ids, new.num_computed_tokens)
            if new.pooling_params is not None:
                if self.pooler is None:
                    raise RuntimeError(f"request {new.req_id}: a pooling request on a generate engine")
                self.pooler.begin(new.req_id)
        cached = sched.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            batch.append_blocks(req_id, block_ids)
            # The scheduler owns the count; the runner advanced its copy as it ran the
            # tokens. Apart, one of them lost track of the KV cache's contents.
            mine = int(batch.num_computed_tokens[batch.req_id_to_index[req_id]])
            if mine != num_computed:
                raise RuntimeError(
                    f"request {req_id}: the scheduler counts {num_computed} computed tokens, "
                    f"the model runner {mine}"
                )

    def _generated_rows(self, inputs: _StepInputs) -> slice | torch.Tensor:
        """Rows of the step that read a generated token (one scheduled token at or past the
        request's prompt): the rows GGUF linears may multiply in int8
        (quantization.gguf.int8_rows). A prompt's last token read alone (after a prefix-
        cache hit, or a chunk boundary) is a prompt row, as it is when read with the rest."""
        batch = self.input_batch
        assert batch is not None
        generated = (inputs.num_sched == 1) & (
            inputs.positions_np[inputs.cu[:-1]] >= batch.num_prompt_tokens[inputs.rows])
        picked = inputs.cu[:-1][generated]
        if inputs.common.verify_reqs:  # and every row of a verify run
            runs = [np.arange(inputs.cu[i], inputs.cu[i + 1]) for i in inputs.common.verify_reqs]
            picked = np.sort(np.concatenate([picked, *runs]))
        if len(picked) == 0:
            return slice(0, 0)
        if picked[-1] - picked[0] == len(picked) - 1:
            return slice(int(picked[0]), int(picked[-1]) + 1)
        return torch.from_numpy(picked)

    def _prepare_inputs(self, sched: SchedulerOutput) -> _StepInputs:
        """Flattens the scheduled requests (in row order) into one token batch.

        For request r with c computed tokens and q scheduled ones, its tokens are
        positions c .. c+q-1; the token at position p lives in KV slot
            block_table[r, p // block_size] * block_size + p % block_size.
        """
        batch = self.input_batch
        assert batch is not None
        for req_id, drafts in sched.scheduled_spec_decode_tokens.items():
            # proposals run after the request's last token, as if it had them already
            row = batch.req_id_to_index[req_id]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n : n + len(drafts)] = drafts
        rows = np.array(sorted(batch.req_id_to_index[r] for r in sched.num_scheduled_tokens), dtype=np.int64)
        num_sched = np.array([sched.num_scheduled_tokens[batch.req_ids[r]] for r in rows], dtype=np.int64)
        computed = batch.num_computed_tokens[rows]
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        total = int(cu[-1])

        # Per token: its request's index in this batch and its position.
        req_idx = np.repeat(np.arange(len(rows)), num_sched)
        positions = computed[req_idx] + (np.arange(total) - cu[req_idx])
        token_rows = rows[req_idx]
        input_ids = batch.token_ids[token_rows, positions]
        block_ids = batch.block_table[token_rows, positions // self.block_size]
        slot_mapping = block_ids * self.block_size + positions % self.block_size

        seq_lens = computed + num_sched
        max_blocks = int(cdiv(seq_lens.max(), self.block_size))
        # A request samples only once its scheduled tokens reach the end of what it has
        # (mid-prompt chunks do not).
        sample_mask = seq_lens >= batch.num_tokens[rows]
        dev = self.device
        common = CommonAttentionMetadata(
            num_reqs=len(rows),
            num_actual_tokens=total,
            query_start_loc=torch.from_numpy(cu).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_table=torch.from_numpy(batch.block_table[rows, :max_blocks]).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
            verify_reqs=frozenset(i for i, r in enumerate(rows)
                                  if batch.req_ids[r] in sched.scheduled_spec_decode_tokens),
        )
        for r, n in zip(rows, num_sched):
            batch.num_computed_tokens[r] += n
        return _StepInputs(
            rows=rows,
            num_sched=num_sched,
            cu=cu,
            positions_np=positions,
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            common=common,
            sample_mask=sample_mask,
        )

    def _sample_and_collect(self, sched: SchedulerOutput, inputs: _StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        batch = self.input_batch
        assert batch is not None
        req_ids = [batch.req_ids[r] for r in inputs.rows]
        sampled: list[list[int]] = [[] for _ in req_ids]
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)  # type: ignore[arg-type]

        self._collect_prompt_logprobs(inputs, hidden, req_ids, out)
        sample_mask = inputs.sample_mask
        if self.pooler is not None:
            sample_mask = sample_mask & ~self._pool(inputs, hidden, req_ids, out)
        due = np.nonzero(sample_mask)[0]
        if len(due) == 0:
            return out
        due_rows = inputs.rows[due]
        spec = sched.scheduled_spec_decode_tokens
        drafts = [spec.get(req_ids[i], ()) for i in due] if spec else [()] * len(due)
        # Each due request samples at its last row, and a request verifying proposals at
        # every row it ran: row j picks the token after its first j proposals.
        counts = np.array([1 + len(d) for d in drafts], dtype=np.int64)
        ends = inputs.cu[due + 1]
        logit_idx = np.concatenate([np.arange(e - c, e) for e, c in zip(ends, counts)]) if spec else ends - 1
        logits = self._logits(hidden[torch.from_numpy(logit_idx).to(self.device)], bool(spec))
        metadata = batch.make_sampling_metadata(
            np.repeat(due_rows, counts), self.device,
            [list(d[:j]) for d in drafts for j in range(1 + len(d))] if spec else None)
        if sched.grammar_bitmask is not None:
            self._attach_bitmask(sched, [req_ids[i] for i, c in zip(due, counts) for _ in range(c)], metadata)
        result = self.sampler.forward(logits, metadata)
        token_ids = result.sampled_token_ids.tolist()
        no_token = result.no_token.tolist() if result.no_token is not None else None
        lp_lists = result.logprobs.tolists() if result.logprobs is not None else None
        start = 0
        for i, row, proposed, count in zip(due, due_rows, drafts, counts):
            picked = token_ids[start : start + count]
            kept = accepted_tokens(proposed, picked)
            if no_token is not None and any(no_token[start : start + len(kept)]):
                # Nothing was left to sample at this position: keep the tokens before it.
                kept = kept[: no_token[start : start + len(kept)].index(True)]
                out.no_token_req_ids.add(req_ids[i])
            sampled[i] = kept
            for tok in kept:
                batch.append_token(row, tok)
            batch.num_computed_tokens[row] -= count - len(kept)  # rejected proposals' KV
            k = batch.num_logprobs[row]
            if lp_lists is not None and k != NO_LOGPROBS:
                lp_rows = range(start, start + len(kept))
                width = [len(lp_lists.logprob_token_ids[j]) if k == ALL_LOGPROBS else 1 + k for j in lp_rows]
                out.logprobs[req_ids[i]] = LogprobsLists(
                    [lp_lists.logprob_token_ids[j][:n] for j, n in zip(lp_rows, width)],
                    [lp_lists.logprobs[j][:n] for j, n in zip(lp_rows, width)],
                    [lp_lists.ranks[j] for j in lp_rows],
                )
            start += count
        return out

    def _logits(self, hidden: torch.Tensor, verifying: bool) -> torch.Tensor:
        """The logits of the sampled rows. A step that verifies proposals takes them in
        calls of MAX_STEP_ROWS rows: its proposals may have pushed the count past what the
        head multiplies in one kind of kernel (quantization.gguf.Q8_MAX_ROWS), and each row
        must get the logits it would get without them."""
        if not verifying or hidden.shape[0] <= MAX_STEP_ROWS:
            return self.model.compute_logits(hidden)
        return torch.cat([self.model.compute_logits(part) for part in hidden.split(MAX_STEP_ROWS)])

    @staticmethod
    def _attach_bitmask(sched: SchedulerOutput, sampling_ids: list[str], metadata: SamplingMetadata) -> None:
        """Hands the sampler the grammar rows of this step's constrained requests, each
        matched to its logits row."""
        logits_rows, mask_rows = [], []
        for j, req_id in enumerate(sampling_ids):
            row = sched.structured_output_request_ids.get(req_id)
            if row is not None:
                logits_rows.append(j)
                mask_rows.append(row)
        if logits_rows:
            assert sched.grammar_bitmask is not None
            metadata.token_bitmask = sched.grammar_bitmask[mask_rows]
            metadata.token_bitmask_rows = logits_rows

    def _pool(self, inputs: _StepInputs, hidden: torch.Tensor, req_ids: list, out: ModelRunnerOutput) -> np.ndarray:
        """Hands each pooling request's chunk to the pooler; a request whose prompt ends
        this step gets its pooled vector in out.pooler_output. Returns the mask of the
        step's pooling requests (they sample nothing)."""
        pooler = self.pooler
        assert pooler is not None
        pooling = np.array([req_id in pooler for req_id in req_ids], dtype=bool)
        for i in np.nonzero(pooling)[0]:
            start, end = int(inputs.cu[i]), int(inputs.cu[i + 1])
            pooled = pooler.add_chunk(req_ids[i], hidden[start:end], int(inputs.positions_np[start]),
                                      bool(inputs.sample_mask[i]))
            if pooled is not None:
                out.pooler_output[req_ids[i]] = pooled.cpu().numpy().tobytes()
        return pooling

    def _collect_prompt_logprobs(self, inputs: _StepInputs, hidden: torch.Tensor, req_ids: list, out: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens for requests that asked: the hidden state at
        position p scores prompt token p + 1, so a chunk covering [c, c+q) yields rows
        for p in [c, min(c+q, prompt_len - 1))."""
        batch = self.input_batch
        assert batch is not None
        for i, row in enumerate(inputs.rows):
            params = batch.states[req_ids[i]].sampling_params
            if params.prompt_logprobs is None:
                continue
            chunk_start = int(inputs.positions_np[inputs.cu[i]])
            # after a preemption the prompt is computed again: skip what was sent
            start = max(chunk_start, self._prompt_logprobs_end.get(req_ids[i], 0))
            end = min(chunk_start + int(inputs.num_sched[i]), int(batch.num_prompt_tokens[row]) - 1)
            if end <= start:
                continue
            self._prompt_logprobs_end[req_ids[i]] = end
            first = int(inputs.cu[i]) + start - chunk_start
            h = hidden[first : first + (end - start)]
            targets = torch.from_numpy(batch.token_ids[row, start + 1 : end + 1].copy()).to(self.device)
            k = params.prompt_logprobs if params.prompt_logprobs >= 0 else self.model_config.vocab_size
            logits = self.model.compute_logits(h)
            out.prompt_logprobs[req_ids[i]] = compute_prompt_logprobs(logits, targets, k).tolists()


@dataclass(slots=True)
class _StepInputs:
    rows: np.ndarray  # input-batch rows of the scheduled requests, ascending
    num_sched: np.ndarray  # tokens scheduled per request
    cu: np.ndarray  # [num_reqs + 1] start offset of each request in the flat batch
    positions_np: np.ndarray  # [T] position of each flat token
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    common: CommonAttentionMetadata
    sample_mask: np.ndarray  # [num_reqs] True where a token is sampled this step
