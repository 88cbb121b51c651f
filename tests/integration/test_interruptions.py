"""Interrupted statements, users' server settings, and the errors people read."""

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
import uuid
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import psycopg
import pytest

from postgres_mutex import LockAcquisitionTimeout, LockNotHeldError, Mutex
from postgres_mutex._secrets import Redactor
from postgres_mutex.watcher import StaleWatcher
from tests.support.faultproxy import FaultProxy
from tests.support.fixtures import FAST, ROOT, RecordingMetrics, await_until, held_in_a_task, wait_until
from tests.support.postgres_server import PostgresServer

Holder = Callable[..., str | None]

# The thresholds: the default operation_timeout is then about 0.73 s.
SHORT = {"heartbeat_interval": 0.2, "alert_threshold": 1.0, "stale_threshold": 3.0, "poll_interval": 0.05}


class JobTimeout(Exception):
    """What a job runner raises from its signal handler when a job runs too long."""


@pytest.fixture
def uncommitted_insert(dsn: str, lock_name: str, schema: None) -> Iterator[psycopg.Connection[Any]]:
    """Another session inserts the lock's row and does not commit: an acquire of it waits on the server."""
    with psycopg.connect(dsn) as blocker:
        blocker.execute(
            "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) "
            "VALUES (%s, 'blocker', now(), now())",
            (lock_name,),
        )
        yield blocker
        blocker.rollback()


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
    assert not _ours_waiting_on_a_row_lock(admin), "nothing of ours goes on waiting on the server"
    uncommitted_insert.rollback()
    assert holder_id() is None, "the stopped acquire's INSERT never lands"
    assert _loop_and_driver_complaints(caplog) == [], "the statement's own error is the library's to handle"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_run_stopped_by_a_signal_while_its_acquire_waits_on_the_server_leaves_nothing_behind(
    dsn: str, lock_name: str, uncommitted_insert: psycopg.Connection[Any], admin: psycopg.Connection[Any], signum: int
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "postgres_mutex", "run", "--dsn", dsn, "--lock", lock_name, "--", "true"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Observed, not slept on: the command's acquire is waiting on the other session's row.
        wait_until(
            lambda: (
                admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name LIKE %s",
                    (f"postgres-mutex %:{proc.pid}",),
                ).fetchone()
                == (1,)
            ),
            timeout=20,
        )
        proc.send_signal(signum)
        assert proc.wait(timeout=10) == 128 + signum
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    uncommitted_insert.rollback()
    time.sleep(0.5)  # what was still running on the server would have landed by now
    result = subprocess.run(
        [sys.executable, "-m", "postgres_mutex", "run", "--dsn", dsn, "--lock", lock_name, "--", "true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, f"the next run got the lock at once: {result.stderr}"


def test_after_a_loss_on_a_dead_network_leaving_closing_and_exiting_each_take_one_operation_timeout(
    pg: PostgresServer, schema: None, lock_name: str
) -> None:
    proxy = FaultProxy(pg.host, pg.port)
    dsn = pg.dsn(host="127.0.0.1", port=proxy.port, sslmode="disable", gssencmode="disable")
    code = f"""
import sys, time
from postgres_mutex import LockNotHeldError, Mutex
mutex = Mutex({dsn!r}, {lock_name!r}, heartbeat_interval=0.2, alert_threshold=1.0, stale_threshold=3.0)
print("timeout", mutex._lock.timing.operation_timeout, flush=True)
try:
    with mutex.acquire() as acquired:
        assert acquired
        print("held", flush=True)
        while mutex.held:
            time.sleep(0.01)
        lost_at = time.monotonic()
except LockNotHeldError:
    print("left", time.monotonic() - lost_at, flush=True)
started = time.monotonic()
mutex.close()
print("closed", time.monotonic() - started, flush=True)
print("exiting", time.monotonic(), flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        timeout = float(proc.stdout.readline().split()[1])
        assert proc.stdout.readline().strip() == "held"
        proxy.silence()
        left = float(proc.stdout.readline().split()[1])
        closed = float(proc.stdout.readline().split()[1])
        exiting = float(proc.stdout.readline().split()[1])
        proc.wait(timeout=30)
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.heal()
        proxy.close()
    assert timeout < 1.0, "the default operation_timeout fits the short thresholds"
    assert left < timeout, "leaving the block sends nothing for a lock known to be lost"
    assert closed < timeout
    # The clean-up needs a new connection (the deadline cut the old one): libpq
    # waits at least 2 s for a connect, a bound the docs state beside operation_timeout.
    connect = 2.0
    assert exited - exiting < timeout + connect + 1.0, "the exit's clean-up is bounded by one operation_timeout"


def test_an_exit_while_holding_on_a_dead_network_takes_one_operation_timeout(
    pg: PostgresServer, schema: None, lock_name: str
) -> None:
    # The release at exit runs in the exiting thread (Python 3.12 starts none
    # in atexit callbacks): the statement deadline must still cut it off.
    proxy = FaultProxy(pg.host, pg.port)
    dsn = pg.dsn(host="127.0.0.1", port=proxy.port, sslmode="disable", gssencmode="disable", connect_timeout="2")
    code = f"""
import sys, time
from postgres_mutex import Mutex
mutex = Mutex({dsn!r}, {lock_name!r}, heartbeat_interval=0.2, alert_threshold=1.0, stale_threshold=3.0)
mutex.acquire()
print("held", mutex._lock.timing.operation_timeout, flush=True)
sys.stdin.readline()
print("exiting", time.monotonic(), flush=True)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        timeout = float(proc.stdout.readline().split()[1])
        proxy.silence()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        exiting = float(proc.stdout.readline().split()[1])
        assert proc.wait(timeout=30) == 0
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.heal()
        proxy.close()
    assert exited - exiting < timeout + 1.0, "the exit's release is bounded by one operation_timeout"


def test_a_waiting_singleton_sibling_never_starves_the_holders_heartbeat(
    make_mutex: Callable[..., Mutex], lock_name: str, metrics: RecordingMetrics
) -> None:
    holder = make_mutex(lock_name=f"{lock_name}-held", poll_interval=45.0, metrics=metrics)
    other = make_mutex(lock_name=f"{lock_name}-busy")
    waiting = threading.Event()

    @holder.singleton(f"{lock_name}-busy", blocking=True, timeout=3.0)
    def job() -> None:
        pytest.fail("the sibling's lock is busy")

    timed_out: list[BaseException] = []

    def run_job() -> None:
        waiting.set()
        try:
            job()
        except LockAcquisitionTimeout as exc:
            timed_out.append(exc)

    with holder.acquire(), other.acquire():
        thread = threading.Thread(target=run_job)
        thread.start()
        waiting.wait(5)
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            assert holder.held
            time.sleep(0.05)
        thread.join(timeout=10)
    assert len(timed_out) == 1, "the sibling waited its whole timeout, on the listener, not on the connection"
    assert metrics.named("alert") == []
    assert metrics.named("lost") == []


def _role_dsn(pg: PostgresServer, admin: psycopg.Connection[Any], setting: str) -> Iterator[str]:
    role = f"mutex_setting_{uuid.uuid4().hex[:8]}"
    from tests.support.postgres_server import PASSWORD

    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON mutex_lock TO {role}")
    admin.execute(f"GRANT USAGE ON SEQUENCE mutex_lock_token_seq TO {role}")
    admin.execute(f"ALTER ROLE {role} SET {setting}")
    try:
        yield pg.dsn(user=role, password=PASSWORD)
    finally:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")


@pytest.fixture
def serializable_role(pg: PostgresServer, admin: psycopg.Connection[Any], needs_superuser: None) -> Iterator[str]:
    yield from _role_dsn(pg, admin, "default_transaction_isolation = 'serializable'")


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


@pytest.fixture
def idle_closing_role(pg: PostgresServer, admin: psycopg.Connection[Any], needs_superuser: None) -> Iterator[str]:
    yield from _role_dsn(pg, admin, "idle_session_timeout = '300ms'")


def test_a_server_closing_idle_sessions_between_heartbeats_is_ridden_out_quietly(
    idle_closing_role: str, lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = RecordingMetrics()
    mutex = Mutex(
        idle_closing_role, lock_name, heartbeat_interval=0.5, alert_threshold=2.0, stale_threshold=6.0, metrics=metrics
    )
    with caplog.at_level(logging.WARNING, logger="postgres_mutex"), mutex.acquire():
        wait_until(lambda: len(metrics.named("heartbeat_latency")) >= 6, timeout=15)
        assert mutex.held
    mutex.close()
    assert metrics.named("heartbeat_failed") == [], "a connection closed while idle is no failure"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# -- inputs ---------------------------------------------------------------------------


def test_a_single_name_given_as_lock_names_is_refused_not_iterated(dsn: str) -> None:
    with pytest.raises(TypeError, match=r"lock_names must be a list of lock names.*\['nightly'\]"):
        StaleWatcher(dsn, lock_names="nightly")


@pytest.mark.parametrize("argument", ["lock_name", "instance_id"])
def test_a_lone_surrogate_is_a_value_error_naming_the_argument(dsn: str, argument: str) -> None:
    bad = "job-\udcff"
    kwargs: dict[str, Any] = {"lock_name": "job", argument: bad}
    with pytest.raises(ValueError, match=argument):
        Mutex(dsn, **kwargs)


@pytest.mark.parametrize(
    ("argument", "value"),
    [("stale_threshold", 1e300), ("alert_threshold", 2e9), ("operation_timeout", 3e6)],
)
def test_values_postgresql_or_libpq_cannot_take_are_refused_at_construction(
    dsn: str, argument: str, value: float
) -> None:
    kwargs: dict[str, Any] = {argument: value}
    if argument == "alert_threshold":
        kwargs["stale_threshold"] = 3e9
    with pytest.raises(ValueError, match=argument):
        Mutex(dsn, "job", **kwargs)


def test_the_cli_refuses_a_huge_threshold_as_a_usage_error(dsn: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "postgres_mutex",
            "run",
            "--dsn",
            dsn,
            "--lock",
            "x",
            "--stale-threshold",
            "1e300",
            "--",
            "true",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "--stale-threshold must be at most" in result.stderr


@pytest.mark.parametrize("password", ["e", "ab", "nnec"])
def test_a_short_password_is_masked_where_it_appears_and_nowhere_else(password: str) -> None:
    redact = Redactor(f"host=h user=u password={password} dbname=d").redact
    assert redact("connection failed: server closed the connection") == (
        "connection failed: server closed the connection"
    ), "ordinary words are not garbled, and their letters give nothing away"
    assert redact(f"host=h user=u password={password} dbname=d") == "host=h user=u password=*** dbname=d"
    assert redact(f"postgresql://u:{password}@h/d") == "postgresql://u:***@h/d"
    assert redact(f'invalid value: "{password}"') == 'invalid value: "***"'


# -- the release contract ---------------------------------------------------------------


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
