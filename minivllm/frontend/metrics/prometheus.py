"""Prometheus metrics under vLLM's names, labels (`model_name`, `engine`) and histogram
buckets, so dashboards built for vLLM (its published Grafana dashboard) work unchanged.

Each logger owns a registry (with the process, platform and GC collectors that a default
registry has); `generate_latest(logger.registry)` is the body of `/metrics`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from typing import TypeVar

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from minivllm.frontend.clients.dp_failover import FailoverStats
from minivllm.frontend.metrics.stats import IterationStats, SchedulerUpdate

M = TypeVar("M", Gauge, Counter)

# vLLM's bucket boundaries (vllm/v1/metrics/buckets.py)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0)
REQUEST_LATENCY_BUCKETS += (40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
ITL_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    steps = (m * 10**e for e in range(len(str(max_model_len))) for m in (1, 2, 5))
    return [step for step in steps if step <= max_model_len]


class Histogram(Collector):
    """A histogram with one label set, exported like prometheus-client's. Observing is a
    bisect and two additions: the inter-token latency is observed for every token streamed,
    and prometheus-client's histogram (a lock and a linear scan) costs four times as much.
    Observed and scraped on the event loop's thread only."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        bounds = [*map(str, self.bounds), "+Inf"]
        buckets = list(zip(bounds, itertools.accumulate(self.counts), strict=True))
        family.add_metric(list(self.labels.values()), buckets, self.sum)
        yield family


class FailoverCollector(Collector):
    """The failover counters of a data-parallel client, read when scraped, one series per
    engine-core (`engine` is its index, as in vLLM's data-parallel metrics)."""

    METRICS = (
        ("deaths", "vllm:engine_core_deaths", "Times the engine-core died."),
        (
            "moved",
            "vllm:engine_core_requests_moved",
            "Requests moved off the engine-core when it died, to go on on another.",
        ),
        (
            "failed",
            "vllm:engine_core_requests_failed",
            "Requests that failed when the engine-core died (none left, or the failover limit).",
        ),
        ("restarts", "vllm:engine_core_restarts", "Times the engine-core was restarted."),
    )

    def __init__(self, stats: FailoverStats, model_name: str, registry: CollectorRegistry) -> None:
        self.stats = stats
        self.model_name = model_name
        registry.register(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        for field, name, documentation in self.METRICS:
            family = CounterMetricFamily(name, documentation, labels=["model_name", "engine"])
            for engine, value in enumerate(getattr(self.stats, field)):
                family.add_metric([self.model_name, str(engine)], value)
            yield family


class PrometheusStatLogger:
    """Sets vLLM's gauges, counters and histograms from the collector's stats; with
    `failover`, a data-parallel client's counters of engine-core deaths too."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        engine_index: int = 0,
        num_speculative_tokens: int = 0,
        failover: FailoverStats | None = None,
    ) -> None:
        """`num_speculative_tokens`: k of the engine's speculative decoding (0: none; its
        counters are not exported then, as in vLLM)."""
        self.registry = registry = CollectorRegistry(auto_describe=True)
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
        if failover is not None:
            FailoverCollector(failover, model_name, registry)
        labels = {"model_name": model_name, "engine": str(engine_index)}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=registry).labels(**labels)

        def by_label(kind: type[M], name: str, doc: str, **label: Sequence[str]) -> dict[str, M]:
            """A gauge or counter with one more label (`label=its values`): its child per
            value, by value."""
            ((key, values),) = label.items()
            family = kind(name, doc, [*labels, key], registry=registry)
            return {v: family.labels(**labels, **{key: v}) for v in values}

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets, registry)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        # every waiting request waits for capacity (nothing here defers one), the prefix
        # cache is on the device, and the engine never sleeps: vLLM's breakdowns, constant
        self.waiting_by_reason = by_label(
            Gauge,
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            reason=("capacity", "deferred"),
        )
        self.prompt_tokens_cached_by_source = by_label(
            Counter,
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            source=("device",),
        )
        sleep_state = by_label(
            Gauge,
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 1 means the engine is awake.",
            sleep_state=("awake", "weights_offloaded", "discard_all"),
        )
        sleep_state["awake"].set(1)
        self.prompt_tokens_by_source = by_label(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            source=PROMPT_TOKEN_SOURCES,
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = by_label(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            finished_reason=FINISH_REASONS,
        )
        tokens = request_tokens_buckets(max_model_len)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        # each value of the `IterationStats` list of that name is observed
        self.per_iteration = {
            "time_to_first_tokens": histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            ),
            "inter_token_latencies": histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ITL_BUCKETS,
            ),
            "n_params": histogram(
                "vllm:request_params_n",
                "Histogram of the n request parameter.",
                REQUEST_PARAMS_N_BUCKETS,
            ),
            "max_num_generation_tokens": histogram(
                "vllm:request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.",
                tokens,
            ),
        }
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        self._counter, self._by_label = counter, by_label
        self.spec: tuple[Counter, ...] | None = None
        self.spec_per_pos: list[Counter] = []
        if num_speculative_tokens:
            self._add_spec_counters(num_speculative_tokens)
        # each finished request's `RequestStats` field of that name is observed
        self.per_request = {
            "num_prompt_tokens": histogram(
                "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
            ),
            "num_generation_tokens": histogram(
                "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
            ),
            "max_tokens_param": histogram(
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                tokens,
            ),
            "mean_time_per_output_token": histogram(
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                ITL_BUCKETS,
            ),
            "e2e_latency": histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "num_preemptions": histogram(
                "vllm:request_num_preemptions",
                "Histogram of the number of times a request was preempted.",
                REQUEST_NUM_PREEMPTIONS_BUCKETS,
            ),
        }
        for field, name, phase in (
            ("queued_time", "queue", "WAITING"),
            ("inference_time", "inference", "RUNNING"),
            ("prefill_time", "prefill", "PREFILL"),
            ("decode_time", "decode", "DECODE"),
        ):  # vllm:request_queue_time_seconds, ...
            self.per_request[field] = histogram(
                f"vllm:request_{name}_time_seconds",
                f"Histogram of time spent in {phase} phase for request.",
                REQUEST_LATENCY_BUCKETS,
            )

    def record(self, scheduler: SchedulerUpdate | None, iteration: IterationStats | None) -> None:
        if scheduler is not None:
            self.running.set(scheduler.num_running)
            self.waiting.set(scheduler.num_waiting)
            self.waiting_by_reason["capacity"].set(scheduler.num_waiting)
            self.kv_cache_usage.set(scheduler.kv_cache_usage)
            self.prefix_cache_queries.inc(scheduler.new_prefix_cache_queries)
            self.prefix_cache_hits.inc(scheduler.new_prefix_cache_hits)
            self.preemptions.inc(scheduler.new_preemptions)
            per_pos = scheduler.new_spec_accepted_per_pos
            if per_pos and self.spec is None:  # an engine (a daemon's) that speculates
                self._add_spec_counters(len(per_pos))
            if self.spec is not None and len(per_pos) == len(self.spec_per_pos):
                drafts, draft_tokens, accepted = self.spec
                drafts.inc(scheduler.new_spec_drafts)
                draft_tokens.inc(scheduler.new_spec_draft_tokens)
                accepted.inc(scheduler.new_spec_accepted_tokens)
                for counter, n in zip(self.spec_per_pos, per_pos, strict=True):
                    counter.inc(n)
        if iteration is not None:
            self._record_iteration(iteration)

    def _add_spec_counters(self, num_speculative_tokens: int) -> None:
        """vLLM's speculative-decoding counters (only an engine that speculates has them)."""
        counter = self._counter
        self.spec = (
            counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
            counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
            counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
        )
        per_pos = self._by_label(
            Counter,
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            position=[str(i) for i in range(num_speculative_tokens)],
        )
        self.spec_per_pos = list(per_pos.values())

    def _record_iteration(self, it: IterationStats) -> None:
        computed = it.num_prompt_tokens - it.num_cached_prompt_tokens
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
            self.prompt_tokens_cached.inc(it.num_cached_prompt_tokens)
            self.prompt_tokens_cached_by_source["device"].inc(it.num_cached_prompt_tokens)
            self.prompt_tokens_by_source["local_compute"].inc(computed)
            self.prompt_tokens_by_source["local_cache_hit"].inc(it.num_cached_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        if computed or it.num_generation_tokens:
            self.iteration_tokens.observe(computed + it.num_generation_tokens)
        for field, histogram in self.per_iteration.items():
            for value in getattr(it, field):
                histogram.observe(value)
        for req in it.finished_requests:
            self.request_success[req.finish_reason].inc()
            self.prefill_kv_computed.observe(req.num_prompt_tokens - req.num_cached_tokens)
            for field, histogram in self.per_request.items():
                value = getattr(req, field)
                if value is not None:  # max_tokens_param when the request set none
                    histogram.observe(value)

    def log(self) -> None:
        """Prometheus is scraped, not logged."""
