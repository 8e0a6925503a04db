"""V1 scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill and decode phases: every request is a number of tokens still to
compute, and a step hands out at most `max_num_batched_tokens` of them (a long prompt is
split across steps: chunked prefill). When KV blocks run out, the newest running request is
preempted (its KV freed, to be recomputed later) and goes back to the front of the queue.

Async scheduling: `schedule()` for step N+1 may run before `update_from_output()` for step
N (at most one step in flight). A request's tokens are counted as
`num_tokens + num_output_placeholders`, the placeholders being tokens that scheduled steps
will sample, so the same code serves both orders.

Outputs are returned grouped by client: `{client_id: [EngineCoreOutput, ...]}`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import msgspec

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine_core.kv_cache_manager import KVCacheManager, cdiv
from minivllm.engine_core.request import FINISH_REASONS, Request, RequestStatus
from minivllm.protocol.messages import (
    CachedRequestData,
    EngineCoreEventType,
    EngineCoreOutput,
    LogprobsArrays,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)

ClientOutputs = dict[int, list[EngineCoreOutput]]


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        sliding_window: int | None = None,
    ) -> None:
        """`sliding_window`: set when every layer of the model attends over a window of at
        most that many tokens (`ModelConfig.kv_sliding_window`); blocks behind it are freed."""
        self.config = scheduler_config
        self.block_size = bs = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, bs, cache_config.enable_prefix_caching, sliding_window
        )
        # a request alone always fits: its sequence never outgrows the whole cache, or, under
        # a sliding window, the blocks one step holds (its window and its new tokens) fit
        step_tokens = min(scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len)
        self.window_bounds_blocks = (
            sliding_window is not None
            and cdiv(sliding_window - 1 + step_tokens, bs) + 1 <= num_blocks
        )
        self.max_len = scheduler_config.max_model_len
        if not self.window_bounds_blocks:
            self.max_len = min(self.max_len, num_blocks * bs)
        self.requests: dict[str, Request] = {}  # unfinished ones
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # workers must forget these at the next step
        self.preempted_req_ids: set[str] = set()  # and these, preempted by this step
        self.step_id = 0
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        # req_id -> prompt logprobs received so far, sent with the request's first token
        self.prompt_logprobs: dict[str, list[LogprobsArrays]] = {}

    # ------------------------------------------------------------------ requests in and out

    def check_prompt(self, request_id: str, n: int) -> None:
        """`ValueError` if a prompt of `n` tokens can never be scheduled; cheap enough to
        call before anything is allocated for the request."""
        if n == 0:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if n > self.config.max_model_len:
            raise ValueError(
                f"request {request_id}: the prompt ({n} tokens) is longer than "
                f"max_model_len ({self.config.max_model_len})"
            )
        num_blocks = self.kv_cache_manager.num_blocks
        if cdiv(n, self.block_size) > num_blocks and not self.window_bounds_blocks:
            raise ValueError(
                f"request {request_id}: the prompt ({n} tokens) needs "
                f"{cdiv(n, self.block_size)} KV blocks but the cache has only {num_blocks} "
                f"(of {self.block_size} tokens each)"
            )

    def add_request(self, request: Request) -> None:
        """Queue a request; `ValueError` if its prompt can never be scheduled."""
        self.check_prompt(request.request_id, request.num_prompt_tokens)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
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
                out = self._make_output(request, [])
                out.error = error
                outputs.setdefault(request.client_id, []).append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            step_counter=self.step_id,
            num_generated_tokens=self.num_generated_tokens,
        )

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached_reqs = CachedRequestData()
        cached_ids = cached_reqs.req_ids
        cached_block_ids = cached_reqs.new_block_ids
        cached_computed = cached_reqs.num_computed_tokens
        new_reqs: list[NewRequestData] = []
        structured: list[str] = []  # requests that sample this step under a grammar
        preempted = False

        running = self.running
        max_len = self.max_len
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            num_pending = len(request.all_token_ids) + request.num_output_placeholders
            if request.num_output_placeholders and num_pending >= request.max_num_tokens:
                i += 1  # the token in flight ends it by length: nothing more to compute
                continue
            num_new = min(num_pending - num_computed, budget, max_len - num_computed)
            if num_new <= 0:
                i += 1
                continue
            while (new_block_ids := kv.allocate_slots(request, num_new)) is None:
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_block_ids is None:
                break
            request_id = request.request_id
            cached_ids.append(request_id)
            cached_block_ids.append(new_block_ids)
            cached_computed.append(num_computed)
            num_scheduled[request_id] = num_new
            budget -= num_new
            request.num_computed_tokens = num_computed + num_new
            if num_computed + num_new >= len(request.all_token_ids):
                request.num_output_placeholders += 1  # this step samples its next token
                if request.structured_output is not None and request.structured_output.active:
                    structured.append(request_id)
            i += 1

        # a step that had to preempt has no room to spare for newcomers
        compiling: list[Request] = []  # waiting for their grammar: the others go first
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: resume once it has arrived
            if request.structured_output is not None and request.structured_output.matcher is None:
                compiling.append(self.waiting.popleft())
                continue
            if _needs_prompt_logprobs(request):
                hit_blocks, num_hit = [], 0
            else:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if kv.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
                break
            self.waiting.popleft()
            running.append(request)
            request.status = RequestStatus.RUNNING
            request.record_event(EngineCoreEventType.SCHEDULED)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            new_reqs.append(self._new_request_data(request))
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            request.num_computed_tokens += num_new
            if request.num_computed_tokens >= request.num_tokens:
                request.num_output_placeholders += 1
                if request.structured_output is not None and request.structured_output.active:
                    structured.append(request.request_id)
        self.waiting.extendleft(reversed(compiling))

        output = SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=sorted(self.finished_req_ids),
            preempted_req_ids=sorted(self.preempted_req_ids),
            structured_output_req_ids=structured,
            num_common_prefix_blocks=kv.get_num_common_prefix_blocks(
                running[0].request_id, len(running)
            )
            if running
            else 0,
        )
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        self.step_id += 1
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> ClientOutputs:
        """Append sampled tokens, apply stop rules, free finished requests.

        Requests that ended while this step was in flight (aborted, or stopped by the
        previous step) are gone from `self.requests`: their extra token is dropped.
        """
        outputs: ClientOutputs = {}
        runner = model_runner_output
        for request_id, sampled in zip(runner.req_ids, runner.sampled_token_ids, strict=True):
            request = self.requests.get(request_id)
            if request is None or not sampled:
                continue
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
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
            grammar = request.structured_output
            if grammar is not None and not grammar.accept(new_token_ids):
                if request.status.is_finished:
                    request.status = RequestStatus.FINISHED_ERROR
                else:
                    self._finish(request, RequestStatus.FINISHED_ERROR)
            out = self._make_output(request, new_token_ids)
            if request.status == RequestStatus.FINISHED_ERROR:
                out.error = f"structured_outputs: the grammar refused token {new_token_ids[-1]}"
            if request.events:
                out.events = request.take_events()
            outputs.setdefault(request.client_id, []).append(out)
        if runner.logprobs is not None or runner.prompt_logprobs:
            self._attach_logprobs(outputs, runner)
        return outputs

    def _attach_logprobs(self, outputs: ClientOutputs, runner: ModelRunnerOutput) -> None:
        """Give each output the logprobs of its new tokens and, with its first token, those
        of its whole prompt (gathered over the prefill chunks)."""
        for req_id, part in runner.prompt_logprobs.items():
            self.prompt_logprobs.setdefault(req_id, []).append(part)
        rows = {runner.req_ids[i]: row for row, i in enumerate(runner.logprobs_req_idx)}
        for client_outputs in outputs.values():
            for out in client_outputs:
                row = rows.get(out.request_id)
                if row is not None and out.new_token_ids:
                    out.new_logprobs = runner.logprobs.rows(row, row + len(out.new_token_ids))
                if out.new_token_ids and (parts := self.prompt_logprobs.pop(out.request_id, None)):
                    out.new_prompt_logprobs = LogprobsArrays.concat(parts)
        for req_id in runner.prompt_logprobs:
            if req_id not in self.requests:  # ended while this step ran
                self.prompt_logprobs.pop(req_id, None)

    # ------------------------------------------------------------------ helpers

    def _check_stop(self, request: Request) -> bool:
        """Set the status of a request that its last token ends; True if it ended."""
        last = request.output_token_ids[-1]
        if (
            last in request.stop_ids
            and len(request.output_token_ids) >= request.sampling_params.min_tokens
        ):
            request.status = RequestStatus.FINISHED_STOPPED
            if last not in request.eos_token_ids:
                request.stop_reason = last  # a stop token id (EOS has no stop reason)
            return True
        # max_num_tokens: max_len, or the prompt plus max_tokens if that is less
        if len(request.all_token_ids) >= request.max_num_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _preempt(self, request: Request) -> None:
        if not request.num_output_placeholders:  # else its last prompt chunk is in flight
            self.prompt_logprobs.pop(request.request_id, None)  # recomputed, sent again
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
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
        self.prompt_logprobs.pop(request.request_id, None)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def _new_request_data(self, request: Request) -> NewRequestData:
        params = request.sampling_params
        if params.prompt_logprobs is not None and not _needs_prompt_logprobs(request):
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
        )

    def _make_output(self, request: Request, new_token_ids: list[int]) -> EngineCoreOutput:
        return EngineCoreOutput(
            request.request_id,
            new_token_ids,
            FINISH_REASONS.get(request.status),
            request.stop_reason,
            max(request.num_cached_tokens, 0),  # -1 until it is first scheduled
        )


def _needs_prompt_logprobs(request: Request) -> bool:
    """Prompt logprobs still to compute: the whole prompt runs, none of it from the cache."""
    return request.sampling_params.prompt_logprobs is not None and not request.output_token_ids
