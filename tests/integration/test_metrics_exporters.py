"""PrometheusMetrics and OtelMetrics: every hook call becomes a series a dashboard can use.

The two paths must produce the same series names: the test runs one workload
through both (OpenTelemetry via the SDK's own Prometheus exporter) and
compares what each exposes.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from postgres_mutex import (
    DatabaseError,
    Election,
    FanOutMetrics,
    Leadership,
    LockAcquisitionTimeout,
    LockNotHeldError,
    Mutex,
    RWLock,
    Semaphore,
    metric_names,
)
from postgres_mutex.otel import OtelMetrics
from postgres_mutex.prometheus import PrometheusMetrics
from postgres_mutex.watcher import StaleWatcher
from tests.support.faultproxy import FaultProxy
from tests.support.fixtures import FAST, freeze, frozen_holder, thaw, wait_until


def run_workload(make_mutex: Callable[..., Mutex], dsn: str, hook: object, lock_name: str, admin: Any) -> None:
    """Acquire, contend, time out, reclaim a silent holder, lose a lock, and watch the table."""
    holder, contender = make_mutex(metrics=hook), make_mutex(metrics=hook)
    with holder.acquire():
        holder.heartbeat()
        with contender.acquire() as acquired:
            assert not acquired
    with frozen_holder(holder), contender.acquire(blocking=True, timeout=10):
        pass
    loser = make_mutex(metrics=hook)
    with pytest.raises(LockNotHeldError), loser.acquire():
        admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
        wait_until(lambda: not loser.held)
    slow = make_mutex(metrics=hook, operation_timeout=0.2)
    with slow.acquire(), psycopg.connect(dsn) as blocker:
        # Another session holds the row: the heartbeat cannot renew it.
        blocker.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s FOR UPDATE", (lock_name,))
        with pytest.raises(DatabaseError, match="another session holds its row locked"):
            slow.heartbeat()
        blocker.rollback()
    broken = _watcher(dsn, hook, "no_such_table")
    with pytest.raises(DatabaseError):
        broken.check()
    broken.close()
    watcher = _watcher(dsn, hook)
    with holder.acquire():
        watcher.check()
    # A holder that names its session: the watcher sees it alive; frozen, its hold turns in doubt.
    doubter = make_mutex(metrics=hook, operation_timeout=0.3, reclaim_disconnected_after=0.8)
    # And a semaphore's holder, watched (its permit labelled), with a blocking acquire that waits for it.
    semaphore = Semaphore(dsn, f"{lock_name}-semaphore", permits=1, metrics=hook, **FAST)  # type: ignore[arg-type]
    waiter = Semaphore(dsn, f"{lock_name}-semaphore", permits=1, metrics=hook, **FAST)  # type: ignore[arg-type]
    # And a read/write lock's reader, watched (its mode labelled), with a writer that waits for it.
    reader = RWLock(dsn, f"{lock_name}-rw", metrics=hook, **FAST)  # type: ignore[arg-type]
    writer = RWLock(dsn, f"{lock_name}-rw", metrics=hook, **FAST)  # type: ignore[arg-type]
    with doubter.acquire(), semaphore.acquire(), reader.read():
        with pytest.raises(LockAcquisitionTimeout), waiter.acquire(blocking=True, timeout=0.3):
            pass
        with pytest.raises(LockAcquisitionTimeout), writer.write(blocking=True, timeout=0.3):
            pass
        watcher.check()
        freeze(doubter)
        hold = doubter._lock.hold
        assert hold is not None
        wait_until(lambda: hold.doubt_told)  # in doubt, and told so
        assert not doubter.held
        thaw(doubter)
        wait_until(lambda: doubter.held)
    watcher.close()
    semaphore.close()
    waiter.close()
    reader.close()
    writer.close()
    run_election(dsn, hook, f"{lock_name}-election")


def run_election(dsn: str, hook: object, name: str) -> None:
    """Two terms: the first lead fails; the second stops the election and overruns its grace period."""
    election = Election(dsn, name, metrics=hook, grace_period=0.05, failure_backoff=0.01, **FAST)  # type: ignore[arg-type]
    terms: list[Leadership] = []

    def lead(leadership: Leadership) -> None:
        terms.append(leadership)
        if len(terms) == 1:
            raise RuntimeError("the first term fails")
        election.stop()
        time.sleep(0.3)  # ignoring the stop, past grace_period

    election.run(lead)
    election.close()
    assert len(terms) == 2


def _watcher(dsn: str, hook: object, table: str = "mutex_lock") -> StaleWatcher:
    return StaleWatcher(
        dsn,
        table=table,
        metrics=hook,
        alert_threshold=FAST["alert_threshold"],
        stale_threshold=FAST["stale_threshold"],
    )


def test_prometheus_metrics_count_every_event(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str, admin: psycopg.Connection[Any]
) -> None:
    registry = CollectorRegistry()
    run_workload(make_mutex, dsn, PrometheusMetrics(registry), lock_name, admin)

    def value(name: str, **labels: str) -> float:
        found = registry.get_sample_value(name, {"lock_name": lock_name, **labels})
        return 0.0 if found is None else found

    assert value("postgres_mutex_acquisitions_total") == 7
    assert value("postgres_mutex_releases_total") == 5, "the lost locks' releases deleted nothing"
    assert value("postgres_mutex_heartbeat_failures_total") >= 1
    assert value("postgres_mutex_contentions_total") >= 2
    # A mutex has no mode: its label is empty (absent, once Prometheus stores it).
    assert value("postgres_mutex_stale_reclaims_total", reason="stale", mode="") == 1
    assert value("postgres_mutex_doubts_total") == 1
    assert value("postgres_mutex_alerts_total", mode="") == 1
    assert value("postgres_mutex_losses_total") == 2, "the frozen holder and the one whose row was deleted"
    assert value("postgres_mutex_heartbeat_duration_seconds_count") >= 1
    assert value("postgres_mutex_acquire_duration_seconds_count", outcome="reclaimed") == 1
    assert value("postgres_mutex_acquire_duration_seconds_count", outcome="contended") >= 1
    assert value("postgres_mutex_locks_held") == 0, "every hold ended: released or lost, counted once"
    # The watcher's view, at its last read (the holder was holding then); a mutex's holder has no permit.
    mutex_holder = {"permit": "", "mode": ""}
    assert value("postgres_mutex_heartbeat_age_seconds", **mutex_holder) < FAST["alert_threshold"]
    assert value("postgres_mutex_threshold_stale_seconds", **mutex_holder) == FAST["stale_threshold"]
    assert value("postgres_mutex_alerting", **mutex_holder) == 0
    assert registry.get_sample_value("postgres_mutex_watcher_up") == 1, "the last read succeeded"
    assert registry.get_sample_value("postgres_mutex_watcher_errors_total") == 1
    holders = [
        sample.labels["holder"]
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == "postgres_mutex_holder_info" and sample.labels["lock_name"] == lock_name
    ]
    assert len(holders) == 1
    # The semaphore: its holder under the semaphore's name and its permit, not its row's name.
    semaphore_name = f"{lock_name}-semaphore"
    assert registry.get_sample_value("postgres_mutex_semaphore_permits_in_use", {"lock_name": semaphore_name}) == 1
    permit_age = registry.get_sample_value(
        "postgres_mutex_heartbeat_age_seconds", {"lock_name": semaphore_name, "permit": "0", "mode": ""}
    )
    assert permit_age is not None
    assert permit_age < FAST["alert_threshold"]
    waiting = registry.get_sample_value("postgres_mutex_waiters", {"lock_name": semaphore_name, "mode": ""})
    assert waiting == 0, "the waiter was counted while it waited, and no more once it gave up"
    assert value("postgres_mutex_locks_held") == 0
    # The read/write lock: its reader under its name and mode; holders per mode; its writer waited, then gave up.
    rw = {"lock_name": f"{lock_name}-rw"}
    assert registry.get_sample_value("postgres_mutex_rwlock_holders", {**rw, "mode": "read"}) == 1
    assert registry.get_sample_value("postgres_mutex_rwlock_holders", {**rw, "mode": "write"}) == 0
    reader_age = registry.get_sample_value("postgres_mutex_heartbeat_age_seconds", {**rw, "permit": "", "mode": "read"})
    assert reader_age is not None
    assert reader_age < FAST["alert_threshold"]
    assert registry.get_sample_value("postgres_mutex_waiters", {**rw, "mode": "write"}) == 0
    # The watcher read the gate while the writer's claim (renewed as it waited) still held readers back.
    assert registry.get_sample_value("postgres_mutex_rwlock_writer_waiting", rw) == 1


def test_no_counter_or_histogram_carries_an_instance_id(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str, admin: psycopg.Connection[Any]
) -> None:
    registry = CollectorRegistry()
    run_workload(make_mutex, dsn, PrometheusMetrics(registry), lock_name, admin)
    labels = {
        key
        for metric in registry.collect()
        if metric.name.startswith("postgres_mutex") and metric.type in ("counter", "histogram")
        for sample in metric.samples
        for key in sample.labels
    }
    assert labels <= {"lock_name", "mode", "outcome", "ended", "reason", "le"}


def test_otel_metrics_record_on_the_sdk(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str, admin: psycopg.Connection[Any]
) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    run_workload(make_mutex, dsn, OtelMetrics(meter_provider=provider), lock_name, admin)
    data = reader.get_metrics_data()
    assert data is not None
    points: dict[str, list[Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "postgres_mutex"
            for metric in scope.metrics:
                points[metric.name] = [
                    p for p in metric.data.data_points if (p.attributes or {}).get("lock_name") == lock_name
                ]
                assert metric.unit == next(m.unit for m in metric_names.ALL if m.otel == metric.name)
    assert points["postgres_mutex.acquisitions"][0].value == 7
    assert points["postgres_mutex.stale_reclaims"][0].value == 1
    assert points["postgres_mutex.losses"][0].value == 2
    assert points["postgres_mutex.locks.held"][0].value == 0
    assert points["postgres_mutex.heartbeat.duration"][0].count >= 1
    assert points["postgres_mutex.heartbeat.age"][0].value < FAST["alert_threshold"]
    provider.shutdown()


def _series(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        match = re.match(r"(postgres_mutex_[a-z_]+)", line)
        if match and not match.group(1).endswith("_created"):
            names.add(match.group(1))
    return names


def test_the_opentelemetry_path_yields_the_prometheus_series_names(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str, admin: psycopg.Connection[Any]
) -> None:
    registry = CollectorRegistry()
    # The SDK's Prometheus exporter serves the global registry (and leaves it
    # at shutdown); PrometheusMetrics gets a registry of its own.
    provider = MeterProvider(metric_readers=[PrometheusMetricReader()])
    try:
        hook = FanOutMetrics(OtelMetrics(meter_provider=provider), PrometheusMetrics(registry))
        run_workload(make_mutex, dsn, hook, lock_name, admin)
        through_otel = _series(generate_latest(REGISTRY).decode())
        direct = _series(generate_latest(registry).decode())
    finally:
        provider.shutdown()
    assert direct == through_otel
    assert direct == metric_names.prometheus_series(), "the workload makes every metric appear"


def test_fan_out_reaches_every_hook_even_past_a_broken_one(make_mutex: Callable[..., Mutex]) -> None:
    seen: list[str] = []

    class Broken:
        def acquired(self, lock_name: str, *, instance_id: str) -> None:
            raise RuntimeError("down")

    class Working:
        def acquired(self, lock_name: str, *, instance_id: str) -> None:
            seen.append(lock_name)

    mutex = make_mutex(metrics=FanOutMetrics(Broken(), Working(), object()))
    with mutex.acquire():
        pass
    assert seen == [mutex.lock_name]


def test_one_prometheus_metrics_per_registry_serves_every_mutex(make_mutex: Callable[..., Mutex]) -> None:
    registry = CollectorRegistry()
    first, second = PrometheusMetrics(registry), PrometheusMetrics(registry)
    assert first is second, "a second Mutex's PrometheusMetrics() must not clash with the first's series"
    with make_mutex(metrics=first).acquire(), make_mutex(lock_name="another-lock", metrics=second).acquire():
        pass
    assert registry.get_sample_value("postgres_mutex_acquisitions_total", {"lock_name": "another-lock"}) == 1


def test_a_stopped_watcher_stops_exporting_what_it_saw(make_mutex: Callable[..., Mutex], dsn: str) -> None:
    registry = CollectorRegistry()
    holder = make_mutex()
    watcher = StaleWatcher(dsn, lock_names=[holder.lock_name], interval=0.05, metrics=PrometheusMetrics(registry))
    with holder.acquire():
        watcher.start()
        wait_until(lambda: registry.get_sample_value("postgres_mutex_watcher_up") == 1)
        watcher.stop()
    age = registry.get_sample_value(
        "postgres_mutex_heartbeat_age_seconds", {"lock_name": holder.lock_name, "permit": ""}
    )
    assert age is None
    assert registry.get_sample_value("postgres_mutex_watcher_up") is None, "not a frozen 'up'"
    watcher.close()


def test_a_failed_release_no_longer_counts_as_held(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, lock_name: str
) -> None:
    registry = CollectorRegistry()
    mutex = make_mutex(proxy_dsn, operation_timeout=0.3, metrics=PrometheusMetrics(registry))
    with pytest.raises(DatabaseError), mutex.acquire():
        assert registry.get_sample_value("postgres_mutex_locks_held", {"lock_name": lock_name}) == 1
        proxy.silence()
    proxy.heal()
    assert registry.get_sample_value("postgres_mutex_locks_held", {"lock_name": lock_name}) == 0


def test_a_read_write_locks_holders_are_told_by_its_name_and_mode(
    dsn: str, lock_name: str, caplog: pytest.LogCaptureFixture, schema: None
) -> None:
    registry = CollectorRegistry()
    hook = PrometheusMetrics(registry)
    made = [RWLock(dsn, lock_name, metrics=hook, **FAST) for _ in range(4)]  # type: ignore[arg-type]
    quiet, busy, silent_writer, taker = made
    watcher = _watcher(dsn, hook)
    caplog.set_level(logging.INFO, logger="postgres_mutex")
    try:
        # Two readers, one of them silent: the watcher alerts on it by the lock's name and its mode, and shows
        # the two readers as one holder, the one silent longest.
        with quiet.read(), busy.read():
            freeze(quiet._reader)
            # This lock's: the table is the suite's, where other tests' silent holders may remain.
            wait_until(lambda: any(seen.alerting and seen.name == lock_name for seen in watcher.check()), timeout=10)
            reader = {"lock_name": lock_name, "permit": "", "mode": "read"}
            assert registry.get_sample_value("postgres_mutex_alerting", reader) == 1
            assert registry.get_sample_value("postgres_mutex_holder_info", {**reader, "holder": quiet.instance_id}) == 1
            assert (
                registry.get_sample_value("postgres_mutex_holder_info", {**reader, "holder": busy.instance_id}) is None
            )
            rw_holders = {"lock_name": lock_name, "mode": "read"}
            assert registry.get_sample_value("postgres_mutex_rwlock_holders", rw_holders) == 2
            assert registry.get_sample_value("postgres_mutex_rwlock_writer_waiting", {"lock_name": lock_name}) == 0
            thaw(quiet._reader)
            wait_until(lambda: quiet.held)
        assert registry.get_sample_value("postgres_mutex_alerts_total", {"lock_name": lock_name, "mode": "read"}) == 1
        # A silent writer: the writer waiting for it alerts, then takes its row over, both told with its mode.
        with frozen_holder(silent_writer._writer), taker.write(blocking=True, timeout=10) as got:
            assert got
        writer = {"lock_name": lock_name, "mode": "write"}
        assert registry.get_sample_value("postgres_mutex_alerts_total", writer) == 1
        assert registry.get_sample_value("postgres_mutex_stale_reclaims_total", {**writer, "reason": "stale"}) == 1
    finally:
        watcher.close()
        for rwlock in made:
            rwlock.close()
    said = [record.getMessage() for record in caplog.records]
    assert "\x1f" not in "".join(said), "no line names a row"
    assert any(f"read/write lock {lock_name!r} (read): holder {quiet.instance_id!r}" in line for line in said)
    assert any(f"reclaimed read/write lock {lock_name!r} (write) from" in line for line in said)
    assert any(f"lost read/write lock {lock_name!r} (write)" in line for line in said)
