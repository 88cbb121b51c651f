"""`PrometheusMetrics`: the metrics hook for ``prometheus-client`` (extra ``prometheus``).

::

    from postgres_mutex.prometheus import PrometheusMetrics
    mutex = Mutex(dsn, "nightly-report", metrics=PrometheusMetrics())

Series names and labels are those of `postgres_mutex.metric_names`, the same
an OpenTelemetry SDK produces through its Prometheus exporter, so the bundled
dashboard and alert rules serve both. The watcher's per-lock gauges are
computed at scrape time by a collector, from what the watcher last read.
Nothing registers at import; pass ``registry=`` to keep tests (or several
exporters) apart.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import ClassVar

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("PrometheusMetrics needs prometheus-client: pip install 'postgres-mutex[prometheus]'") from exc

from . import metric_names as names
from ._observe.exporter import GAUGES, ExporterHook, LockTableView

__all__ = ["PrometheusMetrics"]


def _base(metric: names.MetricName) -> str:
    # prometheus_client appends _total to counters itself.
    return metric.prometheus.removesuffix("_total")


class PrometheusMetrics(ExporterHook):
    """Counters, histograms and gauges for every hook call, on ``registry`` (default: the global one).

    One per registry: ``PrometheusMetrics()`` again (say, for another Mutex)
    returns the same instance, since a registry holds each series once.
    ``registry=None`` registers nothing (each call then makes a new one).
    """

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, PrometheusMetrics]] = (
        weakref.WeakKeyDictionary()
    )
    _by_registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __new__(cls, registry: CollectorRegistry | None = REGISTRY) -> PrometheusMetrics:
        if registry is None:
            return super().__new__(cls)
        with cls._by_registry_lock:
            existing = cls._by_registry.get(registry)
            if existing is None:
                existing = cls._by_registry[registry] = super().__new__(cls)
            return existing

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        with self._by_registry_lock:
            if getattr(self, "_counters", None) is None:  # not the registry's existing instance
                self._setup(registry)

    def _setup(self, registry: CollectorRegistry | None) -> None:
        super().__init__()
        self._counters: dict[names.MetricName, Counter] = {}
        self._histograms: dict[names.MetricName, Histogram] = {}
        self._levels: dict[names.MetricName, Gauge] = {}
        for metric in names.ALL:
            if metric.kind == "counter":
                self._counters[metric] = Counter(_base(metric), metric.description, metric.labels, registry=registry)
            elif metric.kind == "histogram":
                self._histograms[metric] = Histogram(
                    metric.prometheus, metric.description, metric.labels, buckets=metric.buckets, registry=registry
                )
            elif metric.kind == "updowncounter":
                self._levels[metric] = Gauge(metric.prometheus, metric.description, metric.labels, registry=registry)
        if registry is not None:
            registry.register(_WatchedLocksCollector(self.view))

    def _add(self, metric: names.MetricName, labels: dict[str, str]) -> None:
        counter = self._counters[metric]
        (counter.labels(**labels) if labels else counter).inc()

    def _record(self, metric: names.MetricName, value: float, labels: dict[str, str]) -> None:
        histogram = self._histograms[metric]
        (histogram.labels(**labels) if labels else histogram).observe(value)

    def _level(self, metric: names.MetricName, labels: dict[str, str], delta: int) -> None:
        gauge = self._levels[metric]
        (gauge.labels(**labels) if labels else gauge).inc(delta)


class _WatchedLocksCollector(Collector):
    """The watcher gauges (`GAUGES`), computed from its last read at each scrape."""

    def __init__(self, view: LockTableView) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        locks, up = self._view.snapshot()
        for metric, read in GAUGES.items():
            samples = list(read(locks, up))
            if not samples:
                continue  # nothing to state (no watcher has reported 'up'), rather than something stale
            family = GaugeMetricFamily(metric.prometheus, metric.description, labels=metric.labels)
            for labels, value in samples:
                family.add_metric([labels[label] for label in metric.labels], float(value))
            yield family
