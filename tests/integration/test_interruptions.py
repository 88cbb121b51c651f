"""Acquires and releases cut off where they stand: an exception raised into a waiting acquire, asyncio.run ending.

A job runner's timeout raised from a signal handler, or the loop's shutdown cancelling what
is left, reaches a statement mid-flight: the statement is stopped on the server or run to its
end, never left to land later, and no row is left behind.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import psycopg
import pytest

from postgres_mutex import Mutex
from tests.support.fixtures import await_until, held_in_a_task

Holder = Callable[..., str | None]


class JobTimeout(Exception):
    """What a job runner raises from its signal handler when a job runs too long."""


def _alarm_in(seconds: float) -> Callable[[], None]:
    def raise_job_timeout(signum: int, frame: FrameType | None) -> None:
        raise JobTimeout("the job ran too long")

    previous = signal.signal(signal.SIGALRM, raise_job_timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)

    def restore() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    return restore


def test_an_exception_raised_into_a_waiting_acquire_leaves_the_mutex_usable_and_no_row(
    make_mutex: Callable[..., Mutex],
    uncommitted_insert: psycopg.Connection[Any],
    holder_id: Holder,
    admin: psycopg.Connection[Any],
    lock_name: str,
) -> None:
    mutex = make_mutex(operation_timeout=5.0)
    restore = _alarm_in(0.5)
    try:
        with pytest.raises(JobTimeout), mutex.acquire():
            pytest.fail("must not run")
    finally:
        restore()
    uncommitted_insert.rollback()  # the other session gives up: had our INSERT gone on waiting, it would land now
    with mutex.acquire(blocking=True, timeout=5) as acquired:
        assert acquired, "the Mutex is usable again, with no 'another command is already in progress'"
    mutex.close()
    time.sleep(0.5)  # long enough for a statement still running on the server to have landed
    assert holder_id() is None, "no row of this Mutex remains"
    busy = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
        (f"%{lock_name}%",),
    ).fetchone()
    assert busy == (0,)


# Slow heartbeats: no heartbeat queues behind the row lock these tests hold.
QUIET_HEARTBEAT = {"heartbeat_interval": 20.0, "alert_threshold": 60.0, "stale_threshold": 120.0}


def _ours_waiting_on_a_row_lock(admin: psycopg.Connection[Any]) -> bool:
    """Whether a statement of this process's library connections waits on another session's row lock."""
    found = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name LIKE %s",
        (f"postgres-mutex %{socket.gethostname()}:{os.getpid()}",),
    ).fetchone()
    return found is not None and found[0] > 0


def _loop_and_driver_complaints(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What asyncio (an unhandled task error at shutdown) or psycopg (its own cancel handling) logged."""
    gc.collect()  # a task destroyed while pending is reported when it is collected
    return [r.getMessage() for r in caplog.records if r.name in ("asyncio", "psycopg") and r.levelno >= logging.WARNING]


# With psycopg 3.3 and later: 3.2 (on Python 3.11) waits through helper tasks of its
# own, which the loop's shutdown cancels (.ci/run leaves this test out of its psycopg 3.2 pass).
def test_a_release_under_way_when_asyncio_run_ends_is_finished_not_cut_off(
    make_mutex: Callable[..., Mutex],
    dsn: str,
    lock_name: str,
    admin: psycopg.Connection[Any],
    holder_id: Holder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    mutex = make_mutex(operation_timeout=10.0, **QUIET_HEARTBEAT)
    blocker = psycopg.connect(dsn)  # a transaction: it keeps the row locked until it ends
    letting_go = threading.Timer(1.0, blocker.rollback)

    async def main() -> None:
        task = await held_in_a_task(mutex)
        blocker.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s FOR UPDATE", (lock_name,))
        task.cancel()  # the block ends: its release waits behind the other session's row lock
        await await_until(lambda: _ours_waiting_on_a_row_lock(admin))
        letting_go.start()
        # Returning now: asyncio.run cancels every task left, the release's included.

    try:
        asyncio.run(main())
        letting_go.join()
    finally:
        letting_go.cancel()
        blocker.close()
    assert holder_id() is None, "the release ran to its end: no row is left to expire"
    assert _loop_and_driver_complaints(caplog) == []


def test_asyncio_run_ending_during_an_acquire_stops_it_on_the_server_within_a_moment(
    make_mutex: Callable[..., Mutex],
    uncommitted_insert: psycopg.Connection[Any],
    admin: psycopg.Connection[Any],
    holder_id: Holder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    mutex = make_mutex(operation_timeout=2.0, **QUIET_HEARTBEAT)
    returned_at: list[float] = []
    jobs: list[asyncio.Task[None]] = []

    async def main() -> None:
        async def job() -> None:
            async with mutex.acquire_async():
                pytest.fail("must not run")

        jobs.append(asyncio.create_task(job()))
        await await_until(lambda: _ours_waiting_on_a_row_lock(admin))
        returned_at.append(time.monotonic())
        # Returning now: asyncio.run cancels the acquire while its statement waits on the server.

    asyncio.run(main())
    assert time.monotonic() - returned_at[0] < 1.5, "stopped by a cancel request, not by the 2 s deadline"
    assert jobs[0].cancelled()
    # The cancel request reaches the server a moment after the loop let go: well before the 2 s deadline.
    while _ours_waiting_on_a_row_lock(admin):
        assert time.monotonic() - returned_at[0] < 1.5, "something of ours goes on waiting on the server"
        time.sleep(0.02)
    uncommitted_insert.rollback()
    assert holder_id() is None, "the stopped acquire's INSERT never lands"
    assert _loop_and_driver_complaints(caplog) == [], "the statement's own error is the library's to handle"


_EXIT_AFTER_CUT_ACQUIRE = """
import asyncio, sys, time
import psycopg
from postgres_mutex import Mutex

dsn, name = sys.argv[1], sys.argv[2]
blocker = psycopg.connect(dsn)
blocker.execute(
    "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) VALUES (%s, 'blocker', now(), now())",
    (name,),
)
watch = psycopg.connect(dsn, autocommit=True)
mutex = Mutex(dsn, name, operation_timeout=1.0, heartbeat_interval=5.0, alert_threshold=20.0, stale_threshold=60.0)


async def main():
    async def job():
        async with mutex.acquire_async():
            raise SystemExit("must not run")

    asyncio.get_running_loop().create_task(job())
    deadline = time.monotonic() + 30
    while not watch.execute(
        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name LIKE 'postgres-mutex %%'"
    ).fetchone():
        assert time.monotonic() < deadline, "the acquire never waited on the server"
        await asyncio.sleep(0.02)


asyncio.run(main())
blocker.rollback()
print("returned", flush=True)
"""


def test_a_process_whose_asyncio_run_ended_during_an_acquire_exits_within_its_budget(
    dsn: str, lock_name: str, schema: None
) -> None:
    """The acquire cut off at asyncio.run's end leaves a clean-up of its row behind: exit sends it within
    the exit's budget (one operation_timeout), and never waits for the cut-off statement's turn for good."""
    child = subprocess.Popen(
        [sys.executable, "-c", _EXIT_AFTER_CUT_ACQUIRE, dsn, lock_name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "returned", child.stderr.read() if child.stderr else ""
        returned_at = time.monotonic()
        child.wait(timeout=30)
        exited_in = time.monotonic() - returned_at
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert exited_in < 10.0, f"exit took {exited_in:.1f}s"


_ACQUIRE_AFTER_A_LOOP_ENDED_MID_CLEANUP = """
import asyncio, sys, time
import psycopg
from postgres_mutex import LockAcquisitionTimeout, Mutex

dsn, name = sys.argv[1], sys.argv[2]
setup = psycopg.connect(dsn, autocommit=True)
setup.execute(  # a row carrying this Mutex's id, as a crashed run of the same instance would leave
    "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) VALUES (%s, 'me', now(), now())",
    (name,),
)
blocker = psycopg.connect(dsn)
blocker.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s FOR UPDATE", (name,))  # the row stays locked
watch = psycopg.connect(dsn, autocommit=True)
mutex = Mutex(
    dsn, name, instance_id="me", operation_timeout=1.0, heartbeat_interval=5.0, alert_threshold=20.0,
    stale_threshold=60.0, poll_interval=0.05,
)


def waiting_on_the_row():
    return watch.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE wait_event_type = 'Lock' AND application_name LIKE 'postgres-mutex %%'"
    ).fetchone()[0]


async def first():
    # The acquire waits behind the row lock; cut off, it leaves a clean-up of its row, which waits there too.
    try:
        async with asyncio.timeout(0.3):
            async with mutex.acquire_async():
                raise SystemExit("must not run")
    except TimeoutError:
        pass
    deadline = time.monotonic() + 10
    while not waiting_on_the_row():  # the clean-up is on the wire
        assert time.monotonic() < deadline, "the clean-up never went out"
        await asyncio.sleep(0.01)


async def second():
    began = time.monotonic()
    try:
        async with mutex.acquire_async(timeout=0.5):
            raise SystemExit("must not run: the row is still locked")
    except LockAcquisitionTimeout:
        print(f"timed out after {time.monotonic() - began:.2f}s", flush=True)


asyncio.run(first())  # ends with the clean-up mid-statement
asyncio.run(second())
blocker.rollback()
"""


def test_an_acquire_after_an_event_loop_ended_mid_clean_up_waits_no_longer_than_its_timeout(
    dsn: str, lock_name: str, schema: None
) -> None:
    """A clean-up cut off when its event loop ended never gives its turn back: a later acquire of the same
    Mutex waits for it only until it can no longer land, and never past its own timeout."""
    child = subprocess.Popen(
        [sys.executable, "-c", _ACQUIRE_AFTER_A_LOOP_ENDED_MID_CLEANUP, dsn, lock_name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        pytest.fail(f"the second acquire never returned: {err[-2000:]}")
    said = out.strip()
    assert said.startswith("timed out after "), err[-2000:]
    assert float(said.removeprefix("timed out after ").removesuffix("s")) < 3.0
