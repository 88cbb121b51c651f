"""`OtelMetrics`: the metrics hook for OpenTelemetry, on ``opentelemetry-api`` alone.

::

    from postgres_mutex.otel import OtelMetrics
    mutex = Mutex(dsn, "nightly-report", metrics=OtelMetrics())

Without an SDK the instruments are no-ops; with one, the application's meter
provider (or the one passed as ``meter_provider``) decides where the data goes.
Instrument names and units (`postgres_mutex.metric_names`) are chosen so that
the SDK's Prometheus exporter, or a Collector's, yields the same series names
as `PrometheusMetrics`: one dashboard serves both paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from . import metric_names as names
from ._metrics import HeldLocks, LockObservation, LockTableView, MetricsHook, WatchedLock
from ._version import __version__

__all__ = ["OtelMetrics"]

_Read = Callable[[WatchedLock], float]
_Callback = Callable[[CallbackOptions], Iterable[Observation]]


class OtelMetrics(MetricsHook):
    """Counters, histograms and gauges for every hook call, on an OpenTelemetry meter."""

    def __init__(self, meter_provider: MeterProvider | None = None) -> None:
        meter = metrics.get_meter("postgres_mutex", __version__, meter_provider)
        self._held = HeldLocks()
        self._view = LockTableView()

        def counter(metric: names.MetricName) -> metrics.Counter:
            return meter.create_counter(metric.otel, unit=metric.unit, description=metric.description)

        self._acquisitions = counter(names.ACQUISITIONS)
        self._releases = counter(names.RELEASES)
        self._contentions = counter(names.CONTENTIONS)
        self._reclaims = counter(names.STALE_RECLAIMS)
        self._alerts = counter(names.ALERTS)
        self._losses = counter(names.LOSSES)
        self._heartbeat_failures = counter(names.HEARTBEAT_FAILURES)
        self._watcher_errors = counter(names.WATCHER_ERRORS)
        self._heartbeat_duration = meter.create_histogram(
            names.HEARTBEAT_DURATION.otel,
            unit=names.HEARTBEAT_DURATION.unit,
            description=names.HEARTBEAT_DURATION.description,
            explicit_bucket_boundaries_advisory=list(names.HEARTBEAT_BUCKETS),
        )
        self._acquire_duration = meter.create_histogram(
            names.ACQUIRE_DURATION.otel,
            unit=names.ACQUIRE_DURATION.unit,
            description=names.ACQUIRE_DURATION.description,
            explicit_bucket_boundaries_advisory=list(names.WAIT_BUCKETS),
        )
        self._locks_held = meter.create_up_down_counter(
            names.LOCKS_HELD.otel, unit=names.LOCKS_HELD.unit, description=names.LOCKS_HELD.description
        )
        for metric, read in (
            (names.HEARTBEAT_AGE, lambda lock: lock.observation.seconds_since_heartbeat),
            (names.HELD_DURATION, lambda lock: lock.observation.seconds_held),
            (names.ALERTING, lambda lock: float(lock.observation.alerting)),
            (names.RECLAIMABLE, lambda lock: float(lock.observation.reclaimable)),
            (names.ALERT_THRESHOLD, lambda lock: lock.alert_threshold),
            (names.STALE_THRESHOLD, lambda lock: lock.stale_threshold),
        ):
            meter.create_observable_gauge(
                metric.otel, callbacks=[self._per_lock(read)], unit=metric.unit, description=metric.description
            )
        meter.create_observable_gauge(
            names.HOLDER_INFO.otel,
            callbacks=[self._holders],
            unit=names.HOLDER_INFO.unit,
            description=names.HOLDER_INFO.description,
        )
        meter.create_observable_gauge(
            names.WATCHER_UP.otel,
            callbacks=[self._watcher_up],
            unit=names.WATCHER_UP.unit,
            description=names.WATCHER_UP.description,
        )

    # -- the Mutex's calls ---------------------------------------------------

    def acquired(self, lock_name: str, *, instance_id: str) -> None:
        self._acquisitions.add(1, {"lock_name": lock_name})
        if self._held.add(lock_name, instance_id):
            self._locks_held.add(1, {"lock_name": lock_name})

    def released(self, lock_name: str, *, instance_id: str) -> None:
        self._releases.add(1, {"lock_name": lock_name})
        if self._held.discard(lock_name, instance_id):
            self._locks_held.add(-1, {"lock_name": lock_name})

    def lost(self, lock_name: str, *, instance_id: str, reason: str) -> None:
        self._losses.add(1, {"lock_name": lock_name})
        if self._held.discard(lock_name, instance_id):
            self._locks_held.add(-1, {"lock_name": lock_name})

    def contended(self, lock_name: str, *, instance_id: str) -> None:
        self._contentions.add(1, {"lock_name": lock_name})

    def stale_reclaimed(self, lock_name: str, *, instance_id: str, previous_holder: str) -> None:
        self._reclaims.add(1, {"lock_name": lock_name})

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        self._alerts.add(1, {"lock_name": lock_name})

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        self._heartbeat_duration.record(seconds, {"lock_name": lock_name})

    def heartbeat_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        self._heartbeat_failures.add(1, {"lock_name": lock_name})

    def acquire_wait(self, lock_name: str, *, instance_id: str, seconds: float, outcome: str) -> None:
        self._acquire_duration.record(seconds, {"lock_name": lock_name, "outcome": outcome})

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
        self._watcher_errors.add(1)
        self._view.failed()

    # -- gauges, read at collection time -----------------------------------------

    def _per_lock(self, read: _Read) -> _Callback:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            locks, _ = self._view.snapshot()
            return [Observation(read(lock), {"lock_name": lock.observation.lock_name}) for lock in locks]

        return observe

    def _holders(self, options: CallbackOptions) -> Iterable[Observation]:
        locks, _ = self._view.snapshot()
        return [
            Observation(1, {"lock_name": lock.observation.lock_name, "holder": lock.observation.holder})
            for lock in locks
        ]

    def _watcher_up(self, options: CallbackOptions) -> Iterable[Observation]:
        _, up = self._view.snapshot()
        return [] if up is None else [Observation(int(up))]
