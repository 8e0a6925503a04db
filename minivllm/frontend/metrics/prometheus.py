"""Prometheus metrics under vLLM's names, labels (`model_name`, `engine`) and histogram
buckets, so dashboards built for vLLM (its published Grafana dashboard) work unchanged.

Each logger owns a registry; `generate_latest(logger.registry)` is the body of `/metrics`.
Its numbers live in a `MetricValues` (series.py): alone, the registry also has the process,
platform and GC collectors a default registry has; as one of several API processes of a
server (`shared_dir`), it reports the sum over all of them, and the per-process collectors
(whose numbers do not add up) are left out, as in prometheus-client's multiprocess mode.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minivllm.frontend.clients.dp_failover import FailoverStats
from minivllm.frontend.metrics.series import Family, Histogram, Slot, SlotCollector
from minivllm.frontend.metrics.shared_values import Aggregate, MetricValues
from minivllm.frontend.metrics.stats import IterationStats, SchedulerUpdate

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
# a data-parallel client's counters (FailoverStats' fields): every API process sees each
# death and restart (the largest count is the server's); the requests moved off a dead
# engine-core or failed with it are each process's own (summed)
FAILOVER_METRICS = (
    ("deaths", "vllm:engine_core_deaths", "Times the engine-core died.", Aggregate.MAX),
    (
        "moved",
        "vllm:engine_core_requests_moved",
        "Requests moved off the engine-core when it died, to go on on another.",
        Aggregate.SUM,
    ),
    (
        "failed",
        "vllm:engine_core_requests_failed",
        "Requests that failed when the engine-core died (none left, or the failover limit).",
        Aggregate.SUM,
    ),
    (
        "restarts",
        "vllm:engine_core_restarts",
        "Times the engine-core was restarted.",
        Aggregate.MAX,
    ),
)


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    steps = (m * 10**e for e in range(len(str(max_model_len))) for m in (1, 2, 5))
    return [step for step in steps if step <= max_model_len]


class PrometheusStatLogger:
    """Sets vLLM's gauges, counters and histograms from the collector's stats; with
    `failover`, a data-parallel client's counters of engine-core deaths too. With
    `shared_dir`, this is one API process of several: its numbers go to a file there, and
    its registry reports all of theirs (shared_values.py)."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        engine_index: int = 0,
        num_speculative_tokens: int = 0,
        failover: FailoverStats | None = None,
        shared_dir: str | None = None,
    ) -> None:
        """`num_speculative_tokens`: k of the engine's speculative decoding (0: none, or not
        known yet; its counters are exported once an engine that speculates reports)."""
        self.registry = CollectorRegistry(auto_describe=True)
        alone = (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR)
        for collector in alone if shared_dir is None else (PLATFORM_COLLECTOR,):
            self.registry.register(collector)
        self.values = MetricValues(shared_dir)
        self.collector = SlotCollector(self.values)
        self.labels = {"model_name": model_name, "engine": str(engine_index)}
        self._engine_metrics()
        self._token_metrics()
        self._histograms(request_tokens_buckets(max_model_len))
        self.failover = failover
        if failover is not None:
            self._failover_metrics(failover)
        self.spec: tuple[Slot, ...] | None = None
        self.spec_per_pos: list[Slot] = []
        if num_speculative_tokens:
            self._spec_metrics(num_speculative_tokens)
        self.registry.register(self.collector)

    # ------------------------------------------------------------------ definitions

    def _family(self, kind, name: str, doc: str, aggregate: Aggregate, **label) -> Family:
        """A gauge or counter; `label`: one more label, `key=its values`."""
        ((key, values),) = label.items() if label else ((None, ()),)
        family = Family(kind, name, doc, self.labels, self.values, aggregate, key, values)
        self.collector.metrics.append(family)
        return family

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        histogram = Histogram(name, doc, self.labels, buckets, self.values)
        self.collector.metrics.append(histogram)
        return histogram

    def _engine_metrics(self) -> None:
        """The engine's state, as every API process hears of it: the latest report, and
        its cumulative counters (not summed over the processes that follow them)."""
        gauge, latest = GaugeMetricFamily, Aggregate.LATEST
        counter, cumulative = CounterMetricFamily, Aggregate.MAX
        self.running = self._family(
            gauge,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            latest,
        ).only()
        self.waiting = self._family(
            gauge,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            latest,
        ).only()
        self.kv_cache_usage = self._family(
            gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", latest
        ).only()
        self.prefix_cache_queries = self._family(
            counter,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            cumulative,
        ).only()
        self.prefix_cache_hits = self._family(
            counter,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            cumulative,
        ).only()
        self.preemptions = self._family(
            counter,
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            cumulative,
        ).only()
        # every waiting request waits for capacity (nothing here defers one), and the engine
        # never sleeps: vLLM's breakdowns, constant
        self.waiting_by_reason = self._family(
            gauge,
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            latest,
            reason=("capacity", "deferred"),
        )
        sleep_state = self._family(
            gauge,
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 1 means the engine is awake.",
            Aggregate.MAX,
            sleep_state=("awake", "weights_offloaded", "discard_all"),
        )
        sleep_state.child("awake").set(1)

    def _token_metrics(self) -> None:
        """What this process's requests did: summed over the API processes."""
        counter, total = CounterMetricFamily, Aggregate.SUM

        def count(name: str, doc: str, **label) -> Family:
            return self._family(counter, name, doc, total, **label)

        self.prompt_tokens = count(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).only()
        self.prompt_tokens_cached = count(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).only()
        # the prefix cache is on the device
        self.prompt_tokens_cached_by_source = count(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            source=("device",),
        )
        self.prompt_tokens_by_source = count(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            source=PROMPT_TOKEN_SOURCES,
        )
        self.generation_tokens = count(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).only()
        self.request_success = count(
            "vllm:request_success",
            "Count of successfully processed requests.",
            finished_reason=FINISH_REASONS,
        )

    def _histograms(self, tokens: list[int]) -> None:
        histogram = self._histogram
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
        self._request_histograms(tokens)

    def _request_histograms(self, tokens: list[int]) -> None:
        """Each finished request's `RequestStats` field of that name is observed."""
        histogram = self._histogram
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

    def _failover_metrics(self, failover: FailoverStats) -> None:
        """One series per engine-core (`engine` is its index, as in vLLM's data-parallel
        metrics), copied from `failover` as stats arrive, at each log interval and when
        scraped, so that the other API processes read them too."""
        engines = [str(i) for i in range(failover.num_engines)]
        labels = {"model_name": self.labels["model_name"]}
        self.failover_counts: list[tuple[str, Family]] = []
        for field, name, doc, aggregate in FAILOVER_METRICS:
            family = Family(
                CounterMetricFamily, name, doc, labels, self.values, aggregate, "engine", engines
            )
            self.collector.metrics.append(family)
            self.failover_counts.append((field, family))
        self.collector.refresh.append(self._copy_failover)

    def _spec_metrics(self, num_speculative_tokens: int) -> None:
        """vLLM's speculative-decoding counters (only an engine that speculates has them):
        the engine's cumulative counts, as every API process hears them. Added after every
        other metric, so their slots are the same in every process that adds them."""
        counter, cumulative = CounterMetricFamily, Aggregate.MAX
        self.spec = tuple(
            self._family(counter, name, doc, cumulative).only()
            for name, doc in (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
            )
        )
        per_pos = self._family(
            counter,
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            cumulative,
            position=[str(i) for i in range(num_speculative_tokens)],
        )
        self.spec_per_pos = list(per_pos.slots.values())

    # ------------------------------------------------------------------ updates

    def record(self, scheduler: SchedulerUpdate | None, iteration: IterationStats | None) -> None:
        if scheduler is not None:
            self.values.stamp()
            self.running.set(scheduler.num_running)
            self.waiting.set(scheduler.num_waiting)
            self.waiting_by_reason.child("capacity").set(scheduler.num_waiting)
            self.kv_cache_usage.set(scheduler.kv_cache_usage)
            self.prefix_cache_queries.inc(scheduler.new_prefix_cache_queries)
            self.prefix_cache_hits.inc(scheduler.new_prefix_cache_hits)
            self.preemptions.inc(scheduler.new_preemptions)
            self._record_spec(scheduler)
            self._copy_failover()
        if iteration is not None:
            self._record_iteration(iteration)

    def _record_spec(self, scheduler: SchedulerUpdate) -> None:
        per_pos = scheduler.new_spec_accepted_per_pos
        if per_pos and self.spec is None:  # an engine (a daemon's) that speculates
            self._spec_metrics(len(per_pos))
        if self.spec is not None and len(per_pos) == len(self.spec_per_pos):
            drafts, draft_tokens, accepted = self.spec
            drafts.inc(scheduler.new_spec_drafts)
            draft_tokens.inc(scheduler.new_spec_draft_tokens)
            accepted.inc(scheduler.new_spec_accepted_tokens)
            for slot, n in zip(self.spec_per_pos, per_pos, strict=True):
                slot.inc(n)

    def _copy_failover(self) -> None:
        """The failover counters into this process's slots."""
        if self.failover is None:
            return
        for field, family in self.failover_counts:
            for slot, value in zip(
                family.slots.values(), getattr(self.failover, field), strict=True
            ):
                slot.set(value)

    def _record_iteration(self, it: IterationStats) -> None:
        computed = it.num_prompt_tokens - it.num_cached_prompt_tokens
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
            self.prompt_tokens_cached.inc(it.num_cached_prompt_tokens)
            self.prompt_tokens_cached_by_source.child("device").inc(it.num_cached_prompt_tokens)
            self.prompt_tokens_by_source.child("local_compute").inc(computed)
            self.prompt_tokens_by_source.child("local_cache_hit").inc(it.num_cached_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        if computed or it.num_generation_tokens:
            self.iteration_tokens.observe(computed + it.num_generation_tokens)
        for field, histogram in self.per_iteration.items():
            histogram.observe_all(getattr(it, field))
        for req in it.finished_requests:
            self.request_success.child(req.finish_reason).inc()
            self.prefill_kv_computed.observe(req.num_prompt_tokens - req.num_cached_tokens)
            for field, histogram in self.per_request.items():
                value = getattr(req, field)
                if value is not None:  # max_tokens_param when the request set none
                    histogram.observe(value)

    def log(self) -> None:
        """Prometheus is scraped, not logged; the failover counters reach the other API
        processes' scrapes at least this often."""
        self._copy_failover()

    def token_totals(self) -> tuple[float, float]:
        """The prompt tokens computed and the tokens generated so far, by every process
        whose numbers this logger reports."""
        values = self.values.combined()
        computed = self.prompt_tokens_by_source.child("local_compute").index
        return float(values[computed]), float(values[self.generation_tokens.index])
