"""Request timings from the engine-core output stream, the stats log line and the
Prometheus export, fed with hand-made outputs whose timestamps are known."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from minivllm.frontend.metrics.loggers import LoggingStatLogger
from minivllm.frontend.metrics.prometheus import PrometheusStatLogger, request_tokens_buckets
from minivllm.frontend.metrics.stats import IterationStats, SchedulerUpdate, StatsCollector
from minivllm.protocol.messages import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from minivllm.protocol.sampling_params import SamplingParams

T0 = 1_000_000.0


class Recorder:
    def __init__(self) -> None:
        self.scheduler: list[SchedulerUpdate] = []
        self.iterations: list[IterationStats] = []

    def record(self, scheduler, iteration) -> None:
        if scheduler is not None:
            self.scheduler.append(scheduler)
        if iteration is not None:
            self.iterations.append(iteration)

    def log(self) -> None:
        pass

    def finished(self):
        return [f for it in self.iterations for f in it.finished_requests]


def request(rid: str, n_prompt: int = 4, max_tokens: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(
        rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), arrival_time=T0
    )


def batch(ts: float, *outs: EngineCoreOutput, stats: SchedulerStats | None = None):
    return EngineCoreOutputs(outputs=list(outs), timestamp=ts, scheduler_stats=stats)


def test_timings_of_one_request() -> None:
    rec = Recorder()
    stats = StatsCollector([rec])
    stats.add_requests([request("a")])
    events = [
        EngineCoreEvent(EngineCoreEventType.QUEUED, T0 + 0.1),
        EngineCoreEvent(EngineCoreEventType.SCHEDULED, T0 + 0.2),
    ]
    stats.record(batch(T0 + 0.3, EngineCoreOutput("a", [5], num_cached_tokens=2, events=events)))
    stats.record(batch(T0 + 0.4, EngineCoreOutput("a", [6])))
    stats.record(batch(T0 + 0.6, EngineCoreOutput("a", [7], FinishReason.LENGTH)))
    first = rec.iterations[0]
    assert first.num_prompt_tokens == 4 and first.num_cached_prompt_tokens == 2
    assert len(first.time_to_first_tokens) == 1 and first.time_to_first_tokens[0] > 0
    itls = [x for it in rec.iterations for x in it.inter_token_latencies]
    assert itls == pytest.approx([0.1, 0.2])
    (done,) = rec.finished()
    assert done.finish_reason == "length" and done.num_generation_tokens == 3
    assert done.queued_time == pytest.approx(0.1)
    assert done.prefill_time == pytest.approx(0.1)
    assert done.decode_time == pytest.approx(0.3)
    assert done.inference_time == pytest.approx(0.4)
    assert done.mean_time_per_output_token == pytest.approx(0.15)
    assert done.num_cached_tokens == 2 and done.num_prompt_tokens == 4
    assert rec.iterations[-1].n_params == [1]
    assert rec.iterations[-1].max_num_generation_tokens == [3]
    assert not stats.requests


def test_stop_strings_aborts_and_unknown_requests() -> None:
    rec = Recorder()
    stats = StatsCollector([rec])
    stats.add_requests([request("0_p"), request("1_p")])  # one user request, n = 2
    stats.add_requests([request("b")])
    stats.record(batch(T0 + 1, EngineCoreOutput("0_p", [5]), EngineCoreOutput("other", [9])))
    stats.record(batch(T0 + 2, EngineCoreOutput("0_p", [6])), ended_here=["0_p"])
    assert [f.finish_reason for f in rec.finished()] == ["stop"]
    assert rec.iterations[-1].n_params == []  # its sibling still runs
    stats.abort(["1_p", "b", "never-added"])
    assert [f.finish_reason for f in rec.finished()] == ["stop", "abort", "abort"]
    assert rec.iterations[-1].n_params == [2, 1]
    assert rec.iterations[-1].max_num_generation_tokens == [2, 0]
    assert sum(it.num_generation_tokens for it in rec.iterations) == 2  # "other" is not ours


def test_scheduler_counters_become_increments() -> None:
    rec = Recorder()
    stats = StatsCollector([rec])
    snap = SchedulerStats(3, 1, 0.5, prefix_cache_queries=100, prefix_cache_hits=40)
    stats.record(batch(T0, stats=snap))
    stats.record_scheduler_stats(
        SchedulerStats(0, 0, 0.0, prefix_cache_queries=150, prefix_cache_hits=40, num_preemptions=2)
    )
    stats.record_scheduler_stats(SchedulerStats(0, 0, 0.0, prefix_cache_queries=10))  # restarted
    first, second, third = rec.scheduler
    assert (first.num_running, first.num_waiting, first.kv_cache_usage) == (3, 1, 0.5)
    assert (first.new_prefix_cache_queries, first.new_prefix_cache_hits) == (100, 40)
    assert (second.new_prefix_cache_queries, second.new_preemptions) == (50, 2)
    assert third.new_prefix_cache_queries == 10


def test_log_line_in_vllms_form(caplog: pytest.LogCaptureFixture) -> None:
    log = LoggingStatLogger("GPU")
    log.record(
        SchedulerUpdate(
            2, 1, 0.125, new_prefix_cache_queries=200, new_prefix_cache_hits=50, new_preemptions=0
        ),
        IterationStats(
            T0, num_generation_tokens=40, num_prompt_tokens=30, num_cached_prompt_tokens=10
        ),
    )
    with caplog.at_level(logging.INFO, logger="minivllm.stats"):
        log.log()
    (record,) = caplog.records
    line = record.getMessage()
    assert record.levelno == logging.INFO
    assert line.startswith("Engine 000: Avg prompt throughput: ")
    assert "tokens/s, Avg generation throughput: " in line
    assert line.endswith(
        "Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 25.0%"
    )
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="minivllm.stats"):
        log.log()  # throughput in this interval is 0, but not in the previous: still INFO
        log.log()  # idle twice: DEBUG only
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.DEBUG]


def test_prometheus_names_labels_and_buckets() -> None:
    prom = PrometheusStatLogger("my-model", max_model_len=1000)
    stats = StatsCollector([prom])
    stats.add_requests([request("a", max_tokens=2)])
    snap = SchedulerStats(1, 0, 0.25, prefix_cache_queries=4, prefix_cache_hits=0)
    stats.record(batch(T0 + 0.2, EngineCoreOutput("a", [5]), stats=snap))
    stats.record(batch(T0 + 0.3, EngineCoreOutput("a", [6], FinishReason.STOP)))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(prom.registry).decode())
        for s in family.samples
    }
    labels = (("engine", "0"), ("model_name", "my-model"))
    assert samples[("vllm:num_requests_running", labels)] == 1
    assert samples[("vllm:kv_cache_usage_perc", labels)] == 0.25
    assert samples[("vllm:prompt_tokens_total", labels)] == 4
    assert samples[("vllm:generation_tokens_total", labels)] == 2
    assert samples[("vllm:prefix_cache_queries_total", labels)] == 4
    stop = (("engine", "0"), ("finished_reason", "stop"), ("model_name", "my-model"))
    assert samples[("vllm:request_success_total", stop)] == 1
    assert samples[("vllm:inter_token_latency_seconds_count", labels)] == 1
    assert samples[("vllm:e2e_request_latency_seconds_count", labels)] == 1
    buckets = sorted(
        float(dict(k[1])["le"]) for k in samples if k[0] == "vllm:request_prompt_tokens_bucket"
    )
    assert buckets == [*request_tokens_buckets(1000), float("inf")]
    assert request_tokens_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert any(n.startswith("process_") for n, _ in samples)  # the default collectors too


def test_api_processes_report_one_engine(tmp_path) -> None:
    """Two API processes' loggers over one directory: what each counted adds up, the
    engine's state is the latest report, its cumulative counters are not counted twice."""

    def scrape(prom: PrometheusStatLogger) -> dict:
        text = generate_latest(prom.registry).decode()
        return {
            (s.name, s.labels.get("finished_reason")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    first, second = (PrometheusStatLogger("m", 1000, shared_dir=str(tmp_path)) for _ in "ab")
    collectors = [StatsCollector([first]), StatsCollector([second])]
    for stats, rid, tokens in zip(collectors, "ab", ([5, 6], [7, 8, 9]), strict=True):
        stats.add_requests([request(rid, max_tokens=len(tokens))])
        snap = SchedulerStats(2, 0, 0.5, prefix_cache_queries=8)
        stats.record(batch(T0 + 0.2, EngineCoreOutput(rid, tokens[:1]), stats=snap))
        stats.record(batch(T0 + 0.3, EngineCoreOutput(rid, tokens[1:], FinishReason.LENGTH)))
    # the first process hears last that the engine is idle now
    collectors[0].record_scheduler_stats(SchedulerStats(0, 0, 0.0, prefix_cache_queries=8))
    for prom in (first, second):  # either one answers the scrape the same
        samples = scrape(prom)
        assert samples[("vllm:generation_tokens_total", None)] == 5
        assert samples[("vllm:request_success_total", "length")] == 2
        assert samples[("vllm:prompt_tokens_total", None)] == 8
        assert samples[("vllm:e2e_request_latency_seconds_count", None)] == 2
        assert samples[("vllm:num_requests_running", None)] == 0
        assert samples[("vllm:prefix_cache_queries_total", None)] == 8
        assert not any(name.startswith("process_") for name, _ in samples)
    assert first.token_totals() == (8.0, 5.0)
    assert len(list(tmp_path.iterdir())) == 2


def test_api_processes_report_failover_and_speculation_once(tmp_path) -> None:
    """Each API process's data-parallel client counts the same engine-core death and hears
    the engine's cumulative draft counts; the requests each moved are its own. Either
    process's scrape: the death once, the moves summed, the drafts not counted twice."""
    from minivllm.frontend.clients.dp_failover import FailoverStats

    def scrape(prom: PrometheusStatLogger) -> dict:
        text = generate_latest(prom.registry).decode()
        return {
            (s.name, s.labels.get("engine"), s.labels.get("position")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    failover = [FailoverStats(2), FailoverStats(2)]
    loggers = [
        PrometheusStatLogger("m", 64, failover=f, shared_dir=str(tmp_path)) for f in failover
    ]
    for f, moved, failed in zip(failover, (3, 2), (1, 0), strict=True):
        f.deaths[1], f.moved[1], f.failed[1] = 1, moved, failed
    speculating = {"spec_num_draft_tokens": 30, "spec_num_accepted_tokens": 18}
    for prom, drafts, first_pos in zip(loggers, (10, 12), (9, 11), strict=True):
        stats = SchedulerStats(1, 0, 0.1, spec_num_drafts=drafts, **speculating)
        stats.spec_num_accepted_tokens_per_pos = [first_pos, 6]
        StatsCollector([prom]).record(EngineCoreOutputs(scheduler_stats=stats, timestamp=T0))
    for prom in loggers:
        samples = scrape(prom)
        assert samples[("vllm:engine_core_deaths_total", "1", None)] == 1
        assert samples[("vllm:engine_core_deaths_total", "0", None)] == 0
        assert samples[("vllm:engine_core_requests_moved_total", "1", None)] == 5
        assert samples[("vllm:engine_core_requests_failed_total", "1", None)] == 1
        assert samples[("vllm:spec_decode_num_drafts_total", "0", None)] == 12
        assert samples[("vllm:spec_decode_num_draft_tokens_total", "0", None)] == 30
        per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        assert [samples[(per_pos, "0", str(i))] for i in range(2)] == [11, 6]
    failover[0].moved[1] += 4  # a scrape reads its own process's counts as they are now
    assert scrape(loggers[0])[("vllm:engine_core_requests_moved_total", "1", None)] == 9


def test_a_histogram_counts_a_batch_as_each_value_alone() -> None:
    from minivllm.frontend.metrics.series import Histogram
    from minivllm.frontend.metrics.shared_values import MetricValues

    observed = [0.02, 0.02, 0.02, 0.3, 0.3, 0.02, 7.0, 100.0, 0.0]  # runs, a repeat, the ends
    one, batch = MetricValues(), MetricValues()
    by_one = Histogram("h", "", {}, (0.01, 0.05, 0.5, 10.0), one)
    by_batch = Histogram("h", "", {}, (0.01, 0.05, 0.5, 10.0), batch)
    for value in observed:
        by_one.observe(value)
    by_batch.observe_all(observed)
    by_batch.observe_all([])
    assert one.combined().tolist() == batch.combined().tolist()
    assert batch.combined()[by_batch.first : by_batch.sum_index].tolist() == [1, 4, 2, 1, 1]
