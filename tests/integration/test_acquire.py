"""Acquire, contend, wait, hand off, release: the everyday behaviour, sync and async."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg
import pytest

import postgres_mutex
from postgres_mutex import LockAcquisitionTimeout, LockAlreadyHeldError, LockNotHeldError, Mutex
from postgres_mutex._sql.lock import Statements
from postgres_mutex._sql.names import Names
from postgres_mutex._sql.shape import CURRENT
from postgres_mutex._sql.statement import Statement
from postgres_mutex.client import core_of
from tests.support.fixtures import (
    FAST,
    RecordingMetrics,
    await_until,
    frozen_holder,
    held_in_a_task,
    listener_reconnected,
    listens,
    role_with_setting,
    wait_until,
)
from tests.support.postgres_server import PostgresServer

Row = Callable[..., tuple[Any, ...] | None]
Holder = Callable[..., str | None]


def test_non_blocking_acquire_yields_true_then_false_for_a_contender(
    make_mutex: Callable[..., Mutex], row: Row, holder_id: Holder
) -> None:
    holder, other = make_mutex(), make_mutex()
    with holder.acquire() as acquired:
        assert acquired is True
        assert holder.held
        assert holder_id() == holder.instance_id
        with other.acquire() as second:
            assert second is False
            assert not other.held
    assert row() is None, "leaving the block deletes the row"
    assert not holder.held


@pytest.fixture
def serializable_role(pg: PostgresServer, admin: psycopg.Connection[Any], needs_superuser: None) -> Iterator[str]:
    yield from role_with_setting(pg, admin, "default_transaction_isolation = 'serializable'")


def test_a_serializable_session_default_cannot_turn_contention_into_errors(
    serializable_role: str, lock_name: str
) -> None:
    errors: list[BaseException] = []
    outcomes: list[bool] = []
    stop = time.monotonic() + 4.0

    def contend() -> None:
        mutex = Mutex(serializable_role, lock_name, **FAST)  # type: ignore[arg-type]
        try:
            while time.monotonic() < stop:
                try:
                    with mutex.acquire() as acquired:
                        outcomes.append(acquired)
                except Exception as exc:
                    errors.append(exc)
        finally:
            mutex.close()

    threads = [threading.Thread(target=contend) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == [], "contention is an answer (False), never a serialization failure"
    assert len(outcomes) > 100
    assert True in outcomes


def test_the_statements_kept_prepared_are_planned_once_not_at_every_run(
    dsn: str, lock_name: str, schema: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each statement the library keeps prepared on its connection runs the plan made for it once.

    Left to choose, the server planned a permit's and a read/write hold's
    release anew at every run, which cost more than running it: a semaphore's
    cycle took 0.77 ms where it takes 0.58.
    """
    prepared_on: set[psycopg.Connection[Any]] = set()
    execute = psycopg.Cursor.execute

    def noting(cursor: psycopg.Cursor[Any], query: Any, params: Any = None, **kwargs: Any) -> Any:
        if kwargs.get("prepare"):
            prepared_on.add(cursor.connection)
        return execute(cursor, query, params, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", noting)
    runs = 12
    with postgres_mutex.MutexClient(dsn) as client:
        locks = [
            client.mutex(lock_name),
            client.mutex(f"{lock_name}-fair", fair=True),
            client.mutex(f"{lock_name}-reclaimed", reclaim_disconnected_after=30.0),
            client.semaphore(f"{lock_name}-permits", permits=3),
        ]
        rwlock = client.rwlock(f"{lock_name}-rw")
        for _ in range(runs):
            for lock in locks:
                with lock.acquire() as acquired:
                    assert acquired
            for hold in (rwlock.read, rwlock.write):
                with hold() as acquired:
                    assert acquired
        (conn,) = prepared_on
        plans = conn.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements", prepare=False
        ).fetchall()
    assert len(plans) >= 8, "every lock kind's acquire and release are kept prepared"
    planned_each_run = [" ".join(text.split())[:80] for text, _, custom in plans if custom >= runs]
    assert planned_each_run == [], "planned anew at every run"


def test_positional_and_keyword_construction_are_equivalent(dsn: str, lock_name: str) -> None:
    positional = Mutex(dsn, lock_name)
    keyword = Mutex(dsn=dsn, lock_name=lock_name)
    assert positional.lock_name == keyword.lock_name == lock_name
    with positional.acquire() as first, keyword.acquire() as second:
        assert (first, second) == (True, False)
    positional.close()
    keyword.close()


def test_blocking_acquire_waits_for_the_holder(make_mutex: Callable[..., Mutex]) -> None:
    holder, waiter = make_mutex(), make_mutex()
    # Set as the holder's work ends, just before it releases: a waiter that got
    # the lock any earlier would have run alongside the holder.
    done = threading.Event()

    def hold() -> None:
        with holder.acquire():
            time.sleep(0.4)
            done.set()

    with holder.acquire():
        pass  # warm the holder's connection so the thread starts holding at once
    thread = threading.Thread(target=hold)
    thread.start()
    wait_until(lambda: holder.held)
    with waiter.acquire(blocking=True, timeout=10) as acquired:
        assert acquired is True
        assert done.is_set(), "the waiter got the lock only once the holder was done with it"
    thread.join()


def test_blocking_acquire_times_out_with_a_timeout_error_and_never_runs_the_body(
    make_mutex: Callable[..., Mutex],
) -> None:
    holder, waiter = make_mutex(), make_mutex()
    ran = False
    with holder.acquire():
        started = time.monotonic()
        with pytest.raises(LockAcquisitionTimeout) as caught, waiter.acquire(blocking=True, timeout=0.3):
            ran = True
        elapsed = time.monotonic() - started
    assert not ran
    assert isinstance(caught.value, TimeoutError)
    assert caught.value.holder == holder.instance_id
    assert holder.instance_id in str(caught.value)
    assert 0.3 <= elapsed < 3.0
    assert not waiter.held


def test_a_timeout_alone_means_wait_up_to_it(make_mutex: Callable[..., Mutex]) -> None:
    holder, waiter = make_mutex(), make_mutex()
    let_go = threading.Event()

    def hold() -> None:
        with holder.acquire():
            let_go.wait(timeout=30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        wait_until(lambda: holder.held)
        started = time.monotonic()
        with pytest.raises(LockAcquisitionTimeout), waiter.acquire(timeout=0.3):
            pytest.fail("must not run")
        assert time.monotonic() - started >= 0.3, "it waited, instead of trying once"
        releaser = threading.Timer(0.2, let_go.set)
        releaser.start()
        with waiter.acquire(timeout=10) as acquired:
            assert acquired is True, "the waiter got the lock once the holder released it"
        releaser.join()
    finally:
        let_go.set()
        thread.join()


def test_release_wakes_a_waiter_at_once_instead_of_at_its_next_poll(
    make_mutex: Callable[..., Mutex], metrics: RecordingMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    # With a 30 s poll interval (past the wait's timeout) only a wake-up can hand the lock over in time.
    holder, waiter = make_mutex(), make_mutex(poll_interval=30.0, metrics=metrics)
    woke_after: list[float] = []

    def wait() -> None:
        with waiter.acquire(blocking=True, timeout=20):
            woke_after.append(time.monotonic())

    with holder.acquire():
        thread = threading.Thread(target=wait)
        thread.start()
        # Observed, not slept on: the waiter LISTENs, and has tried again since (so it now waits to be woken).
        wait_until(lambda: listens(waiter) and len(metrics.named("contended")) >= 2)
        released_at = time.monotonic()
    thread.join(timeout=25)
    assert woke_after, "the waiter never acquired"
    assert woke_after[0] - released_at < 3.0
    # The notified path: two attempts found the lock held, the third (after one wait, which ended
    # long before its poll interval) took it; and no listener reconnection woke it instead.
    assert len(metrics.named("contended")) == 2
    assert not listener_reconnected(caplog)


async def test_async_release_wakes_an_async_waiter_at_once(
    amake_mutex: Callable[..., Mutex], metrics: RecordingMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    holder, waiter = amake_mutex(), amake_mutex(poll_interval=30.0, metrics=metrics)
    async with holder.acquire_async():
        task = asyncio.create_task(_acquire_and_time(waiter))
        engine = core_of(waiter.client).engine_async()
        await await_until(lambda: listens(waiter, engine=engine) and len(metrics.named("contended")) >= 2)
        released_at = time.monotonic()
    acquired_at = await asyncio.wait_for(task, 25)
    assert acquired_at - released_at < 3.0
    assert len(metrics.named("contended")) == 2, "woken once, by the release's notification"
    assert not listener_reconnected(caplog)


async def _acquire_and_time(mutex: Mutex) -> float:
    async with mutex.acquire_async(timeout=20):
        return time.monotonic()


def test_stale_polling_still_finds_a_release_when_notifications_are_impossible(
    make_mutex: Callable[..., Mutex], row: Row, holder_id: Holder
) -> None:
    # A holder that vanished without releasing: only polling can see the row go stale.
    holder, waiter = make_mutex(), make_mutex(poll_interval=0.1)
    with frozen_holder(holder), waiter.acquire(blocking=True, timeout=10) as acquired:
        assert acquired
        assert not holder.held, "the frozen holder's lease ran out before the reclaim"
        assert holder_id() == waiter.instance_id


def test_acquiring_twice_on_one_mutex_is_an_error(make_mutex: Callable[..., Mutex]) -> None:
    mutex = make_mutex()
    with mutex.acquire():
        with pytest.raises(LockAlreadyHeldError, match="already holds"), mutex.acquire():
            pass
        assert mutex.held, "the failed second acquire did not disturb the first"


async def test_async_acquire_is_blocking_by_default_and_yields_true(
    amake_mutex: Callable[..., Mutex], row: Row
) -> None:
    holder, waiter = amake_mutex(), amake_mutex()
    async with holder.acquire_async() as acquired:
        assert acquired is True
        with pytest.raises(LockAcquisitionTimeout):
            async with waiter.acquire_async(timeout=0.2):
                pytest.fail("the body must not run without the lock")
        async with waiter.acquire_async(blocking=False) as second:
            assert second is False
    assert row() is None


async def test_async_and_sync_api_share_one_lock_state(amake_mutex: Callable[..., Mutex]) -> None:
    mutex = amake_mutex()
    async with mutex.acquire_async():
        with pytest.raises(LockAlreadyHeldError), mutex.acquire():
            pass
        await mutex.heartbeat_async()
    assert not mutex.held


def test_release_without_holding_raises_lock_not_held_as_threading_lock_does(
    make_mutex: Callable[..., Mutex], metrics: RecordingMetrics
) -> None:
    mutex = make_mutex(metrics=metrics)
    with pytest.raises(LockNotHeldError, match="does not hold the lock"):
        mutex.release()
    with mutex.acquire():
        pass
    with pytest.raises(LockNotHeldError):
        mutex.release()
    assert len(metrics.named("released")) == 1


def test_explicit_release_inside_the_block_lets_others_in_early(make_mutex: Callable[..., Mutex], row: Row) -> None:
    holder, other = make_mutex(), make_mutex()
    with holder.acquire():
        holder.release()
        assert not holder.held
        assert row() is None
        with other.acquire() as acquired:
            assert acquired


def test_a_mutex_can_acquire_again_after_releasing(make_mutex: Callable[..., Mutex]) -> None:
    mutex = make_mutex()
    for _ in range(3):
        with mutex.acquire() as acquired:
            assert acquired


def test_a_release_from_another_thread_tells_the_block_it_ran_unlocked(make_mutex: Callable[..., Mutex]) -> None:
    mutex = make_mutex()
    with pytest.raises(LockNotHeldError, match="another thread") as caught, mutex.acquire():
        thread = threading.Thread(target=mutex.release)
        thread.start()
        thread.join(timeout=10)
        assert not mutex.held
        with pytest.raises(LockNotHeldError, match="another thread"):
            mutex.ensure_held()
    assert caught.value.lock_name == mutex.lock_name


def test_an_acquisition_entered_and_dropped_keeps_the_lock_until_release(
    make_mutex: Callable[..., Mutex], holder_id: Holder
) -> None:
    mutex = make_mutex()
    entered = mutex.acquire()
    assert entered.__enter__()
    del entered
    gc.collect()
    time.sleep(3 * FAST["heartbeat_interval"])
    assert mutex.held, "dropping the context manager does not release: release() does"
    assert holder_id() == mutex.instance_id
    mutex.release()
    assert holder_id() is None


def test_releasing_inside_the_block_from_its_own_thread_is_an_early_release_not_an_error(
    make_mutex: Callable[..., Mutex],
) -> None:
    mutex = make_mutex()
    with mutex.acquire():
        mutex.release()
    assert not mutex.held


def test_singleton_runs_the_function_only_when_the_lock_is_free(
    make_mutex: Callable[..., Mutex], lock_name: str
) -> None:
    mutex, other = make_mutex(), make_mutex()
    calls: list[int] = []

    @mutex.singleton(lock_name)
    def job(value: int) -> int:
        calls.append(value)
        return value * 2

    assert job(21) == 42
    with other.acquire():
        assert job(1) is None
    assert calls == [21]


def test_singleton_with_another_lock_name_locks_that_name(make_mutex: Callable[..., Mutex], holder_id: Holder) -> None:
    mutex = make_mutex()
    other_name = "nightly-report-job-" + mutex.lock_name[-8:]
    seen: list[str | None] = []

    @mutex.singleton(other_name)
    def job() -> None:
        seen.append(holder_id(other_name))
        seen.append(holder_id())

    job()
    assert seen == [mutex.instance_id, None], "the named lock was taken, not the Mutex's own"


def test_bare_singleton_decorator_uses_the_mutex_lock(make_mutex: Callable[..., Mutex]) -> None:
    mutex = make_mutex()

    @mutex.singleton
    def job() -> bool:
        return mutex.held

    assert job() is True


def test_singleton_blocking_with_timeout_raises_when_the_lock_stays_busy(make_mutex: Callable[..., Mutex]) -> None:
    mutex, other = make_mutex(), make_mutex()

    @mutex.singleton(blocking=True, timeout=0.2)
    def job() -> None:
        pytest.fail("must not run")

    with other.acquire(), pytest.raises(LockAcquisitionTimeout):
        job()


def test_singleton_called_again_while_running_in_this_process_returns_none(make_mutex: Callable[..., Mutex]) -> None:
    mutex = make_mutex()

    @mutex.singleton
    def job(depth: int) -> Any:
        return job(depth + 1) if depth == 0 else "inner ran"

    assert job(0) is None


async def test_singleton_async(amake_mutex: Callable[..., Mutex]) -> None:
    mutex, other = amake_mutex(), amake_mutex()

    @mutex.singleton_async(blocking=False)
    async def job() -> str:
        return "ran"

    assert await job() == "ran"
    async with other.acquire_async():
        assert await job() is None

    @mutex.singleton_async
    async def bare() -> bool:
        return mutex.held

    assert await bare() is True


def test_exception_in_the_block_releases_and_propagates(make_mutex: Callable[..., Mutex], row: Row) -> None:
    mutex = make_mutex()
    with pytest.raises(RuntimeError, match="job failed"), mutex.acquire():
        raise RuntimeError("job failed")
    assert row() is None
    assert not mutex.held


def test_keyboard_interrupt_in_the_block_releases(make_mutex: Callable[..., Mutex], row: Row) -> None:
    mutex = make_mutex()
    with pytest.raises(KeyboardInterrupt), mutex.acquire():
        raise KeyboardInterrupt
    assert row() is None


async def test_cancelling_the_task_releases_the_lock(amake_mutex: Callable[..., Mutex], row: Row) -> None:
    mutex = amake_mutex()
    task = await held_in_a_task(mutex)
    assert row() is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert row() is None
    assert not mutex.held


async def test_cancelling_a_blocked_acquire_leaves_no_row(
    amake_mutex: Callable[..., Mutex], row: Row, holder_id: Holder, metrics: RecordingMetrics
) -> None:
    holder, waiter = amake_mutex(), amake_mutex(metrics=metrics)
    async with holder.acquire_async():
        task = asyncio.create_task(_acquire_and_time(waiter))
        await await_until(lambda: metrics.named("contended"))  # blocked: it found the lock held
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert holder_id() == holder.instance_id
    async with waiter.acquire_async(timeout=5) as acquired:
        assert acquired, "the cancelled waiter's Mutex is usable again"


def test_an_uncontended_cycle_sends_two_statements_binding_only_what_they_read(
    make_mutex: Callable[..., Mutex], monkeypatch: pytest.MonkeyPatch
) -> None:
    mutex = make_mutex()
    with mutex.acquire() as acquired:  # the connection's first statements set its session up
        assert acquired
    sent: list[list[str]] = []
    execute = psycopg.Cursor.execute
    # Prepared statements go with numbered placeholders: their parameters' names, from the statements themselves.
    # The table as `create_schema` makes it: the common pair are functions on the server (`_sql.functions`).
    statements = vars(Statements(Names("mutex_lock"), dataclasses.replace(CURRENT, functions=True))).values()
    named = {made.numbered: made.names for made in statements if isinstance(made, Statement) and made.numbered}

    def recording(self: psycopg.Cursor[Any], query: Any, params: Any = None, **kwargs: Any) -> Any:
        if isinstance(query, str) and "mutex_lock" in query:
            names = named.get(query) or re.findall(r"%\((\w+)\)s", query)
            sent.append(sorted(set(names)))
        return execute(self, query, params, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", recording)
    with mutex.acquire() as acquired:
        assert acquired
    assert len(sent) == 2, f"one statement to acquire, one to release: {sent}"
    acquire, release = sent
    # What each costs the client follows what it binds: the minimum hold and the session's
    # key are not bound by a holder that asks for neither.
    assert acquire == ["_session_key", "instance_id", "lock_name", "stale_seconds"]
    assert release == ["acquired_at", "channel", "instance_id", "lock_name", "own_slot"]


@pytest.mark.parametrize("fair", [False, True], ids=["mutex", "fair"])
def test_an_uncontended_cycle_runs_little_python_of_the_librarys_own(
    make_mutex: Callable[..., Mutex], caplog: pytest.LogCaptureFixture, fair: bool
) -> None:
    # What a cycle costs the client beyond its two statements is the library's own Python: its
    # calls (psycopg's and the standard library's aside) stay few, with no hook, span or DEBUG log.
    # A fair Mutex's too, whose statements also ask the line of waiters: 52 calls measured (a Mutex's
    # 38), and 91 when its acquire went through the flow's steps.
    caplog.set_level(logging.INFO, logger="postgres_mutex")
    mutex = make_mutex(fair=fair)
    for _ in range(3):  # the connection's first statements set its session up and prepare
        with mutex.acquire() as acquired:
            assert acquired
    library = str(Path(postgres_mutex.__file__).resolve().parent)
    calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(library):
            calls += 1

    cycles = 10
    sys.setprofile(profile)
    try:
        for _ in range(cycles):
            with mutex.acquire() as acquired:
                assert acquired
    finally:
        sys.setprofile(None)
    assert calls / cycles <= 60, f"{calls / cycles:g} calls of the library's own per cycle"


def test_an_uncontended_cycle_still_says_at_debug_what_it_did(
    make_mutex: Callable[..., Mutex], caplog: pytest.LogCaptureFixture
) -> None:
    mutex = make_mutex()
    with mutex.acquire() as acquired:  # the table's shape is known from here on: the next cycle is the plain one
        assert acquired
    caplog.set_level(logging.DEBUG, logger="postgres_mutex")
    with mutex.acquire() as acquired:
        assert acquired
    said = [record.getMessage() for record in caplog.records]
    assert f"acquired lock {mutex.lock_name!r} (instance_id {mutex.instance_id!r})" in said
    assert f"released lock {mutex.lock_name!r} (instance_id {mutex.instance_id!r})" in said
