"""Scheduler: decides, each step, which requests run how many tokens under one token budget.

In: requests (add / abort) and the runner's sampled tokens. Out: a SchedulerOutput per
step and EngineCoreOutputs per client. Knows no tensors, no sockets, no tokenizer.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagellm.core.kv_cache.kv_cache_manager import KVCacheManager
from pagellm.core.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
)
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.request_queue import create_request_queue
from pagellm.logger import init_logger
from pagellm.outputs import ModelRunnerOutput
from pagellm.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from pagellm.spec_decode import MAX_STEP_ROWS, NgramProposer

if TYPE_CHECKING:
    from pagellm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
    from pagellm.structured_output import StructuredOutputManager

logger = init_logger(__name__)


@dataclass
class _SpecStats:
    """Speculative decoding since the last stats: vLLM's spec_decode counters."""

    num_drafts: int = 0  # verify runs (requests that proposed tokens in a step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at position i

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


@dataclass
class _StepPlan:
    """What the current schedule() call has decided so far."""

    token_budget: int
    # req_id -> tokens to run this step, for every scheduled request.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Scheduled from `running` (the runner holds their rows) and their new block ids.
    running_reqs: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Admitted from `waiting` this step (first time, or resumed after preemption).
    new_reqs: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Proposed tokens scheduled after a decode's last token, by request.
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Most tokens each decoding request may propose this step (0: none).
    spec_share: int = 0


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        log_stats: bool = True,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set before building a Scheduler")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.log_stats = log_stats
        self.structured_output_manager = structured_output_manager
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.policy = scheduler_config.policy
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_gpu_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            max_model_len=self.max_model_len,
        )

        # Every unfinished request is in `requests` and in exactly one of `waiting`
        # (WAITING / PREEMPTED, holding no blocks), `running` (RUNNING, holding blocks) or
        # `waiting_for_grammar` (WAITING_FOR_FSM: its grammar compiles, no blocks).
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.waiting_for_grammar: list[Request] = []
        # Finished or aborted since the last schedule(): the runner drops their rows.
        self.finished_req_ids: set[str] = set()
        # Finished or aborted since the last update_from_output(), by client (DP balancer).
        self._finished_by_client: dict[int, set[str]] = defaultdict(set)
        # Finished without running in a step (prompt over max_model_len, or more KV than
        # the whole pool); their outputs go out with the next update_from_output().
        self._finished_outside_step: list[Request] = []
        self._num_preemptions_since_stats = 0
        self.num_preemptions_total = 0
        self.speculative_config = speculative_config
        self.proposer: NgramProposer | None = None
        if speculative_config is not None and speculative_config.method == "ngram":
            self.proposer = NgramProposer(*speculative_config.lookup_range)
        self._draft_token_ids: dict[str, list[int]] = {}
        """A draft model's proposals for the next schedule() (update_draft_token_ids)."""
        self._spec_stats = _SpecStats()
        self._spec_k: dict[str, int] = {}
        """Proposal length each speculating request gets next (see _adapt_spec_k)."""
        self.spec_totals = _SpecStats()
        """Speculative decoding since start (the stats carry the counts since the last)."""

    # -- requests in and out -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.num_tokens > self.max_model_len:
            # The KV of such a prompt cannot be held; finish it without running it.
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            self._finished_outside_step.append(request)
            return
        self.requests[request.request_id] = request
        self._record_event(request, EngineCoreEventType.QUEUED)
        so = request.structured_output_request
        if so is not None and not so.is_ready():
            request.status = RequestStatus.WAITING_FOR_FSM
            self.waiting_for_grammar.append(request)
            return
        self.waiting.add_request(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finishes requests from outside the step (aborts). Unknown ids are ignored; the
        requests emit nothing more, even if a step that includes them is in flight."""
        assert RequestStatus.is_finished(finished_status), finished_status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        from_running: set[str] = set()
        from_waiting: list[Request] = []
        from_grammar: set[str] = set()
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                from_running.add(req_id)
            elif request.status == RequestStatus.WAITING_FOR_FSM:
                from_grammar.add(req_id)
            else:
                from_waiting.append(request)
            request.status = finished_status
            self._free_request(request)
        if from_running:
            self.running = [r for r in self.running if r.request_id not in from_running]
        if from_waiting:
            self.waiting.remove_requests(from_waiting)
        if from_grammar:
            self.waiting_for_grammar = [r for r in self.waiting_for_grammar if r.request_id not in from_grammar]

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._spec_k.pop(request.request_id, None)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        self._finished_by_client[request.client_index].add(request.request_id)

    # -- schedule ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """1. running requests, preempting when blocks run out; 2. waiting requests, only
        if nothing was preempted; 3. advance num_computed_tokens and build the output."""
        if self.waiting_for_grammar:
            self._admit_compiled_grammars()
        plan = _StepPlan(token_budget=self.max_num_batched_tokens, spec_share=self._spec_share())
        self._schedule_running(plan)
        self._draft_token_ids = {}
        if not plan.preempted:
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar finished compiling join `waiting` (in arrival order);
        one whose grammar failed to compile finishes with an error."""
        still: list[Request] = []
        for request in self.waiting_for_grammar:
            so = request.structured_output_request
            assert so is not None
            if not so.is_ready():
                still.append(request)
            elif so.error is not None:
                logger.error("Request %s: its grammar did not compile (%s)", request.request_id, so.error)
                request.status = RequestStatus.FINISHED_ERROR
                self._free_request(request)
                self._finished_outside_step.append(request)
            else:
                request.status = RequestStatus.WAITING
                self.waiting.add_request(request)
        self.waiting_for_grammar = still

    def _schedule_running(self, plan: _StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.token_budget > 0:
            request = self.running[i]
            # Tokens whose KV is not yet computed: the rest of the prompt (chunked
            # prefill) or the last sampled token (decode).
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.token_budget)
            if num_new <= 0:
                i += 1
                continue
            drafts = self._propose(request, plan) if num_new == 1 and plan.spec_share else []
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new + len(drafts))
            if new_block_ids is None and drafts:  # proposals never preempt anyone
                drafts = []
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_block_ids is None:
                if len(self.running) == 1:  # alone and still short of blocks
                    self.running.pop()
                    self._finish_unservable(request)
                    return
                victim_index = self._pick_victim_index()
                victim = self.running.pop(victim_index)
                self._preempt(victim, plan)
                if victim is request:
                    return  # it was the lowest priority itself; the rest wait
                if victim_index < i:
                    i -= 1  # a victim before us shifted our position
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            plan.running_reqs.append(request)
            plan.new_block_ids[request.request_id] = new_block_ids
            if drafts:
                plan.spec_tokens[request.request_id] = drafts
                num_new += len(drafts)
            plan.num_scheduled_tokens[request.request_id] = num_new
            plan.token_budget -= num_new
            i += 1

    def _adapt_spec_k(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """A request's next proposal length follows its last verify run: one more after a
        run the model took whole, one past what it took otherwise. A verify row costs a
        fraction of a decode step (0.15-0.5 of one on 2 cores: the int8 kernels' work grows
        with the rows), so proposals that keep failing must shrink to pay."""
        spec = self.speculative_config
        assert spec is not None and spec.num_speculative_tokens is not None
        grown = num_drafted + 1 if num_accepted == num_drafted else num_accepted + 1
        self._spec_k[req_id] = min(spec.num_speculative_tokens, grown)

    def _spec_share(self) -> int:
        """Most tokens each decoding request may propose this step: the step's decode
        rows and proposals together within MAX_STEP_ROWS, shared evenly."""
        spec = self.speculative_config
        if spec is None or not self.running:
            return 0
        if spec.disable_by_batch_size is not None and len(self.running) >= spec.disable_by_batch_size:
            return 0
        decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        if decodes == 0:
            return 0
        assert spec.num_speculative_tokens is not None
        return min(spec.num_speculative_tokens, (MAX_STEP_ROWS - decodes) // decodes)

    def _propose(self, request: Request, plan: _StepPlan) -> list[int]:
        """Tokens to verify after the request's last generated one (n-gram lookup, or the
        draft model's from update_draft_token_ids), within the step's budget."""
        limit = min(self._proposal_limit(request, plan.spec_share), plan.token_budget - 1)
        if limit <= 0:
            return []
        if self.proposer is None:  # a draft model proposed before this schedule()
            return self._draft_token_ids.get(request.request_id, [])[:limit]
        return self.proposer.propose(request.all_token_ids, limit)

    def _proposal_limit(self, request: Request, spec_share: int) -> int:
        """Most tokens the request may propose this step: none for a structured output (its
        grammar is not advanced over proposals) or a request still in its prompt, and never
        past its proposal length, max_tokens or the context."""
        if (request.structured_output_request is not None or not spec_share
                or request.num_computed_tokens < request.num_prompt_tokens
                or request.num_tokens - request.num_computed_tokens != 1):
            return 0  # (the last token of a prompt runs as a prompt row, alone)
        return min(spec_share, self._spec_k.get(request.request_id, spec_share),
                   request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens)

    def draft_requests(self) -> list[tuple[Request, int]]:
        """For a draft model, before schedule(): each running request that will decode in
        the next step and may propose, with how many tokens (its limit before the step's
        token budget, which schedule() applies). The engine core drafts them and hands the
        tokens back through update_draft_token_ids."""
        share = self._spec_share()
        wanted = [(r, self._proposal_limit(r, share)) for r in self.running] if share else []
        return [(r, k) for r, k in wanted if k > 0]

    def running_req_ids(self) -> set[str]:
        return {r.request_id for r in self.running}

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """The draft model's proposals for the next schedule() (vLLM's name); each is
        used once, in that step."""
        self._draft_token_ids = draft_token_ids

    def _pick_victim_index(self) -> int:
        """FCFS: the newest running request. Priority: the largest (priority, arrival)."""
        if self.policy == "priority":
            return max(
                range(len(self.running)),
                key=lambda j: (self.running[j].priority, self.running[j].arrival_time),
            )
        return len(self.running) - 1

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Preemption by recompute: drop all KV, go back to the front of `waiting`."""
        granted = plan.num_scheduled_tokens.pop(request.request_id, None)
        if granted is not None:
            # Already scheduled earlier in this step (priority policy): undo that.
            plan.token_budget += granted
            plan.running_reqs.remove(request)
            del plan.new_block_ids[request.request_id]
            plan.spec_tokens.pop(request.request_id, None)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions_since_stats += 1
        self.num_preemptions_total += 1
        self._record_event(request, EngineCoreEventType.PREEMPTED)
        self.waiting.prepend_request(request)
        plan.preempted.append(request)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek_request()
            # Waiting requests hold no blocks and have num_computed_tokens == 0, so the
            # prefix-cache lookup always applies.
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > plan.token_budget:
                if not self.enable_chunked_prefill:
                    break  # the whole prompt must run at once; wait for a later step
                num_new = plan.token_budget
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, num_hit_tokens, hit_blocks
            )
            if new_block_ids is None:
                if not self.running:  # the whole pool is free and still too small
                    self.waiting.pop_request()
                    self._finish_unservable(request)
                    continue
                break  # no preemption on behalf of waiting requests
            self.waiting.pop_request()
            self._admit(request, num_hit_tokens, num_new, plan)

    def _finish_unservable(self, request: Request) -> None:
        """A request that needs more KV than the whole pool would wait (or preempt
        itself) forever; it ends as if it had reached the context limit."""
        logger.warning(
            "Request %s needs more KV blocks than the pool holds (%d); finishing it.",
            request.request_id,
            self.kv_cache_manager.block_pool.num_usable_blocks,
        )
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self._free_request(request)
        self._finished_outside_step.append(request)

    def _admit(self, request: Request, num_hit_tokens: int, num_new: int, plan: _StepPlan) -> None:
        self.running.append(request)
        if request.num_cached_tokens < 0:  # first scheduling only
            request.num_cached_tokens = num_hit_tokens
            self.kv_cache_manager.record_prefix_lookup(request, num_hit_tokens)
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        self._record_event(request, EngineCoreEventType.SCHEDULED)
        plan.new_reqs.append(request)
        plan.num_scheduled_tokens[request.request_id] = num_new
        plan.token_budget -= num_new

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        new_reqs_data = [
            NewRequestData(
                req_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=list(req.output_token_ids),
                sampling_params=req.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
                num_computed_tokens=req.num_computed_tokens,
                pooling_params=req.pooling_params,
            )
            for req in plan.new_reqs
        ]
        cached = CachedRequestData()
        for req in plan.running_reqs:
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append(plan.new_block_ids[req.request_id])
            cached.num_computed_tokens.append(req.num_computed_tokens)
        # Advance now (not on the runner's reply), so num_computed_tokens counts the KV
        # written by the step in flight; update_from_output relies on this.
        for req_id, num in plan.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in plan.preempted},
            scheduled_spec_decode_tokens=plan.spec_tokens,
        )
        if self.structured_output_manager is not None:
            # Rows for the constrained requests that sample this step (their last prompt
            # chunk or a decode); a step without any pays nothing more than this pass.
            constrained = [
                r for r in (self.requests[req_id] for req_id in plan.num_scheduled_tokens)
                if r.structured_output_request is not None and r.num_computed_tokens >= r.num_tokens
            ]
            if constrained:
                output.grammar_bitmask, output.structured_output_request_ids = (
                    self.structured_output_manager.grammar_bitmask(constrained)
                )
        self.finished_req_ids = set()
        return output

    # -- update from the runner --------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """1. append sampled tokens and check stops; 2. free finished requests;
        3. group outputs by client, with finished ids and scheduler stats."""
        row = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        stopped: set[str] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted while the step was in flight: emit nothing
            sampled: list[int] = []
            # num_computed_tokens was advanced at schedule time; below num_tokens means
            # a prefill chunk that is not the last, which samples nothing.
            if req_id in row and request.num_computed_tokens >= request.num_tokens:
                sampled = model_runner_output.sampled_token_ids[row[req_id]]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            no_token = req_id in model_runner_output.no_token_req_ids  # it finishes below
            if drafts and sampled and not no_token:
                # The runner kept the proposals the model agreed with and one token of its
                # own after them; the KV of the rejected ones is no longer the request's.
                num_accepted = len(sampled) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self._spec_stats.record(len(drafts), num_accepted)
                self._adapt_spec_k(request.request_id, len(drafts), num_accepted)
                self.spec_totals.record(len(drafts), num_accepted)
            new_token_ids = self._append_and_check_stop(request, sampled)
            if no_token and not request.is_finished():
                logger.warning("Request %s: its constraints (grammar, allowed_token_ids, bad_words, "
                               "min_tokens) leave no token to sample; finishing it.", req_id)
                request.status = RequestStatus.FINISHED_ERROR
            if req_id in model_runner_output.pooler_output:  # a pooling request is done
                request.status = RequestStatus.FINISHED_STOPPED
            if request.is_finished():
                stopped.add(req_id)
            out = self._make_output(request, new_token_ids, model_runner_output)
            if out is not None:
                outputs[request.client_index].append(out)

        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
            for req_id in stopped:
                self._free_request(self.requests[req_id])
        for request in self._finished_outside_step:
            out = self._make_output(request, [], None)
            assert out is not None  # finished requests always report
            outputs[request.client_index].append(out)
            self._finished_by_client[request.client_index].add(request.request_id)
        self._finished_outside_step = []
        return self._group_outputs(outputs)

    def _append_and_check_stop(self, request: Request, sampled: list[int]) -> list[int]:
        """Appends tokens one by one; stops at the first one that finishes the request."""
        appended: list[int] = []
        for token_id in sampled:
            request.append_output_token_ids(token_id)
            appended.append(token_id)
            if self._check_stop(request) or self._advance_grammar(request, token_id):
                break
        return appended

    def _advance_grammar(self, request: Request, token_id: int) -> bool:
        """Moves the request's matcher over the token; True if that finished the request
        (the constraint ended with a stop token, or the token broke it)."""
        so = request.structured_output_request
        if so is None or self.structured_output_manager is None:
            return False
        if not self.structured_output_manager.accept_token(request, token_id):
            logger.warning("Request %s: token %d is not allowed by its grammar; finishing it.",
                           request.request_id, token_id)
            request.status = RequestStatus.FINISHED_ERROR
            return True
        # A grammar that ends with a stop token ends the request even where the stop token
        # alone would not (ignore_eos, min_tokens). One that completes on an ordinary token
        # (guidance stops there) lets the next step sample the stop token it then allows.
        is_stop_token = token_id == request.eos_token_id or token_id in request.sampling_params.all_stop_token_ids
        if so.grammar is not None and so.reasoning_ended and is_stop_token and so.grammar.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _check_stop(self, request: Request) -> bool:
        """Sets the finished status (and stop_reason) if the last token ends the request.
        Stop tokens count only from min_tokens on; the length limits always apply."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.all_stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _make_output(
        self,
        request: Request,
        new_token_ids: list[int],
        runner_output: ModelRunnerOutput | None,
    ) -> EngineCoreOutput | None:
        """The request's output for this step, or None when it has nothing to say."""
        logprobs = prompt_logprobs = None
        if runner_output is not None:
            logprobs = runner_output.logprobs.get(request.request_id)
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
        if logprobs is not None:
            # Rows after a stop token were sampled but not kept.
            logprobs = logprobs.first(len(new_token_ids)) if new_token_ids else None
        pooled = runner_output.pooler_output.get(request.request_id) if runner_output else None
        finished = request.is_finished()
        if not new_token_ids and not finished and prompt_logprobs is None:
            return None
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            events=request.take_events(),
            num_cached_tokens=max(request.num_cached_tokens, 0),
            pooling_output=pooled,
        )

    def _group_outputs(
        self, outputs: dict[int, list[EngineCoreOutput]]
    ) -> dict[int, EngineCoreOutputs]:
        result = {ci: EngineCoreOutputs(outputs=outs) for ci, outs in outputs.items()}
        for ci, req_ids in self._finished_by_client.items():
            result.setdefault(ci, EngineCoreOutputs(outputs=[])).finished_requests = sorted(req_ids)
        self._finished_by_client.clear()
        if self.log_stats:
            # Stats go to one client only (the lowest index), so no counter is doubled.
            target = min(result) if result else 0
            result.setdefault(target, EngineCoreOutputs(outputs=[]))
            result[target].scheduler_stats = self.make_stats()
        return result

    # -- queries and maintenance -------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_grammar)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        """True while a step is needed: unfinished work, or finished requests that the
        runner or the clients have not heard of yet."""
        return self.has_unfinished_requests() or bool(
            self.finished_req_ids or self._finished_outside_step
        )

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting); waiting counts requests whose grammar compiles."""
        return len(self.running), len(self.waiting) + len(self.waiting_for_grammar)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        """Current gauges, plus prefix-cache lookups and preemptions since the last call."""
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_grammar),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self._num_preemptions_since_stats,
            num_free_blocks=self.kv_cache_manager.get_num_free_blocks(),
            num_total_blocks=self.kv_cache_manager.block_pool.num_usable_blocks,
            spec_num_drafts=self._spec_stats.num_drafts,
            spec_num_draft_tokens=self._spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self._spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=self._spec_stats.accepted_per_pos,
        )
        self._spec_stats = _SpecStats()
        self._num_preemptions_since_stats = 0
        return stats

    def _record_event(self, request: Request, event_type: EngineCoreEventType) -> None:
        if self.log_stats:
            request.record_event(event_type, time.monotonic())

    def check_invariants(self) -> None:
        """KV-manager invariants, plus queue membership, statuses and block coverage."""
        kv = self.kv_cache_manager
        kv.check_invariants()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting] + [r.request_id for r in self.waiting_for_grammar]
        assert len(set(running_ids)) == len(running_ids), f"running has duplicates: {running_ids}"
        assert len(set(waiting_ids)) == len(waiting_ids), f"waiting has duplicates: {waiting_ids}"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert set(running_ids) | set(waiting_ids) == set(self.requests), (
            "requests must be exactly running + waiting"
        )
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} > max_num_seqs"
        assert set(kv.req_to_blocks) <= set(running_ids), "a non-running request holds blocks"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, r
            assert r.num_computed_tokens <= r.num_tokens <= self.max_model_len, r
            # Blocks cover every token whose KV is computed or being computed.
            num_blocks = len(kv.req_to_blocks.get(r.request_id, []))
            assert num_blocks * self.block_size >= r.num_computed_tokens, (
                f"{r} holds {num_blocks} blocks"
            )
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
            assert r.num_computed_tokens == 0, r
        for r in self.waiting_for_grammar:
            assert r.status == RequestStatus.WAITING_FOR_FSM, r
            assert r.num_computed_tokens == 0, r
