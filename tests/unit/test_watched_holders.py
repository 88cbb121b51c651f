"""What the watcher's rows become in Prometheus: a read/write lock's holders by its name and mode, never by row."""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client import CollectorRegistry

from postgres_mutex._state.admin_flows import observe
from postgres_mutex._state.rows import rw_row_name
from postgres_mutex.prometheus import PrometheusMetrics

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def row(lock_name: str, holder: str, age: float, writer_waits: bool | None = None) -> tuple[object, ...]:
    return (lock_name, holder, age, age + 1.0, NOW, 7, None, None, writer_waits)


def test_a_read_write_locks_rows_are_told_apart_from_a_mutexs_and_a_semaphores() -> None:
    reader = rw_row_name("catalogue", "host-a", "read")
    writer = rw_row_name("catalogue", "host-b", "write")
    rows = [row(reader, "host-a", 1.0, True), row(writer, "host-b", 2.0, False), row("jobs\x1fweekly", "c", 0.5)]
    rows.append(row("partner-api\x1f2", "d", 0.5))
    seen = {observed.holder: observed for observed in observe(rows, alert_threshold=30, stale_threshold=600)}
    assert (seen["host-a"].name, seen["host-a"].mode, seen["host-a"].writer_waiting) == ("catalogue", "read", True)
    assert (seen["host-b"].name, seen["host-b"].mode) == ("catalogue", "write")
    assert (seen["c"].name, seen["c"].rwlock, seen["c"].mode) == ("jobs\x1fweekly", None, None), "a mutex's name"
    assert (seen["d"].name, seen["d"].permit, seen["d"].mode) == ("partner-api", 2, None)


def test_readers_are_one_series_the_one_silent_longest_with_holders_counted_per_mode() -> None:
    registry = CollectorRegistry()
    hook = PrometheusMetrics(registry)
    readers = [(f"host-{n}", age) for n, age in enumerate((3.0, 45.0, 1.0))]
    rows = [row(rw_row_name("catalogue", holder, "read"), holder, age, True) for holder, age in readers]
    hook.observed(
        observe(rows, alert_threshold=30, stale_threshold=600), watched=None, alert_threshold=30, stale_threshold=600
    )
    reader = {"lock_name": "catalogue", "permit": "", "mode": "read"}
    assert registry.get_sample_value("postgres_mutex_heartbeat_age_seconds", reader) == 45.0
    assert registry.get_sample_value("postgres_mutex_alerting", reader) == 1
    assert registry.get_sample_value("postgres_mutex_holder_info", {**reader, "holder": "host-1"}) == 1
    infos = [s for m in registry.collect() for s in m.samples if s.name == "postgres_mutex_holder_info"]
    assert len(infos) == 1, "three readers, one series"
    assert registry.get_sample_value("postgres_mutex_rwlock_holders", {"lock_name": "catalogue", "mode": "read"}) == 3
    assert registry.get_sample_value("postgres_mutex_rwlock_holders", {"lock_name": "catalogue", "mode": "write"}) == 0
    assert registry.get_sample_value("postgres_mutex_rwlock_writer_waiting", {"lock_name": "catalogue"}) == 1
