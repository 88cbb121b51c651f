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
from ._exporter import ExporterHook, LockTableView, per_holder, permits_in_use, rwlock_holders, writers_waiting

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
        self._counters = {
            metric: Counter(_base(metric), metric.description, metric.labels, registry=registry)
            for metric in names.ALL
            if metric.kind == "counter"
        }
        self._histograms = {
            metric: Histogram(metric.prometheus, metric.description, metric.labels, buckets=buckets, registry=registry)
            for metric, buckets in (
                (names.HEARTBEAT_DURATION, names.HEARTBEAT_BUCKETS),
                (names.ACQUIRE_DURATION, names.WAIT_BUCKETS),
                (names.ELECTION_TERM_DURATION, names.TERM_BUCKETS),
            )
        }
        self._locks_held = Gauge(
            names.LOCKS_HELD.prometheus, names.LOCKS_HELD.description, names.LOCKS_HELD.labels, registry=registry
        )
        self._levels = {
            metric: Gauge(metric.prometheus, metric.description, metric.labels, registry=registry)
            for metric in (names.ELECTION_CANDIDATES, names.ELECTION_LEADING, names.WAITERS)
        }
        if registry is not None:
            registry.register(_WatchedLocksCollector(self.view))

    def _add(self, metric: names.MetricName, labels: dict[str, str]) -> None:
        counter = self._counters[metric]
        (counter.labels(**labels) if labels else counter).inc()

    def _record(self, metric: names.MetricName, value: float, labels: dict[str, str]) -> None:
        self._histograms[metric].labels(**labels).observe(value)

    def _held_changed(self, lock_name: str, delta: int) -> None:
        self._locks_held.labels(lock_name).inc(delta)

    def _level(self, metric: names.MetricName, labels: dict[str, str], delta: int) -> None:
        self._levels[metric].labels(**labels).inc(delta)


class _WatchedLocksCollector(Collector):
    """The watcher's per-lock gauges, computed from its last read at each scrape."""

    def __init__(self, view: LockTableView) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        locks, up = self._view.snapshot()

        def family(metric: names.MetricName) -> GaugeMetricFamily:
            return GaugeMetricFamily(metric.prometheus, metric.description, labels=metric.labels)

        age, held, holder = family(names.HEARTBEAT_AGE), family(names.HELD_DURATION), family(names.HOLDER_INFO)
        alerting, reclaimable, session = family(names.ALERTING), family(names.RECLAIMABLE), family(names.SESSION_ALIVE)
        alert_threshold, stale_threshold = family(names.ALERT_THRESHOLD), family(names.STALE_THRESHOLD)
        in_use, rw_holders, rw_waiting = (
            family(names.PERMITS_IN_USE),
            family(names.RWLOCK_HOLDERS),
            family(names.RWLOCK_WRITER_WAITING),
        )
        for lock in per_holder(locks):
            seen = lock.observation
            label = list(lock.labels.values())
            age.add_metric(label, seen.seconds_since_heartbeat)
            held.add_metric(label, seen.seconds_held)
            holder.add_metric([*label, seen.holder], 1.0)
            alerting.add_metric(label, float(seen.alerting))
            reclaimable.add_metric(label, float(seen.reclaimable))
            if seen.session_alive is not None:
                session.add_metric(label, float(seen.session_alive))
            alert_threshold.add_metric(label, lock.alert_threshold)
            stale_threshold.add_metric(label, lock.stale_threshold)
        for semaphore, count in permits_in_use(locks).items():
            in_use.add_metric([semaphore], float(count))
        for (rwlock, mode), count in rwlock_holders(locks).items():
            rw_holders.add_metric([rwlock, mode], float(count))
        for rwlock, waiting in writers_waiting(locks).items():
            rw_waiting.add_metric([rwlock], float(waiting))
        yield from (age, held, holder, alerting, reclaimable, session, alert_threshold, stale_threshold)
        yield from (in_use, rw_holders, rw_waiting)
        if up is not None:
            yield GaugeMetricFamily(names.WATCHER_UP.prometheus, names.WATCHER_UP.description, value=float(up))
