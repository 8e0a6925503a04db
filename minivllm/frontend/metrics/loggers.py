"""The periodic stats log line, in vLLM's words:

    Engine 000: Avg prompt throughput: 512.3 tokens/s, Avg generation throughput: 2048.0
    tokens/s, Running: 64 reqs, Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache
    hit rate: 50.0%

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
from collections.abc import Callable

from minivllm.frontend.metrics.stats import IterationStats, SchedulerUpdate

logger = logging.getLogger("minivllm.stats")


class LoggingStatLogger:
    """Accumulates token counts between `log()` calls and prints vLLM's stats line."""

    def __init__(
        self,
        kv_cache_device: str = "GPU",
        engine_index: int = 0,
        totals: Callable[[], tuple[float, float]] | None = None,
    ) -> None:
        """`totals`: the prompt tokens computed and the tokens generated so far by every API
        process of the server, when this one logs for all (else its own are counted)."""
        self.prefix = f"Engine {engine_index:03d}: "
        self.totals = totals
        self.last_totals = totals() if totals is not None else (0.0, 0.0)
        self.kv_cache_device = kv_cache_device
        self.last_log_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        self.last_throughputs = (0.0, 0.0)  # (prompt, generation) of the previous line
        self.scheduler = SchedulerUpdate(0, 0, 0.0, 0, 0, 0)  # the last one reported
        # (queries, hits) of the last 1000 scheduler updates that looked tokens up
        self.prefix_cache: deque[tuple[int, int]] = deque(maxlen=1000)

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

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self.last_log_time, 1e-9)
        if self.totals is not None:
            totals, last = self.totals(), self.last_totals
            self.last_totals = totals
            self.num_prompt_tokens, self.num_generation_tokens = (
                totals[0] - last[0],
                totals[1] - last[1],
            )
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
