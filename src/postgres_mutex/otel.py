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
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, MeterProvider, Observation, UpDownCounter

from . import metric_names as names
from ._observe.exporter import GAUGES, ExporterHook, Read
from ._version import __version__

__all__ = ["OtelMetrics"]

_Callback = Callable[[CallbackOptions], Iterable[Observation]]


class OtelMetrics(ExporterHook):
    """Counters, histograms and gauges for every hook call, on an OpenTelemetry meter."""

    def __init__(self, meter_provider: MeterProvider | None = None) -> None:
        super().__init__()
        meter = metrics.get_meter("postgres_mutex", __version__, meter_provider)
        self._counters: dict[names.MetricName, Counter] = {}
        self._histograms: dict[names.MetricName, Histogram] = {}
        self._levels: dict[names.MetricName, UpDownCounter] = {}
        for metric in names.ALL:
            if metric.kind == "counter":
                self._counters[metric] = meter.create_counter(
                    metric.otel, unit=metric.unit, description=metric.description
                )
            elif metric.kind == "histogram":
                self._histograms[metric] = meter.create_histogram(
                    metric.otel,
                    unit=metric.unit,
                    description=metric.description,
                    explicit_bucket_boundaries_advisory=list(metric.buckets),
                )
            elif metric.kind == "updowncounter":
                self._levels[metric] = meter.create_up_down_counter(
                    metric.otel, unit=metric.unit, description=metric.description
                )
            else:
                meter.create_observable_gauge(
                    metric.otel,
                    callbacks=[self._observe(GAUGES[metric])],
                    unit=metric.unit,
                    description=metric.description,
                )

    def _add(self, metric: names.MetricName, labels: dict[str, str]) -> None:
        self._counters[metric].add(1, labels)

    def _record(self, metric: names.MetricName, value: float, labels: dict[str, str]) -> None:
        self._histograms[metric].record(value, labels)

    def _level(self, metric: names.MetricName, labels: dict[str, str], delta: int) -> None:
        self._levels[metric].add(delta, labels)

    def _observe(self, read: Read) -> _Callback:
        """The callback of a watcher gauge: `GAUGES`' reading of what the watcher last saw."""

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            locks, up = self.view.snapshot()
            return [Observation(value, labels) for labels, value in read(locks, up)]

        return observe
