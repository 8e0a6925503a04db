"""Request timings and token counts, read off the stream of engine-core outputs.

`StatsCollector` sees each `EngineCoreOutputs` batch once (from `AsyncLLM`'s output handler),
plus the requests it adds and aborts, and hands the stat loggers one `IterationStats` per
batch and one `SchedulerUpdate` per scheduler snapshot. Definitions follow vLLM's:

- TTFT: arrival in the frontend to the frontend's receipt of the first token;
- inter-token latency: between the engine-core timestamps of consecutive outputs;
- e2e latency: arrival to the frontend's receipt of the last output;
- queue time: queued to first scheduled in the engine-core; prefill time: first scheduled
  to first token; decode time: first to last token; inference time: first scheduled to
  last token (all engine-core clock).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from minivllm.protocol.messages import (
    EngineCoreEventType,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)


@dataclass(slots=True)
class _Group:
    """The n engine requests of one user request."""

    n: int
    unfinished: int
    max_generation_tokens: int = 0


@dataclass(slots=True)
class RequestStats:
    """One engine request (one of the `n` of a user request): its counts and engine-core
    timestamps while it runs; once it ends, `IterationStats.finished_requests` holds it with
    the fields below the line set (the phase times stay 0 if it never got a token)."""

    group: _Group
    arrival_time: float
    num_prompt_tokens: int
    max_tokens_param: int | None
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # ----- set when it ends
    finish_reason: str = ""  # "stop", "length", "abort" or "error"
    e2e_latency: float = 0.0
    queued_time: float = 0.0
    prefill_time: float = 0.0
    inference_time: float = 0.0
    decode_time: float = 0.0
    mean_time_per_output_token: float = 0.0


@dataclass
class IterationStats:
    """What one batch of engine-core outputs did, as far as this frontend's requests go."""

    timestamp: float  # frontend clock, when the batch was processed
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0  # prompts of the requests that got their first token here
    num_cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[RequestStats] = field(default_factory=list)
    # per user request that ended here: its n, and the most tokens any of its n generated
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerUpdate:
    """The engine-core's scheduler as last reported, with its cumulative counters turned
    into increments since the previous report this frontend saw (the first report counts
    everything since the engine started, so a counter equals the engine's total)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    new_prefix_cache_queries: int
    new_prefix_cache_hits: int
    new_preemptions: int
    # speculative decoding (all 0 without it): verifications, their draft tokens, those
    # accepted, and the accepted ones by draft position, since the previous report
    new_spec_drafts: int = 0
    new_spec_draft_tokens: int = 0
    new_spec_accepted_tokens: int = 0
    new_spec_accepted_per_pos: list[int] = field(default_factory=list)


class StatLogger(Protocol):
    """Anything that consumes the collector's stats (`record`) and may report them (`log`)."""

    def record(
        self, scheduler: SchedulerUpdate | None, iteration: IterationStats | None
    ) -> None: ...

    def log(self) -> None: ...


class StatsCollector:
    """Tracks this frontend's engine requests from `add_requests` to their end and feeds
    the stat loggers. Requests it does not know (added before it, or by another frontend)
    are ignored."""

    def __init__(self, loggers: list[StatLogger]) -> None:
        self.loggers = loggers
        self.requests: dict[str, RequestStats] = {}  # by engine-internal id
        self._last_cumulative = SchedulerStats()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """The engine requests of one user request (n of them for n > 1)."""
        group = _Group(len(requests), len(requests))
        for r in requests:
            self.requests[r.request_id] = RequestStats(
                group, r.arrival_time, len(r.prompt_token_ids), r.sampling_params.max_tokens
            )

    def record(self, outputs: EngineCoreOutputs, ended_here: Iterable[str] = ()) -> None:
        """One batch from the engine-core; `ended_here` are the internal ids the frontend
        ended in it (by a stop string) while the engine-core still runs them."""
        now = time.time()
        it = IterationStats(now)
        engine_ts = outputs.timestamp or now
        requests = self.requests
        for out in outputs.outputs:
            req = requests.get(out.request_id)
            if req is None:
                continue
            if out.events:
                self._apply_events(req, out.events)
            num_new = len(out.new_token_ids)
            if num_new:
                it.num_generation_tokens += num_new
                if req.num_generation_tokens == 0:
                    it.time_to_first_tokens.append(now - req.arrival_time)
                    it.num_prompt_tokens += req.num_prompt_tokens
                    it.num_cached_prompt_tokens += out.num_cached_tokens
                    req.num_cached_tokens = out.num_cached_tokens
                    req.first_token_ts = engine_ts
                else:
                    it.inter_token_latencies.append(engine_ts - req.last_token_ts)
                req.num_generation_tokens += num_new
                req.last_token_ts = engine_ts
            if out.finish_reason is not None:
                self._finish(out.request_id, str(out.finish_reason), it)
        for internal_id in ended_here:
            self._finish(internal_id, "stop", it)
        scheduler = None
        if outputs.scheduler_stats is not None:
            scheduler = self._scheduler_update(outputs.scheduler_stats)
        for logger in self.loggers:
            logger.record(scheduler, it)

    def abort(self, internal_ids: Iterable[str]) -> None:
        """Requests the frontend aborted (the client left, or cancelled)."""
        it = IterationStats(time.time())
        for internal_id in internal_ids:
            self._finish(internal_id, "abort", it)
        if it.finished_requests:
            for logger in self.loggers:
                logger.record(None, it)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """A snapshot asked for outside the output stream (a scrape, an idle engine)."""
        update = self._scheduler_update(stats)
        for logger in self.loggers:
            logger.record(update, None)

    def log(self) -> None:
        for logger in self.loggers:
            logger.log()

    def _apply_events(self, req: RequestStats, events: list) -> None:
        for event in events:
            if event.type == EngineCoreEventType.QUEUED:
                req.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED:
                if not req.scheduled_ts:  # the first time; later ones follow preemptions
                    req.scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                req.num_preemptions += 1

    def _finish(self, internal_id: str, reason: str, it: IterationStats) -> None:
        req = self.requests.pop(internal_id, None)
        if req is None:
            return
        num_gen = req.num_generation_tokens
        req.finish_reason, req.e2e_latency = reason, it.timestamp - req.arrival_time
        if req.scheduled_ts > 0 and req.first_token_ts > 0:
            req.queued_time = max(0.0, req.scheduled_ts - req.queued_ts)
            req.prefill_time = req.first_token_ts - req.scheduled_ts
            req.inference_time = req.last_token_ts - req.scheduled_ts
            req.decode_time = req.last_token_ts - req.first_token_ts
            if num_gen > 1:
                req.mean_time_per_output_token = req.decode_time / (num_gen - 1)
        it.finished_requests.append(req)
        group = req.group
        group.unfinished -= 1
        group.max_generation_tokens = max(group.max_generation_tokens, num_gen)
        if group.unfinished == 0:
            it.n_params.append(group.n)
            it.max_num_generation_tokens.append(group.max_generation_tokens)

    def _scheduler_update(self, stats: SchedulerStats) -> SchedulerUpdate:
        last, self._last_cumulative = self._last_cumulative, stats
        increases = []
        for name in _CUMULATIVE:
            before, now = getattr(last, name), getattr(stats, name)
            # a cumulative counter that went down was reset (a restarted daemon): from zero
            increases.append(now - before if now >= before else now)
        per_pos = stats.spec_num_accepted_tokens_per_pos
        before = last.spec_num_accepted_tokens_per_pos
        if len(before) != len(per_pos) or any(b > n for b, n in zip(before, per_pos, strict=True)):
            before = [0] * len(per_pos)
        return SchedulerUpdate(
            stats.num_running,
            stats.num_waiting,
            stats.kv_cache_usage,
            *increases,
            [n - b for n, b in zip(per_pos, before, strict=True)],
        )


# SchedulerStats' cumulative counters, in SchedulerUpdate's order
_CUMULATIVE = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
)
