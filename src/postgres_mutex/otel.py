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

from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from . import metric_names as names
from ._exporter import ExporterHook, WatchedLock, per_holder, permits_in_use, rwlock_holders, writers_waiting
from ._version import __version__

__all__ = ["OtelMetrics"]

_Read = Callable[[WatchedLock], float]
_Callback = Callable[[CallbackOptions], Iterable[Observation]]


class OtelMetrics(ExporterHook):
    """Counters, histograms and gauges for every hook call, on an OpenTelemetry meter."""

    def __init__(self, meter_provider: MeterProvider | None = None) -> None:
        super().__init__()
        meter = metrics.get_meter("postgres_mutex", __version__, meter_provider)
        self._counters = {
            metric: meter.create_counter(metric.otel, unit=metric.unit, description=metric.description)
            for metric in names.ALL
            if metric.kind == "counter"
        }
        self._histograms = {
            metric: meter.create_histogram(
                metric.otel,
                unit=metric.unit,
                description=metric.description,
                explicit_bucket_boundaries_advisory=list(buckets),
            )
            for metric, buckets in (
                (names.HEARTBEAT_DURATION, names.HEARTBEAT_BUCKETS),
                (names.ACQUIRE_DURATION, names.WAIT_BUCKETS),
                (names.ELECTION_TERM_DURATION, names.TERM_BUCKETS),
            )
        }
        self._locks_held = meter.create_up_down_counter(
            names.LOCKS_HELD.otel, unit=names.LOCKS_HELD.unit, description=names.LOCKS_HELD.description
        )
        self._levels = {
            metric: meter.create_up_down_counter(metric.otel, unit=metric.unit, description=metric.description)
            for metric in (names.ELECTION_CANDIDATES, names.ELECTION_LEADING, names.WAITERS)
        }
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
        for metric, callback in (
            (names.HOLDER_INFO, self._holders),
            (names.SESSION_ALIVE, self._sessions),
            (names.PERMITS_IN_USE, self._permits_in_use),
            (names.RWLOCK_HOLDERS, self._rwlock_holders),
            (names.RWLOCK_WRITER_WAITING, self._writers_waiting),
            (names.WATCHER_UP, self._watcher_up),
        ):
            meter.create_observable_gauge(
                metric.otel, callbacks=[callback], unit=metric.unit, description=metric.description
            )

    def _add(self, metric: names.MetricName, labels: dict[str, str]) -> None:
        self._counters[metric].add(1, labels)

    def _record(self, metric: names.MetricName, value: float, labels: dict[str, str]) -> None:
        self._histograms[metric].record(value, labels)

    def _held_changed(self, lock_name: str, delta: int) -> None:
        self._locks_held.add(delta, {"lock_name": lock_name})

    def _level(self, metric: names.MetricName, labels: dict[str, str], delta: int) -> None:
        self._levels[metric].add(delta, labels)

    # -- gauges, read at collection time -----------------------------------------

    def _per_lock(self, read: _Read) -> _Callback:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            locks, _ = self.view.snapshot()
            return [Observation(read(lock), lock.labels) for lock in per_holder(locks)]

        return observe

    def _holders(self, options: CallbackOptions) -> Iterable[Observation]:
        locks, _ = self.view.snapshot()
        return [Observation(1, {**lock.labels, "holder": lock.observation.holder}) for lock in per_holder(locks)]

    def _sessions(self, options: CallbackOptions) -> Iterable[Observation]:
        locks, _ = self.view.snapshot()
        return [
            Observation(int(lock.observation.session_alive), lock.labels)
            for lock in per_holder(locks)
            if lock.observation.session_alive is not None
        ]

    def _permits_in_use(self, options: CallbackOptions) -> Iterable[Observation]:
        locks, _ = self.view.snapshot()
        return [Observation(count, {"lock_name": name}) for name, count in permits_in_use(locks).items()]

    def _rwlock_holders(self, options: CallbackOptions) -> Iterable[Observation]:
        locks, _ = self.view.snapshot()
        counts = rwlock_holders(locks)
        return [Observation(count, {"lock_name": name, "mode": mode}) for (name, mode), count in counts.items()]

    def _writers_waiting(self, options: CallbackOptions) -> Iterable[Observation]:
        locks, _ = self.view.snapshot()
        return [Observation(waiting, {"lock_name": name}) for name, waiting in writers_waiting(locks).items()]

    def _watcher_up(self, options: CallbackOptions) -> Iterable[Observation]:
        _, up = self.view.snapshot()
        return [] if up is None else [Observation(int(up))]
