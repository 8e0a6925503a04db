"""The periodic stats log line, in vLLM's words:

    Engine 000: Avg prompt throughput: 512.3 tokens/s, Avg generation throughput: 2048.0
    tokens/s, Running: 64 reqs, Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache
    hit rate: 50.0%

With speculative decoding, a second line gives vLLM's acceptance figures of the interval:

    SpecDecoding metrics: Mean acceptance length: 2.41, Accepted throughput: 120.50
    tokens/s, Drafted throughput: 200.00 tokens/s, Accepted: 1205 tokens, Drafted: 2000
    tokens, Per-position acceptance rate: 0.712, 0.455, 0.251, Avg Draft acceptance rate:
    60.3%

Prompt throughput counts the prompt tokens computed (prefix-cache hits excluded) since the
previous line. The hit rate is over the last 1000 engine steps that looked prompts up in the
prefix cache (vLLM: the last 1000 requests). An idle
engine (nothing in this interval nor the previous one) logs at DEBUG only, so a quiet server
keeps a quiet log.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from minivllm.frontend.metrics.stats import IterationStats, SchedulerUpdate

logger = logging.getLogger("minivllm.stats")


class LoggingStatLogger:
    """Accumulates token counts between `log()` calls and prints vLLM's stats line."""

    def __init__(self, kv_cache_device: str = "GPU", engine_index: int = 0) -> None:
        self.prefix = f"Engine {engine_index:03d}: "
        self.kv_cache_device = kv_cache_device
        self.last_log_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        self.last_throughputs = (0.0, 0.0)  # (prompt, generation) of the previous line
        self.scheduler = SchedulerUpdate(0, 0, 0.0, 0, 0, 0)  # the last one reported
        # (queries, hits) of the last 1000 scheduler updates that looked tokens up
        self.prefix_cache: deque[tuple[int, int]] = deque(maxlen=1000)
        self.spec = SpecDecodingLogging()

    def record(self, scheduler: SchedulerUpdate | None, iteration: IterationStats | None) -> None:
        if (it := iteration) is not None:
            self.num_prompt_tokens += it.num_prompt_tokens - it.num_cached_prompt_tokens
            self.num_generation_tokens += it.num_generation_tokens
        if scheduler is not None:
            self.scheduler = scheduler
            self.num_preemptions += scheduler.new_preemptions
            if scheduler.new_prefix_cache_queries > 0:
                queries, hits = scheduler.new_prefix_cache_queries, scheduler.new_prefix_cache_hits
                self.prefix_cache.append((queries, hits))
            self.spec.observe(scheduler)

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self.last_log_time, 1e-9)
        throughputs = (self.num_prompt_tokens / elapsed, self.num_generation_tokens / elapsed)
        idle = not any(throughputs + self.last_throughputs)
        self.last_throughputs = throughputs
        preemptions = self.num_preemptions
        self.last_log_time = now
        self.num_prompt_tokens = self.num_generation_tokens = self.num_preemptions = 0

        sched = self.scheduler
        parts = [
            f"Avg prompt throughput: {throughputs[0]:.1f} tokens/s",
            f"Avg generation throughput: {throughputs[1]:.1f} tokens/s",
            f"Running: {sched.num_running} reqs",
            f"Waiting: {sched.num_waiting} reqs",
        ]
        if preemptions:
            parts.append(f"Preemptions: {preemptions}")
        parts.append(f"{self.kv_cache_device} KV cache usage: {100 * sched.kv_cache_usage:.1f}%")
        queries = sum(update[0] for update in self.prefix_cache)
        if queries:
            hits = sum(update[1] for update in self.prefix_cache)
            parts.append(f"Prefix cache hit rate: {100 * hits / queries:.1f}%")
        log = logger.debug if idle else logger.info
        log(self.prefix + ", ".join(parts))  # no args: the "%" signs stay as they are
        self.spec.log(log, self.prefix, elapsed)


class SpecDecodingLogging:
    """Speculative decoding's counts between two stats lines, and vLLM's line of them."""

    def __init__(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def observe(self, update: SchedulerUpdate) -> None:
        self.num_drafts += update.new_spec_drafts
        self.num_draft_tokens += update.new_spec_draft_tokens
        self.num_accepted_tokens += update.new_spec_accepted_tokens
        per_pos = update.new_spec_accepted_per_pos
        if len(self.accepted_per_pos) < len(per_pos):
            self.accepted_per_pos += [0] * (len(per_pos) - len(self.accepted_per_pos))
        for i, n in enumerate(per_pos):
            self.accepted_per_pos[i] += n

    def log(self, log, prefix: str, elapsed: float) -> None:
        """The line of the counts since the last one (none if nothing was verified)."""
        drafts, drafted, accepted = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        if not drafts:
            return
        rates = ", ".join(f"{n / drafts:.3f}" for n in self.accepted_per_pos)
        rate = 100 * accepted / drafted if drafted else float("nan")
        log(
            f"{prefix}SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, Drafted throughput: "
            f"{drafted / elapsed:.2f} tokens/s, Accepted: {accepted} tokens, Drafted: "
            f"{drafted} tokens, Per-position acceptance rate: {rates}, Avg Draft acceptance "
            f"rate: {rate:.1f}%"
        )
        self.__init__()
