"""V1 scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill and decode phases: every request is a number of tokens still to
compute, and a step hands out at most `max_num_batched_tokens` of them (a long prompt is
split across steps: chunked prefill). When KV blocks run out, the newest running request is
preempted (its KV freed, to be recomputed later) and goes back to the front of the queue.

LongRoPE (`long_rope_threshold`): a sequence longer than the threshold is rotated with the
long factors, every token of it, as transformers does. Whether a request is long is settled
each time it is scheduled from the waiting queue, by its length then (the workers decide the
same way, from the tokens they are sent); one that grows past the threshold while it runs is
preempted, to be computed again, long, as transformers recomputes it.

Async scheduling: `schedule()` for step N+1 may run before `update_from_output()` for step
N (at most one step in flight). A request's tokens are counted as
`num_tokens + num_output_placeholders`, the placeholders being tokens that scheduled steps
will sample, so the same code serves both orders.

Speculative decoding (speculator.py): a decoding request with draft tokens runs its last
token and the drafts in one step (`scheduled_spec_decode_tokens`), which returns the accepted
drafts and one more token; the rejected drafts' KV slots are taken back
(`num_computed_tokens`) and written over by the next step.

Outputs are returned grouped by client: `{client_id: [EngineCoreOutput, ...]}`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import msgspec

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine_core.kv_cache_manager import KVCacheManager, cdiv
from minivllm.engine_core.next_step import NextStep
from minivllm.engine_core.output_logprobs import OutputLogprobs, needs_prompt_logprobs
from minivllm.engine_core.request import FINISH_REASONS, Request, RequestStatus
from minivllm.engine_core.speculator import Speculator
from minivllm.protocol.messages import (
    EngineCoreEventType,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from minivllm.speculative_config import SpeculativeConfig

ClientOutputs = dict[int, list[EngineCoreOutput]]


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        *,
        sliding_window: int | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """`sliding_window`: set when every layer of the model attends over a window of at
        most that many tokens (`ModelConfig.kv_sliding_window`); blocks behind it are freed."""
        self.config = scheduler_config
        self.spec = None
        if speculative is not None:
            self.spec = Speculator(speculative, scheduler_config.long_rope_threshold)
        # KV slots past a step's tokens that the draft model writes while it proposes
        self.lookahead = 0 if speculative is None else speculative.num_lookahead_tokens
        self.block_size = bs = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, bs, cache_config.enable_prefix_caching, sliding_window
        )
        # a request alone always fits: its sequence never outgrows the whole cache, unless a
        # sliding window bounds the blocks it holds
        step_tokens = min(scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len)
        self.fits_any_length = self.kv_cache_manager.fits_any_length(step_tokens)
        self.max_len = scheduler_config.max_model_len
        if not self.fits_any_length:
            self.max_len = min(self.max_len, num_blocks * bs)
        self.requests: dict[str, Request] = {}  # unfinished ones
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # workers must forget these at the next step
        self.preempted_req_ids: set[str] = set()  # and these, preempted by this step
        self.step_id = 0
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.logprobs = OutputLogprobs()

    # ------------------------------------------------------------------ requests in and out

    def check_admission(self, request_id: str, n: int) -> None:
        """`ValueError` if a request with a prompt of `n` tokens can never be scheduled, or
        its id is in use. `EngineCore.add_request` calls it once, before anything is
        allocated for the request; `add_request` trusts it."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if n == 0:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if n > self.config.max_model_len:
            raise ValueError(
                f"request {request_id}: the prompt ({n} tokens) is longer than "
                f"max_model_len ({self.config.max_model_len})"
            )
        num_blocks = self.kv_cache_manager.num_blocks
        if cdiv(n, self.block_size) > num_blocks and not self.fits_any_length:
            raise ValueError(
                f"request {request_id}: the prompt ({n} tokens) needs "
                f"{cdiv(n, self.block_size)} KV blocks but the cache has only {num_blocks} "
                f"(of {self.block_size} tokens each)"
            )

    def add_request(self, request: Request) -> None:
        """Queue a request that passed `check_admission`."""
        assert request.request_id not in self.requests, "check_admission first"
        request.status = RequestStatus.WAITING
        max_tokens = request.sampling_params.max_tokens
        request.max_num_tokens = (
            self.max_len
            if max_tokens is None
            else min(self.max_len, request.num_prompt_tokens + max_tokens)
        )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        request.record_event(EngineCoreEventType.QUEUED)

    def finish_requests(
        self,
        request_ids: Iterable[str],
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
        error: str | None = None,
    ) -> ClientOutputs:
        """End unfinished requests (abort, error); unknown or finished ids are ignored.

        Returns one final output per request actually ended, for the caller to send or not
        (a client that aborted already knows).
        """
        assert status.is_finished
        outputs: ClientOutputs = {}
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)
                out = self._make_output(request, [], error)
                outputs.setdefault(request.client_id, []).append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def make_stats(self) -> SchedulerStats:
        kv, spec = self.kv_cache_manager, self.spec
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            step_counter=self.step_id,
            num_generated_tokens=self.num_generated_tokens,
        )
        if spec is not None:
            spec.fill_stats(stats)
        return stats

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """The next step: running requests first, then waiting ones, in one token budget."""
        step = NextStep(self.config.max_num_batched_tokens)
        self._schedule_running(step)
        # a step that had to preempt has no room to spare for newcomers
        if not step.preempted:
            self._schedule_waiting(step)
        running = self.running
        output = SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            finished_req_ids=sorted(self.finished_req_ids),
            preempted_req_ids=sorted(self.preempted_req_ids),
            structured_output_req_ids=step.structured,
            scheduled_spec_decode_tokens=step.spec_tokens,
            num_common_prefix_blocks=self.kv_cache_manager.get_num_common_prefix_blocks(
                running[0].request_id, len(running)
            )
            if running
            else 0,
        )
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        self.step_id += 1
        return output

    def _schedule_running(self, step: NextStep) -> None:
        """Each running request's next tokens (a decode's one and its drafts, a long
        prompt's next chunk), preempting the newest running requests while blocks run out."""
        kv, running, max_len = self.kv_cache_manager, self.running, self.max_len
        cached = step.cached_reqs
        cached_ids, cached_blocks, cached_computed = (
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
        )  # fmt: skip
        take = step.take
        # per-step constants (the loop runs per request per step); None / 0 skip their checks,
        # and without a speculator no request has drafts
        rope_threshold, max_lookahead = self.config.long_rope_threshold, self.lookahead
        speculating = self.spec is not None
        i = 0
        while i < len(running) and step.budget > 0:
            request = running[i]
            i += 1
            num_computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            if speculating and (
                request.num_drafts_in_flight or (placeholders and request.spec_wanted)
            ):
                continue  # how many tokens its step in flight returns decides where it goes on
            num_pending = len(request.all_token_ids) + placeholders
            if placeholders and num_pending >= request.max_num_tokens:
                continue  # the token in flight ends it by length: nothing more to compute
            num_known = num_pending - num_computed
            num_drafts = len(request.spec_token_ids) if speculating else 0
            num_new = num_known + num_drafts
            # cut to the budget and max_len; most requests fit both, and this test is cheaper
            # than a min() call for each
            if num_new > step.budget or num_computed + num_new > max_len:
                num_new = min(num_new, step.budget, max_len - num_computed)
            if num_new <= 0:
                continue
            if rope_threshold is not None and self._outgrows_short_rope(
                request, num_computed + num_new
            ):
                i -= 1
                self._preempt(running.pop(i))
                continue
            lookahead = min(max_lookahead, max_len - num_computed - num_new) if max_lookahead else 0
            while (
                new_block_ids := kv.allocate_slots(request, num_new, None, 0, lookahead)
            ) is None:
                victim = running.pop()
                self._preempt(victim)
                step.preempted = True
                if victim is request:
                    break
            if new_block_ids is None:
                break
            cached_ids.append(request.request_id)
            cached_blocks.append(new_block_ids)
            cached_computed.append(num_computed)
            if num_drafts:
                step.take_drafts(request, num_new - num_known if num_new > num_known else 0)
            take(request, num_new)

    def _schedule_waiting(self, step: NextStep) -> None:
        """Waiting requests in order, while the budget, the sequence count and the blocks
        allow; the prefix cache serves what it holds of each prompt."""
        kv, waiting = self.kv_cache_manager, self.waiting
        compiling: list[Request] = []  # waiting for their grammar: the others go first
        while waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: resume once it has arrived
            if request.structured_output is not None and request.structured_output.matcher is None:
                compiling.append(waiting.popleft())
                continue
            self._settle_long_rope(request)
            if needs_prompt_logprobs(request):
                hit_blocks, num_hit = [], 0
            else:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > step.budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, step.budget)
            lookahead = min(self.lookahead, self.max_len - num_hit - num_new)
            if kv.allocate_slots(request, num_new, hit_blocks, num_hit, lookahead) is None:
                break
            waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.record_event(EngineCoreEventType.SCHEDULED)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            step.new_reqs.append(self._new_request_data(request))
            step.take(request, num_new)
        waiting.extendleft(reversed(compiling))

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> ClientOutputs:
        """Append sampled tokens, apply stop rules, free finished requests.

        Requests that ended while this step was in flight (aborted, or stopped by the
        previous step) are gone from `self.requests`: their extra token is dropped.
        """
        outputs: ClientOutputs = {}
        runner, spec = model_runner_output, self.spec
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens  # empty: no drafts verified
        for request_id, sampled in zip(runner.req_ids, runner.sampled_token_ids, strict=True):
            request = self.requests.get(request_id)
            if request is None or not sampled:
                continue
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            if spec_tokens and (drafts := spec_tokens.get(request_id)):
                request.num_drafts_in_flight = 0
                num_rejected = spec.verified(len(drafts), len(sampled))
                if request.status == RequestStatus.RUNNING:  # (else preempted: recomputed)
                    request.num_computed_tokens -= num_rejected
            num_new = 0
            for token_id in sampled:
                request.append_output_token(token_id)
                num_new += 1
                if self._check_stop(request):
                    self._finish(request, request.status)
                    break
            self.num_generated_tokens += num_new
            # the decoded message's list, which nothing else holds, unless a stop cut it
            new_token_ids = sampled if num_new == len(sampled) else sampled[:num_new]
            error = None
            grammar = request.structured_output
            if grammar is not None and not grammar.accept(new_token_ids):
                error = f"structured_outputs: the grammar refused token {new_token_ids[-1]}"
                if request.status.is_finished:
                    request.status = RequestStatus.FINISHED_ERROR
                else:
                    self._finish(request, RequestStatus.FINISHED_ERROR)
            out = self._make_output(request, new_token_ids, error)
            if request.events:
                out.events = request.take_events()
            outputs.setdefault(request.client_id, []).append(out)
        if spec is not None:
            self._propose_drafts(runner)
        if runner.logprobs is not None or runner.prompt_logprobs:
            self.logprobs.attach(outputs.values(), runner, self.requests)
        return outputs

    def _propose_drafts(self, runner: ModelRunnerOutput) -> None:
        """Give each request still running that got tokens in this step the drafts its next
        step verifies (the outputs of this step do not depend on them)."""
        worker_drafts = runner.draft_token_ids
        for i, (request_id, sampled) in enumerate(
            zip(runner.req_ids, runner.sampled_token_ids, strict=True)
        ):
            request = self.requests.get(request_id)
            if request is not None and sampled and request.status == RequestStatus.RUNNING:
                self.spec.propose(request, worker_drafts[i] if worker_drafts else [])

    # ------------------------------------------------------------------ helpers

    def _check_stop(self, request: Request) -> bool:
        """Set the status of a request that its last token ends; True if it ended."""
        last = request.output_token_ids[-1]
        if (
            last in request.stop_reasons
            and len(request.output_token_ids) >= request.sampling_params.min_tokens
        ):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = request.stop_reasons[last]
            return True
        # max_num_tokens: max_len, or the prompt plus max_tokens if that is less
        if len(request.all_token_ids) >= request.max_num_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _outgrows_short_rope(self, request: Request, num_tokens: int) -> bool:
        threshold = self.config.long_rope_threshold
        return threshold is not None and not request.long_rope and num_tokens > threshold

    def _settle_long_rope(self, request: Request) -> None:
        """Mark a request about to be scheduled from the waiting queue long if it is longer
        than the LongRoPE threshold (its block hashes start again, from the long root)."""
        if self._outgrows_short_rope(request, request.num_tokens):
            request.long_rope = True
            request.block_hashes = []

    def _preempt(self, request: Request) -> None:
        if not request.num_output_placeholders:  # else its last prompt chunk is in flight
            self.logprobs.drop(request.request_id)  # recomputed, sent again
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_wanted = [], False
        self.waiting.appendleft(request)
        self.preempted_req_ids.add(request.request_id)
        self.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        self.logprobs.drop(request.request_id)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        if self.spec is not None:
            self.spec.forget(request.request_id)

    def _new_request_data(self, request: Request) -> NewRequestData:
        params = request.sampling_params
        if params.prompt_logprobs is not None and not needs_prompt_logprobs(request):
            # resumed after its first token: its prompt logprobs are out already
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            sample_seed=request.sample_seed,
            min_tokens_stop_ids=sorted(request.stop_token_ids) if params.min_tokens else [],
        )

    def _make_output(
        self, request: Request, new_token_ids: list[int], error: str | None = None
    ) -> EngineCoreOutput:
        num_cached = request.num_cached_tokens  # -1 until it is first scheduled
        return EngineCoreOutput(
            request.request_id,
            new_token_ids,
            FINISH_REASONS.get(request.status),
            request.stop_reason,
            num_cached if num_cached >= 0 else 0,  # cheaper than max(), once per output
            error,
        )
