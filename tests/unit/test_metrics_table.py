"""The metrics hook's two protocols, and the tables that map its calls onto the exported series.

A hook written for the README's six calls is a `MetricsHook` and keeps working; the rest is
`ExtendedMetricsHook`, optional. A new metric is its event, its entry in `metric_names` and one
line of `_observe.exporter`'s tables: neither exporter names a metric, which these tests check by adding
one and reading it from both.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry

import postgres_mutex
from postgres_mutex import ExtendedMetricsHook, LockObservation, MetricsHook, metric_names
from postgres_mutex._observe import exporter
from postgres_mutex._observe.hooks import CORE_METHODS, HOOK_METHODS, guard
from postgres_mutex.otel import OtelMetrics
from postgres_mutex.prometheus import PrometheusMetrics

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(postgres_mutex.__file__).parent

README_SIX = {"acquired", "released", "contended", "stale_reclaimed", "alert", "heartbeat_latency"}
"""The calls the README's contract lists (0.1.0's ``MetricsHook``)."""


class SixCalls:
    """A hook written from the README: the six calls with their 0.1.0 signatures, nothing else."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, object]]] = []

    def acquired(self, lock_name: str, *, instance_id: str) -> None:
        self.calls.append(("acquired", {"lock_name": lock_name, "instance_id": instance_id}))

    def released(self, lock_name: str, *, instance_id: str) -> None:
        self.calls.append(("released", {"lock_name": lock_name}))

    def contended(self, lock_name: str, *, instance_id: str) -> None:
        self.calls.append(("contended", {"lock_name": lock_name}))

    def stale_reclaimed(self, lock_name: str, *, instance_id: str, previous_holder: str) -> None:
        self.calls.append(("stale_reclaimed", {"previous_holder": previous_holder}))

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        self.calls.append(("alert", {"holder": holder}))

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        self.calls.append(("heartbeat_latency", {"seconds": seconds}))


def test_metrics_hook_is_the_readmes_six_calls_and_the_rest_are_an_optional_extension() -> None:
    assert CORE_METHODS == README_SIX
    assert {name for name in vars(MetricsHook) if not name.startswith("_")} == README_SIX
    assert README_SIX < HOOK_METHODS
    extended = {name for name in dir(ExtendedMetricsHook) if not name.startswith("_")}
    assert extended == HOOK_METHODS, "ExtendedMetricsHook lists every call the library makes"
    assert isinstance(SixCalls(), MetricsHook), "a hook written from the README satisfies the contract"
    assert not isinstance(SixCalls(), ExtendedMetricsHook)


def test_a_hook_with_only_the_six_calls_gets_them_and_the_optional_calls_are_skipped() -> None:
    hook = SixCalls()
    guarded = guard(hook)
    guarded.acquired("job", instance_id="a", token=7)  # token: only to hooks that take it
    guarded.stale_reclaimed("job", instance_id="a", previous_holder="b", token=8, reason="disconnected", mode="read")
    for method in sorted(HOOK_METHODS - README_SIX):
        assert callable(getattr(guarded, method)), method
    guarded.lost("job", instance_id="a", reason="gone")
    guarded.election_started("job", instance_id="a")
    guarded.watcher_failed(error=RuntimeError("no table"))
    assert hook.calls == [
        ("acquired", {"lock_name": "job", "instance_id": "a"}),
        ("stale_reclaimed", {"previous_holder": "b"}),
    ]


def _hook_parameters(method: str) -> set[str]:
    return set(inspect.signature(getattr(ExtendedMetricsHook, method)).parameters) - {"self"}


def test_each_table_line_is_a_hook_call_whose_arguments_label_its_metric() -> None:
    for method, action in exporter.ON_CALL:
        assert method in HOOK_METHODS, f"ON_CALL: {method!r} is no hook call"
        if isinstance(action, exporter.Watch):
            continue
        missing = set(action.metric.labels) - _hook_parameters(method)
        assert not missing, f"ON_CALL: {method} has no argument for {action.metric.otel}'s labels {missing}"
        if isinstance(action, exporter.Record):
            assert action.value in _hook_parameters(method), f"ON_CALL: {method} has no {action.value!r}"


def test_every_metric_is_exported_by_exactly_one_kind_of_table_line() -> None:
    """Counters, histograms and up-down gauges by `ON_CALL`, the watcher's gauges by `GAUGES`; nothing else."""
    defined = {value for value in vars(metric_names).values() if isinstance(value, metric_names.MetricName)}
    assert defined == set(metric_names.ALL), "every metric defined in metric_names is in its ALL"
    moved = {action.metric for _, action in exporter.ON_CALL if not isinstance(action, exporter.Watch)}
    for metric in metric_names.ALL:
        gauge = metric.kind == "gauge"
        assert (metric in exporter.GAUGES) == gauge, f"{metric.otel}: a {metric.kind}, read by GAUGES?"
        assert (metric in moved) != gauge, f"{metric.otel}: a {metric.kind}, moved by ON_CALL?"
        assert (metric.kind == "histogram") == bool(metric.buckets), f"{metric.otel}: buckets only on a histogram"


@pytest.mark.parametrize("module", ["prometheus.py", "otel.py"])
def test_neither_exporter_names_a_metric(module: str) -> None:
    """Each makes its instruments from `metric_names.ALL` by kind: no metric's line is written twice."""
    tree = ast.parse((PACKAGE / module).read_text())
    named = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "names"
    }
    assert named <= {"ALL", "MetricName"}, f"{module} names metrics itself: {sorted(named - {'ALL', 'MetricName'})}"


NEW_COUNTER = metric_names.MetricName(
    "postgres_mutex.test.confirmations", "counter", "{hold}", "Holds in doubt that a heartbeat confirmed."
)
NEW_GAUGE = metric_names.MetricName(
    "postgres_mutex.test.longest_held", "gauge", "s", "The longest a watched holder has held its lock.", ()
)


def test_a_new_metric_is_its_name_and_one_table_line_and_both_exporters_emit_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metric_names, "ALL", (*metric_names.ALL, NEW_COUNTER, NEW_GAUGE))
    monkeypatch.setattr(exporter, "ON_CALL", (*exporter.ON_CALL, ("hold_confirmed", exporter.Count(NEW_COUNTER))))
    monkeypatch.setitem(
        exporter.GAUGES,
        NEW_GAUGE,
        lambda locks, up: [({}, max(lock.observation.seconds_held for lock in locks))] if locks else [],
    )
    registry = CollectorRegistry()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    seen = LockObservation(
        "job", "b", seconds_since_heartbeat=1.0, seconds_held=42.0, alerting=False, reclaimable=False
    )
    for hook in (PrometheusMetrics(registry), OtelMetrics(meter_provider=provider)):
        guarded = guard(hook)  # as the library calls it
        guarded.hold_confirmed("job", instance_id="a", seconds_in_doubt=0.5)
        guarded.observed([seen], watched=None, alert_threshold=30.0, stale_threshold=600.0)

    assert registry.get_sample_value("postgres_mutex_test_confirmations_total", {"lock_name": "job"}) == 1
    assert registry.get_sample_value("postgres_mutex_test_longest_held_seconds") == 42.0
    data = reader.get_metrics_data()
    assert data is not None
    points = {
        metric.name: [
            (dict(point.attributes or {}), getattr(point, "value", None)) for point in metric.data.data_points
        ]
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert points["postgres_mutex.test.confirmations"] == [({"lock_name": "job"}, 1)]
    assert points["postgres_mutex.test.longest_held"] == [({}, 42.0)]


def test_the_observability_page_shows_every_hook_call() -> None:
    page = (ROOT / "docs" / "observability.md").read_text()
    missing = sorted(method for method in HOOK_METHODS if f"def {method}(" not in page)
    assert missing == [], "docs/observability.md's 'Your own hook' lists every call a hook may implement"
