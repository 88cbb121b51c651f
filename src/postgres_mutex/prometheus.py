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

from collections.abc import Iterator, Sequence

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("PrometheusMetrics needs prometheus-client: pip install 'postgres-mutex[prometheus]'") from exc

from . import metric_names as names
from ._metrics import HeldLocks, LockObservation, LockTableView, MetricsHook

__all__ = ["PrometheusMetrics"]


def _base(metric: names.MetricName) -> str:
    # prometheus_client appends _total to counters itself.
    return metric.prometheus.removesuffix("_total")


class PrometheusMetrics(MetricsHook):
    """Counters, histograms and gauges for every hook call, on ``registry`` (default: the global one)."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self._held = HeldLocks()
        self._view = LockTableView()

        def counter(metric: names.MetricName) -> Counter:
            return Counter(_base(metric), metric.description, metric.labels, registry=registry)

        self._acquisitions = counter(names.ACQUISITIONS)
        self._releases = counter(names.RELEASES)
        self._contentions = counter(names.CONTENTIONS)
        self._reclaims = counter(names.STALE_RECLAIMS)
        self._alerts = counter(names.ALERTS)
        self._losses = counter(names.LOSSES)
        self._heartbeat_failures = counter(names.HEARTBEAT_FAILURES)
        self._watcher_errors = counter(names.WATCHER_ERRORS)
        self._heartbeat_duration = Histogram(
            names.HEARTBEAT_DURATION.prometheus,
            names.HEARTBEAT_DURATION.description,
            names.HEARTBEAT_DURATION.labels,
            buckets=names.HEARTBEAT_BUCKETS,
            registry=registry,
        )
        self._acquire_duration = Histogram(
            names.ACQUIRE_DURATION.prometheus,
            names.ACQUIRE_DURATION.description,
            names.ACQUIRE_DURATION.labels,
            buckets=names.WAIT_BUCKETS,
            registry=registry,
        )
        self._locks_held = Gauge(
            names.LOCKS_HELD.prometheus, names.LOCKS_HELD.description, names.LOCKS_HELD.labels, registry=registry
        )
        if registry is not None:
            registry.register(_WatchedLocksCollector(self._view))

    # -- the Mutex's calls ---------------------------------------------------

    def acquired(self, lock_name: str, *, instance_id: str) -> None:
        self._acquisitions.labels(lock_name).inc()
        if self._held.add(lock_name, instance_id):
            self._locks_held.labels(lock_name).inc()

    def released(self, lock_name: str, *, instance_id: str) -> None:
        self._releases.labels(lock_name).inc()
        if self._held.discard(lock_name, instance_id):
            self._locks_held.labels(lock_name).dec()

    def lost(self, lock_name: str, *, instance_id: str, reason: str) -> None:
        self._losses.labels(lock_name).inc()
        if self._held.discard(lock_name, instance_id):
            self._locks_held.labels(lock_name).dec()

    def contended(self, lock_name: str, *, instance_id: str) -> None:
        self._contentions.labels(lock_name).inc()

    def stale_reclaimed(self, lock_name: str, *, instance_id: str, previous_holder: str) -> None:
        self._reclaims.labels(lock_name).inc()

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        self._alerts.labels(lock_name).inc()

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        self._heartbeat_duration.labels(lock_name).observe(seconds)

    def heartbeat_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        self._heartbeat_failures.labels(lock_name).inc()

    def acquire_wait(self, lock_name: str, *, instance_id: str, seconds: float, outcome: str) -> None:
        self._acquire_duration.labels(lock_name, outcome).observe(seconds)

    # -- a watcher's calls ---------------------------------------------------

    def observed(
        self,
        observations: Sequence[LockObservation],
        *,
        watched: frozenset[str] | None,
        alert_threshold: float,
        stale_threshold: float,
    ) -> None:
        self._view.update(
            observations, watched=watched, alert_threshold=alert_threshold, stale_threshold=stale_threshold
        )

    def watcher_failed(self, *, error: BaseException) -> None:
        self._watcher_errors.inc()
        self._view.failed()


class _WatchedLocksCollector(Collector):
    """The watcher's per-lock gauges, computed from its last read at each scrape."""

    def __init__(self, view: LockTableView) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        locks, up = self._view.snapshot()

        def family(metric: names.MetricName) -> GaugeMetricFamily:
            return GaugeMetricFamily(metric.prometheus, metric.description, labels=metric.labels)

        age, held, holder = family(names.HEARTBEAT_AGE), family(names.HELD_DURATION), family(names.HOLDER_INFO)
        alerting, reclaimable = family(names.ALERTING), family(names.RECLAIMABLE)
        alert_threshold, stale_threshold = family(names.ALERT_THRESHOLD), family(names.STALE_THRESHOLD)
        for lock in locks:
            seen = lock.observation
            label = [seen.lock_name]
            age.add_metric(label, seen.seconds_since_heartbeat)
            held.add_metric(label, seen.seconds_held)
            holder.add_metric([seen.lock_name, seen.holder], 1.0)
            alerting.add_metric(label, float(seen.alerting))
            reclaimable.add_metric(label, float(seen.reclaimable))
            alert_threshold.add_metric(label, lock.alert_threshold)
            stale_threshold.add_metric(label, lock.stale_threshold)
        yield from (age, held, holder, alerting, reclaimable, alert_threshold, stale_threshold)
        if up is not None:
            yield GaugeMetricFamily(names.WATCHER_UP.prometheus, names.WATCHER_UP.description, value=float(up))
