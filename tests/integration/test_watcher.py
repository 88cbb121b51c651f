"""The stale-holder watcher: alerts on a silent holder with nobody contending, rides out outages."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

import postgres_mutex
from postgres_mutex import LockNotHeldError, LockTable, Mutex, RWLock, Semaphore
from postgres_mutex.watcher import StaleWatcher
from tests.support.faultproxy import FaultProxy
from tests.support.fixtures import (
    FAST,
    RecordingMetrics,
    await_until,
    freeze,
    frozen_holder,
    row_locked,
    wait_until,
)
from tests.support.signal_points import RunAtCheck

INTERVAL = 0.1


@pytest.fixture
def make_watcher(dsn: str) -> Iterator[Callable[..., StaleWatcher]]:
    made: list[StaleWatcher] = []

    def make(*args: Any, **kwargs: Any) -> StaleWatcher:
        kwargs.setdefault("alert_threshold", FAST["alert_threshold"])
        kwargs.setdefault("stale_threshold", FAST["stale_threshold"])
        kwargs.setdefault("interval", INTERVAL)
        watcher = StaleWatcher(*(args or (dsn,)), **kwargs)
        made.append(watcher)
        return watcher

    yield make
    for watcher in made:
        watcher.close()


def test_a_silent_holder_is_alerted_on_once_with_nobody_contending(
    make_mutex: Callable[..., Mutex], make_watcher: Callable[..., StaleWatcher], metrics: RecordingMetrics
) -> None:
    holder = make_mutex()
    watcher = make_watcher(lock_names=[holder.lock_name], metrics=metrics)
    watcher.start()
    acquire = holder.acquire()
    assert acquire.__enter__()
    freeze(holder)
    frozen_at = time.monotonic()
    wait_until(lambda: metrics.named("alert"), timeout=10)
    alerted_after = time.monotonic() - frozen_at
    assert alerted_after < FAST["alert_threshold"] + INTERVAL + 0.5, "within alert_threshold + interval"
    (alert,) = metrics.named("alert")
    assert alert["holder"] == holder.instance_id
    assert FAST["alert_threshold"] <= alert["seconds_since_heartbeat"] < FAST["stale_threshold"]
    # Many more reads while the holder stays silent: still one alert.
    reads = len(metrics.named("observed"))
    wait_until(lambda: len(metrics.named("observed")) > reads + 5)
    assert len(metrics.named("alert")) == 1
    (seen,) = watcher.observations
    assert seen.holder == holder.instance_id
    assert seen.alerting
    assert watcher.healthy is True
    wait_until(lambda: watcher.observations and watcher.observations[0].reclaimable)
    holder.close()


def test_the_alert_re_arms_when_the_heartbeat_resumes(
    make_mutex: Callable[..., Mutex],
    make_watcher: Callable[..., StaleWatcher],
    metrics: RecordingMetrics,
    dsn: str,
) -> None:
    # A deadline that leaves no room for a lease (concepts/the-table.md#leases): the holder renews its row, which
    # another session's row lock stalls, where a lease's renewal would go on.
    holder = make_mutex(operation_timeout=0.3)
    watcher = make_watcher(lock_names=[holder.lock_name], metrics=metrics)
    watcher.start()
    with holder.acquire():
        for episode in (1, 2):
            with row_locked(dsn, holder.lock_name):
                wait_until(lambda n=episode: len(metrics.named("alert")) == n, timeout=10)  # type: ignore[misc]
            # Heartbeats land again: the watcher sees the holder fresh before the next stall.
            wait_until(lambda: watcher.observations and not watcher.observations[0].alerting)
        assert holder.held, "the stalls were shorter than the lease"
    assert [alert["holder"] for alert in metrics.named("alert")] == [holder.instance_id] * 2


def test_the_watcher_reports_every_held_lock_or_only_those_it_is_given(
    make_mutex: Callable[..., Mutex], make_watcher: Callable[..., StaleWatcher]
) -> None:
    first, second = make_mutex(), make_mutex(lock_name=f"other-{time.monotonic_ns()}")
    everything, only_first = make_watcher(), make_watcher(lock_names=[first.lock_name])
    with first.acquire(), second.acquire():
        seen = {o.lock_name: o for o in everything.check()}
        assert {first.lock_name, second.lock_name} <= set(seen)
        assert seen[first.lock_name].holder == first.instance_id
        assert [o.lock_name for o in only_first.check()] == [first.lock_name]
        time.sleep(0.3)
        (later,) = only_first.check()
        assert later.seconds_held >= 0.3
        assert later.seconds_since_heartbeat < FAST["alert_threshold"]
    assert only_first.check() == [], "a released lock is free"


def test_the_watcher_keeps_running_through_a_database_outage(
    make_mutex: Callable[..., Mutex],
    make_watcher: Callable[..., StaleWatcher],
    metrics: RecordingMetrics,
    proxy: FaultProxy,
    proxy_dsn: str,
) -> None:
    holder = make_mutex()
    watcher = make_watcher(proxy_dsn, lock_names=[holder.lock_name], metrics=metrics, operation_timeout=0.3)
    watcher.start()
    with holder.acquire():
        wait_until(lambda: watcher.healthy is True)
        proxy.silence()
        wait_until(lambda: watcher.healthy is False, timeout=15)
        assert metrics.named("watcher_failed")
        proxy.heal()
        proxy.reset()  # drop the silenced connections: the watcher must reconnect
        wait_until(lambda: watcher.healthy is True, timeout=15)
        assert [o.holder for o in watcher.observations] == [holder.instance_id]


def test_the_watcher_runs_in_the_calling_thread_until_stopped(
    make_mutex: Callable[..., Mutex], make_watcher: Callable[..., StaleWatcher], metrics: RecordingMetrics
) -> None:
    # As Election.run does: run() blocks; stop(), from elsewhere, ends it.
    holder = make_mutex()
    watcher = make_watcher(lock_names=[holder.lock_name], metrics=metrics, interval=0.05)

    def stop_once_alerted() -> None:
        wait_until(lambda: metrics.named("alert"), timeout=15)
        watcher.stop()

    # Frozen, the holder may lose its lease before the watcher is stopped: beside the point here.
    with contextlib.suppress(LockNotHeldError), holder.acquire():
        freeze(holder)
        stopper = threading.Thread(target=stop_once_alerted, daemon=True)
        stopper.start()
        started = time.monotonic()
        watcher.run()
        stopper.join(5)
    assert time.monotonic() - started < 15, "it returned once stopped"
    assert [a["holder"] for a in metrics.named("alert")] == [holder.instance_id]
    assert watcher.healthy is None, "stopped"


def test_stop_from_a_signal_handler_ends_run_wherever_the_signal_lands(
    make_watcher: Callable[..., StaleWatcher],
) -> None:
    """`run` says `stop` may come from a signal handler: one running at any point of the watching
    thread's loop (its read, its wait between reads, the run's start) ends the run and returns."""
    library = str(Path(postgres_mutex.__file__).parent)

    def watched(name: str) -> bool:
        return name.startswith(library) or name == threading.__file__

    def run_once(at: int) -> tuple[RunAtCheck, bool]:
        watcher = make_watcher(interval=0.001)
        handler = RunAtCheck(at, watcher.stop, watched)

        def run() -> None:
            sys.settrace(handler)
            try:
                watcher.run()
            finally:
                sys.settrace(None)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        runner.join(10.0)
        ended = not runner.is_alive()
        if not ended:
            watcher.stop()
        return handler, ended

    # From the second point: the first is run() being entered, where a stop() is one made before the
    # run, which a run that follows does not see (a stopped watcher may run again).
    for at in range(2, 402):  # the points of the run's start and its first rounds of reading and waiting
        handler, ended = run_once(at)
        assert handler.where, f"the run saw {handler.seen} points"
        assert ended, f"run() went on after stop() from a handler at {handler.where}"


async def test_the_watcher_runs_as_a_task_in_async_code(
    amake_mutex: Callable[..., Mutex], make_watcher: Callable[..., StaleWatcher], metrics: RecordingMetrics
) -> None:
    holder = amake_mutex()
    watcher = make_watcher(lock_names=[holder.lock_name], metrics=metrics)
    task = asyncio.create_task(watcher.run_async())
    try:
        async with holder.acquire_async():
            freeze(holder)  # silent, though its lease still runs when the alert comes
            for _ in range(200):
                if metrics.named("alert"):
                    break
                await asyncio.sleep(0.05)
        assert [a["holder"] for a in metrics.named("alert")] == [holder.instance_id]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await watcher.aclose()


def test_a_mutex_can_watch_its_own_lock(make_mutex: Callable[..., Mutex], metrics: RecordingMetrics, dsn: str) -> None:
    holder = make_mutex(watch=True, metrics=metrics, operation_timeout=0.2)
    assert holder.watcher is not None
    with holder.acquire(), row_locked(dsn, holder.lock_name):
        wait_until(lambda: metrics.named("alert"), timeout=10)
    assert [a["holder"] for a in metrics.named("alert")] == [holder.instance_id]
    assert metrics.named("observed")
    watcher = holder.watcher
    holder.close()
    assert watcher._thread is None, "close() stops the watcher..."
    assert _watcher_of(holder) is None, "...for good: releasing on close does not start it again"
    assert not any(t.name == "postgres-mutex-watcher" and t.is_alive() for t in threading.enumerate())


def test_a_mutex_that_only_watches_its_lock_is_alerted_without_acquiring(
    make_mutex: Callable[..., Mutex], metrics: RecordingMetrics, lock_name: str
) -> None:
    # A process that watches a lock others hold: no acquire, ever.
    holder = make_mutex(lock_name=lock_name)
    watching = make_mutex(lock_name=lock_name, watch=True, metrics=metrics)
    with holder.acquire():
        freeze(holder)
        wait_until(lambda: metrics.named("alert"), timeout=10)
    assert [a["holder"] for a in metrics.named("alert")] == [holder.instance_id]
    watching.close()


def _watcher_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == "postgres-mutex-watcher")


def test_a_watching_mutex_watches_its_own_lock_only_not_the_locks_its_decorators_name(
    make_mutex: Callable[..., Mutex], metrics: RecordingMetrics, lock_name: str
) -> None:
    # watch=True is about the Mutex's lock: a decorator naming another lock does not start a watcher for it.
    before = _watcher_threads()
    watching = make_mutex(lock_name=lock_name, watch=True, metrics=metrics)
    wait_until(lambda: _watcher_threads() == before + 1, timeout=10)

    @watching.singleton(lock_name + "-other")
    def job() -> str:
        return "ran"

    assert job() == "ran"
    assert _watcher_threads() == before + 1
    watching.close()


async def test_an_async_mutex_that_only_watches_its_lock_is_alerted_without_acquiring(
    make_mutex: Callable[..., Mutex], metrics: RecordingMetrics, lock_name: str, dsn: str
) -> None:
    pool = AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False, kwargs={"autocommit": True})
    await pool.open()
    try:
        holder = make_mutex(lock_name=lock_name)
        watching = Mutex(async_pool=pool, lock_name=lock_name, watch=True, metrics=metrics, **FAST)  # type: ignore[arg-type]
        with holder.acquire():
            freeze(holder)
            await await_until(lambda: metrics.named("alert"), timeout=10)
        assert [a["holder"] for a in metrics.named("alert")] == [holder.instance_id]
        await watching.aclose()
    finally:
        await pool.close()


def test_a_semaphore_watches_its_holders_each_told_by_its_name_and_permit(
    dsn: str, lock_name: str, metrics: RecordingMetrics, caplog: pytest.LogCaptureFixture, schema: None
) -> None:
    watching = Semaphore(dsn, lock_name, permits=2, watch=True, metrics=metrics, **FAST)  # type: ignore[arg-type]
    healthy, silent = (Semaphore(dsn, lock_name, permits=2, **FAST) for _ in range(2))  # type: ignore[arg-type]
    watcher = watching.watcher
    assert watcher is not None
    try:
        with healthy.acquire(), frozen_holder(silent):
            permit = silent.permit
            wait_until(lambda: metrics.named("alert"), timeout=10)
            seen = {observed.permit for observed in watcher.observations}
            assert seen == {healthy.permit, permit}, "every holder of the semaphore, each with its permit"
            # Its own acquire takes the silent holder's permit over; the watcher has told of it already.
            with watching.acquire(blocking=True, timeout=10) as got:
                assert got
            wait_until(lambda: not silent.held)
        alerts = [(name, kwargs["holder"]) for method, name, kwargs in metrics.calls if method == "alert"]
        assert alerts == [(lock_name, silent.instance_id)], "once, under the semaphore's name"
        assert f"semaphore {lock_name!r} (permit {permit}): holder {silent.instance_id!r}" in caplog.text
    finally:
        for semaphore in (watching, healthy, silent):
            semaphore.close()
    assert watcher._thread is None, "close() stops the watcher"


def test_a_semaphores_watcher_alerts_before_its_acquire_reclaims_however_close_the_thresholds(
    dsn: str, lock_name: str, metrics: RecordingMetrics, schema: None
) -> None:
    """Its contenders leave the alerts to the watcher, which looks often enough to come first.

    Looking every half alert threshold, from a holder's age of 0.7 s, it would look at 0.7, 1.95
    and 3.2 s: past the reclaim at 2.8 s, with no look between the alert and it.
    """
    close = {**FAST, "alert_threshold": 2.5, "stale_threshold": 2.8}
    silent = Semaphore(dsn, lock_name, permits=1, **close)  # type: ignore[arg-type]
    watching: Semaphore | None = None
    try:
        with frozen_holder(silent):
            table = LockTable(dsn)
            wait_until(lambda: any(seen.seconds_since_heartbeat >= 0.7 for seen in table.holders([lock_name])))
            watching = Semaphore(dsn, lock_name, permits=1, watch=True, metrics=metrics, **close)  # type: ignore[arg-type]
            with watching.acquire(blocking=True, timeout=15) as got:
                assert got
            wait_until(lambda: not silent.held)
        told = [method for method, _, _ in metrics.calls if method in ("alert", "stale_reclaimed")]
        assert told == ["alert", "stale_reclaimed"], "the alert, then the reclaim"
    finally:
        if watching is not None:
            watching.close()
        silent.close()


def test_a_read_write_lock_watches_its_holders_of_either_mode_with_one_watcher(
    dsn: str, lock_name: str, metrics: RecordingMetrics, caplog: pytest.LogCaptureFixture, schema: None
) -> None:
    watching = RWLock(dsn, lock_name, watch=True, metrics=metrics, **FAST)  # type: ignore[arg-type]
    silent = RWLock(dsn, lock_name, **FAST)  # type: ignore[arg-type]
    watcher = watching.watcher
    assert watcher is not None
    try:
        with frozen_holder(silent._writer):
            wait_until(lambda: metrics.named("alert"), timeout=10)
            assert [(seen.rwlock, seen.mode) for seen in watcher.observations] == [(lock_name, "write")]
            wait_until(lambda: not silent.held)
        alerts = [
            (name, kwargs["holder"], kwargs["mode"]) for method, name, kwargs in metrics.calls if method == "alert"
        ]
        assert alerts == [(lock_name, silent.instance_id, "write")], "once, under the lock's name, with its mode"
        assert f"read/write lock {lock_name!r} (write): holder {silent.instance_id!r}" in caplog.text
        # Waiting for the silent writer, its own acquire leaves the telling to the watcher: still one alert.
        with watching.write(blocking=True, timeout=10) as got:
            assert got
        assert len(metrics.named("alert")) == 1
    finally:
        watching.close()
        silent.close()
    assert watcher._thread is None, "close() stops the one watcher of both modes"
    assert not any(t.name == "postgres-mutex-watcher" and t.is_alive() for t in threading.enumerate())


def _watcher_of(mutex: Mutex) -> StaleWatcher | None:
    return mutex.watcher


async def test_a_check_from_async_code_reports_what_a_sync_one_does(
    make_mutex: Callable[..., Mutex], make_watcher: Callable[..., StaleWatcher]
) -> None:
    holder = make_mutex()
    watcher = make_watcher(lock_names=[holder.lock_name])
    assert await watcher.check_async() == []
    with holder.acquire():
        (seen,) = await watcher.check_async()
        assert seen.holder == holder.instance_id
        assert not seen.alerting
        assert [o.holder for o in watcher.check()] == [seen.holder]
    assert await watcher.check_async() == [], "a released lock is free"
