"""Gauges, counters and histograms whose numbers are slots of a `MetricValues`, exported as
prometheus-client exports its own. Updating one is an addition into a buffer (a counter of
prometheus-client takes a lock; its histogram scans its buckets): the inter-token latency
is observed for every token streamed. Updated and scraped on the event loop's thread only.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from minivllm.frontend.metrics.shared_values import Aggregate, MetricValues


class Slot:
    """One number of a gauge or a counter."""

    __slots__ = ("values", "index")

    def __init__(self, values: memoryview, index: int) -> None:
        self.values, self.index = values, index

    def inc(self, amount: float = 1.0) -> None:
        self.values[self.index] += amount

    def set(self, value: float) -> None:
        self.values[self.index] = value


class Family:
    """A gauge or counter: a slot per label set, all label sets given up front (a label set
    made later in one process would be missing from the others' files)."""

    def __init__(
        self,
        kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
        name: str,
        documentation: str,
        labels: dict[str, str],
        store: MetricValues,
        aggregate: Aggregate,
        key: str | None = None,
        key_values: Sequence[str] = (),
    ) -> None:
        """Without `key`, one series with `labels`; with it, one per value of label `key`
        (`child(value)`)."""
        self.kind, self.name, self.documentation = kind, name, documentation
        self.label_names = [*labels, *([key] if key else [])]
        sets = [[*labels.values(), v] for v in key_values] if key else [list(labels.values())]
        first = store.allocate(len(sets), aggregate)
        self.series = [(s, first + i) for i, s in enumerate(sets)]
        self.slots = {s[-1]: Slot(store.values, i) for s, i in self.series}

    def child(self, key_value: str) -> Slot:
        return self.slots[key_value]

    def only(self) -> Slot:
        ((_, slot),) = self.slots.items()
        return slot

    def collect(self, values: np.ndarray) -> Metric:
        family = self.kind(self.name, self.documentation, labels=self.label_names)
        for label_values, index in self.series:
            family.add_metric(label_values, float(values[index]))
        return family


class Histogram:
    """A histogram with one label set: a slot per bucket (the last above every bound) and
    one for the sum."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        buckets: Sequence[float],
        store: MetricValues,
    ) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = [float(b) for b in buckets]
        self.first = store.allocate(len(self.bounds) + 2, Aggregate.SUM)
        self.sum_index = self.first + len(self.bounds) + 1
        self.values = store.values

    def observe(self, value: float) -> None:
        values = self.values
        values[self.first + bisect.bisect_left(self.bounds, value)] += 1
        values[self.sum_index] += value

    def observe_all(self, observed: list[float]) -> None:
        """`observe` each value; a run of equal values (a step's inter-token latencies,
        mostly) is counted into its bucket at once."""
        values, bounds, first = self.values, self.bounds, self.first
        run_value, run = 0.0, 0
        for value in observed:
            if value == run_value and run:
                run += 1
                continue
            if run:
                values[first + bisect.bisect_left(bounds, run_value)] += run
            run_value, run = value, 1
        if run:
            values[first + bisect.bisect_left(bounds, run_value)] += run
            values[self.sum_index] += sum(observed)

    def collect(self, values: np.ndarray) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        counts = values[self.first : self.sum_index].tolist()
        bounds = [*map(str, self.bounds), "+Inf"]
        buckets = list(zip(bounds, itertools.accumulate(counts), strict=True))
        family.add_metric(list(self.labels.values()), buckets, float(values[self.sum_index]))
        return family


class SlotCollector(Collector):
    """Every series of one `MetricValues`, read once per scrape, after the `refresh`
    calls (those that copy numbers kept elsewhere into their slots)."""

    def __init__(self, store: MetricValues) -> None:
        self.store = store
        self.metrics: list[Family | Histogram] = []
        self.refresh: list[Callable[[], None]] = []

    def collect(self) -> Iterator[Metric]:
        for refresh in self.refresh:
            refresh()
        values = self.store.combined()
        for metric in self.metrics:
            yield metric.collect(values)
