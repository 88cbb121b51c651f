"""Dead networks, lost replies, resets and restarts: nothing hangs, nothing is orphaned."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from postgres_mutex import (
    DatabaseError,
    LockAcquisitionTimeout,
    LockNotHeldError,
    LockTable,
    Mutex,
    OperationTimeout,
)
from postgres_mutex.client import core_of
from tests.support.faultproxy import FaultProxy
from tests.support.fixtures import FAST, ROOT, RecordingMetrics, freeze, wait_until
from tests.support.postgres_server import PostgresServer

Holder = Callable[..., str | None]
Row = Callable[..., tuple[Any, ...] | None]

# Long enough that no background heartbeat lands inside a measured window.
QUIET = {"heartbeat_interval": 5.0, "alert_threshold": 10.0, "stale_threshold": 20.0}


@pytest.mark.parametrize("options", [{}, {"reclaim_disconnected_after": 15.0}], ids=["plain", "naming its session"])
def test_acquire_heartbeat_and_release_are_one_round_trip_each(
    make_mutex: Callable[..., Mutex],
    proxy: FaultProxy,
    proxy_dsn: str,
    admin: psycopg.Connection[Any],
    lock_name: str,
    options: dict[str, float],
) -> None:
    # A holder that names its session (reclaim_disconnected_after) does so in the same statements.
    mutex, rival = make_mutex(proxy_dsn, **QUIET, **options), make_mutex(proxy_dsn, **QUIET, **options)
    for _ in range(2):
        # Connect and use each statement first: the handshake, and the one more
        # round trip that prepares a statement on a connection, are not what is measured.
        with mutex.acquire():
            mutex.heartbeat()

    def round_trips(operation: Callable[[], object]) -> int:
        before = proxy.ready_for_query
        operation()
        return proxy.ready_for_query - before

    for _ in range(7):  # every use alike, before and past psycopg's own threshold of five
        acquire = mutex.acquire()
        assert round_trips(acquire.__enter__) == 1, "acquire"
        assert round_trips(mutex.heartbeat) == 1, "heartbeat"
        with rival.acquire():  # connect
            pass
        contended = rival.acquire()
        assert round_trips(contended.__enter__) == 1, "contended acquire"
        contended.__exit__(None, None, None)
        assert round_trips(functools.partial(acquire.__exit__, None, None, None)) == 1, "release"

    # Reclaiming a stale row is the same single statement.
    with rival.acquire():
        admin.execute(
            "UPDATE mutex_lock SET last_heartbeat = now() - interval '1 hour' WHERE lock_name = %s", (lock_name,)
        )
        freeze(rival)
        reclaim = mutex.acquire()
        assert round_trips(reclaim.__enter__) == 1, "reclaim"
        reclaim.__exit__(None, None, None)
        with pytest.raises(Exception, match="not held"):
            rival.release()


async def test_async_operations_are_one_round_trip_each(
    amake_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str
) -> None:
    mutex = amake_mutex(proxy_dsn, **QUIET)
    for _ in range(2):  # connected, each statement prepared
        async with mutex.acquire_async():
            await mutex.heartbeat_async()
    before = proxy.ready_for_query
    async with mutex.acquire_async():
        assert proxy.ready_for_query - before == 1
        await mutex.heartbeat_async()
        assert proxy.ready_for_query - before == 2
    assert proxy.ready_for_query - before == 3


def test_on_a_direct_connection_acquire_and_release_are_parsed_once_then_only_run(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str
) -> None:
    """The server parses and plans a lock cycle's statements once per connection: every later cycle only runs them."""
    mutex = make_mutex(proxy_dsn, **QUIET)
    for _ in range(2):  # the connection, its session, and each statement's first use
        with mutex.acquire():
            pass
    parsed, simple, runs = proxy.sent("P"), proxy.sent("Q"), proxy.sent("B")
    for _ in range(10):
        with mutex.acquire():
            pass
    assert proxy.sent("P") == parsed, "a statement parsed again"
    assert proxy.sent("Q") == simple, "a statement sent as a simple query, to be parsed and planned again"
    assert proxy.sent("B") - runs == 20, "each acquire and release runs a prepared statement"


def test_a_blocking_acquire_with_a_short_timeout_leaves_its_release_prepared(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str
) -> None:
    """A deadline much shorter than the session's (a blocking acquire's, which counts down) goes with its own
    statement, which the server parses and plans, and leaves the session's: the release after it still fits
    it, and runs prepared."""
    mutex = make_mutex(proxy_dsn, operation_timeout=5.0, **QUIET)  # each timeout below is under half of it
    for _ in range(3):  # the connection, its session, and the release's first use
        with mutex.acquire(blocking=True, timeout=1.0):
            pass
    parsed, simple, runs = proxy.sent("P"), proxy.sent("Q"), proxy.sent("B")
    timeouts = (1.0, 0.5, 0.25, 1.5, 0.8) * 2
    for timeout in timeouts:
        with mutex.acquire(blocking=True, timeout=timeout):
            pass
    assert proxy.sent("P") == parsed, "a statement parsed again"
    assert proxy.sent("Q") - simple == len(timeouts), "the acquires alone sent as simple queries"
    assert proxy.sent("B") - runs == len(timeouts), "each release runs its prepared statement"


async def test_async_statements_are_parsed_once_per_connection(
    amake_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str
) -> None:
    mutex = amake_mutex(proxy_dsn, **QUIET)
    for _ in range(2):
        async with mutex.acquire_async():
            pass
    parsed, simple = proxy.sent("P"), proxy.sent("Q")
    for _ in range(5):
        async with mutex.acquire_async():
            pass
    assert (proxy.sent("P"), proxy.sent("Q")) == (parsed, simple)


async def test_async_blocking_acquires_with_short_timeouts_leave_their_releases_prepared(
    amake_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str
) -> None:
    mutex = amake_mutex(proxy_dsn, operation_timeout=5.0, **QUIET)
    for _ in range(3):
        async with mutex.acquire_async(blocking=True, timeout=1.0):
            pass
    parsed, simple, runs = proxy.sent("P"), proxy.sent("Q"), proxy.sent("B")
    timeouts = (1.0, 0.5, 0.25, 1.5, 0.8)
    for timeout in timeouts:
        async with mutex.acquire_async(blocking=True, timeout=timeout):
            pass
    assert (proxy.sent("P"), proxy.sent("Q") - simple, proxy.sent("B") - runs) == (parsed, len(timeouts), len(timeouts))


@contextlib.contextmanager
def stale_row_locked_elsewhere(admin: psycopg.Connection[Any], dsn: str, lock_name: str) -> Iterator[None]:
    """A stale row of the lock, locked by another session's open transaction (a holder's fenced one, say)."""
    admin.execute(
        "INSERT INTO mutex_lock (lock_name, locked, instance_id, last_heartbeat, acquired_at)"
        " VALUES (%s, 1, 'gone', now() - interval '1 hour', now() - interval '1 hour')",
        (lock_name,),
    )
    with psycopg.connect(dsn) as blocker:
        blocker.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s FOR UPDATE", (lock_name,))
        yield
        blocker.rollback()


def test_a_statement_stuck_behind_a_row_lock_is_ended_by_the_server_and_the_connection_kept(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """The server's own deadline, a little inside the client's, ends a statement that waits on a row lock.

    A stale row locked by a long transaction (a holder's fenced one, say): the
    reclaiming acquire waits for it on the server. The server cancels it
    before the client would have to cut the connection, so the statement can
    never land later, and the connection serves the next one.
    """
    slack = 0.5  # how late a thread may run on a busy two-core machine
    timeout = 1.0
    mutex = make_mutex(proxy_dsn, operation_timeout=timeout)
    for _ in range(2):  # connected, session set up, statements prepared
        with mutex.acquire():
            pass
    with stale_row_locked_elsewhere(admin, dsn, mutex.lock_name):
        connections = proxy.accepted
        started = time.monotonic()
        attempt = mutex.acquire(blocking=False)
        assert not attempt.__enter__(), "not acquired: the row stayed locked for the whole attempt"
        assert time.monotonic() - started < timeout + slack
    with mutex.acquire() as acquired:
        assert acquired, "the stale row is reclaimed once the row lock is gone"
    assert proxy.accepted == connections, "the same connection served on: nothing was cut"


def test_a_blocking_acquire_near_its_deadline_is_ended_by_the_server_within_it(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """A statement whose deadline is shorter than the session's carries its own, and the server keeps to it."""
    slack = 0.5  # how late a thread may run on a busy two-core machine
    mutex = make_mutex(proxy_dsn, operation_timeout=5.0)
    for _ in range(2):  # the session's deadline is now the five-second operations'
        with mutex.acquire():
            pass
    with stale_row_locked_elsewhere(admin, dsn, mutex.lock_name):
        connections = proxy.accepted
        started = time.monotonic()
        with (
            pytest.raises(LockAcquisitionTimeout, match="not acquired within 1s") as caught,
            mutex.acquire(blocking=True, timeout=1.0),
        ):
            pytest.fail("must not run")
        assert time.monotonic() - started < 1.0 + slack
    # The caller asked for a timeout, and gets one: `except LockAcquisitionTimeout` (busy, skip
    # this run) works; what stood in the way is its cause.
    assert isinstance(caught.value.__cause__, OperationTimeout)
    assert "cancelled there" in str(caught.value.__cause__)
    with mutex.acquire() as acquired:
        assert acquired
    assert proxy.accepted == connections, "every attempt was ended by the server: nothing was cut"


def test_a_column_that_changes_type_under_prepared_statements_costs_no_acquire(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], dsn: str
) -> None:
    """A wider instance_id (or a table made again with other types) is met with a fresh preparation, not errors."""
    table = f"mutex_lock_retyped_{uuid.uuid4().hex[:8]}"
    LockTable(dsn, table=table).create()
    try:
        mutex = make_mutex(table=table)
        for _ in range(3):
            with mutex.acquire() as acquired:
                assert acquired
        admin.execute(
            sql.SQL("ALTER TABLE {} ALTER COLUMN instance_id TYPE varchar(128)").format(sql.Identifier(table))
        )
        for _ in range(3):
            with mutex.acquire() as acquired:
                assert acquired
        mutex.close()
    finally:
        admin.execute(sql.SQL("DROP TABLE {} CASCADE").format(sql.Identifier(table)))


def test_a_silent_network_cannot_hang_an_acquire(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, holder_id: Holder
) -> None:
    mutex = make_mutex(proxy_dsn, operation_timeout=0.5)
    with mutex.acquire():
        pass
    proxy.silence()
    started = time.monotonic()
    with pytest.raises(OperationTimeout) as caught, mutex.acquire():
        pytest.fail("must not run")
    assert time.monotonic() - started < 1.5, "one operation_timeout, the clean-up goes to the background"
    assert caught.value.transient
    proxy.heal()  # the partition delivers what it held: the cut-off statement may still land
    wait_until(lambda: holder_id() is None, timeout=5)
    with mutex.acquire() as acquired:
        assert acquired, "the Mutex reconnects once the network is back"


@pytest.mark.parametrize(
    ("operation_timeout", "timeout", "bound"),
    [
        # Attempts time out; a retry's connect (libpq's 2 s floor) may start just before the
        # timeout; then one clean-up connect for the unanswered attempt.
        (0.5, 1.0, 1.0 + 2.0 + 2.0 + 1.0),
        # The one attempt is cut at the timeout, not at operation_timeout; then the clean-up
        # connect (connect_timeout follows operation_timeout: 3 s).
        (3.0, 0.5, 0.5 + 0.1 + 3.0 + 0.8),
    ],
)
def test_a_silent_network_cannot_hang_a_blocking_acquire_past_its_timeout(
    make_mutex: Callable[..., Mutex],
    proxy: FaultProxy,
    proxy_dsn: str,
    operation_timeout: float,
    timeout: float,
    bound: float,
) -> None:
    mutex = make_mutex(proxy_dsn, operation_timeout=operation_timeout)
    with mutex.acquire():
        pass
    proxy.silence()
    started = time.monotonic()
    with pytest.raises(LockAcquisitionTimeout) as caught, mutex.acquire(blocking=True, timeout=timeout):
        pytest.fail("must not run")
    assert time.monotonic() - started < bound
    assert isinstance(caught.value.__cause__, DatabaseError), "what stood in the way is chained"


@pytest.mark.parametrize("connect_timeout", ["30", "0"])
def test_a_users_long_connect_timeout_cannot_hold_an_acquire_past_its_timeout(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, connect_timeout: str
) -> None:
    # The user's DSN allows connects of 30 s (or, with 0, forever); an acquire of 1 s still ends
    # near its second: its reconnect waits no longer than the acquire may (libpq's floor: 2 s).
    mutex = make_mutex(f"{proxy_dsn} connect_timeout={connect_timeout}", operation_timeout=0.5)
    with mutex.acquire():
        pass
    proxy.silence()
    started = time.monotonic()
    with pytest.raises(LockAcquisitionTimeout), mutex.acquire(blocking=True, timeout=1.0):
        pytest.fail("must not run")
    assert time.monotonic() - started < 1.0 + 2.0 + 2.0 + 1.0


async def test_a_silent_network_cannot_hang_an_async_acquire(
    amake_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str
) -> None:
    mutex = amake_mutex(proxy_dsn, operation_timeout=0.5)
    async with mutex.acquire_async():
        pass
    proxy.silence()
    started = time.monotonic()
    with pytest.raises(OperationTimeout):
        async with mutex.acquire_async(blocking=False):
            pytest.fail("must not run")
    assert time.monotonic() - started < 5.0


def test_a_silent_network_cannot_hang_a_heartbeat_or_a_release(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, metrics: RecordingMetrics, holder_id: Holder
) -> None:
    mutex = make_mutex(proxy_dsn, operation_timeout=0.5, metrics=metrics, **QUIET)
    acquire = mutex.acquire()
    assert acquire.__enter__()
    proxy.silence()
    started = time.monotonic()
    with pytest.raises(OperationTimeout):
        mutex.heartbeat()
    assert time.monotonic() - started < 3.0
    assert len(metrics.named("heartbeat_failed")) == 1
    started = time.monotonic()
    with pytest.raises(DatabaseError, match="deleted in the background"):
        acquire.__exit__(None, None, None)
    # One operation_timeout, plus a connect (libpq waits at least 2 s for one).
    assert time.monotonic() - started < 0.5 + 2.0 + 1.0
    proxy.heal()
    wait_until(lambda: holder_id() is None, timeout=10)


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


def test_an_exit_that_cannot_delete_what_an_unanswered_acquire_left_says_so(
    pg: PostgresServer, schema: None, lock_name: str, holder_id: Holder
) -> None:
    # The row stays until reclaimed after stale_threshold: whoever reads the log must learn why.
    proxy = FaultProxy(pg.host, pg.port)
    dsn = pg.dsn(host="127.0.0.1", port=proxy.port, sslmode="disable", gssencmode="disable", connect_timeout="2")
    code = f"""
import sys
from postgres_mutex import Mutex, OperationTimeout
mutex = Mutex({dsn!r}, {lock_name!r}, heartbeat_interval=0.2, alert_threshold=1.0, stale_threshold=3.0,
              operation_timeout=0.5)
for _ in range(2):
    with mutex.acquire():
        pass
print("ready", flush=True)
sys.stdin.readline()
try:
    with mutex.acquire():
        pass
except OperationTimeout:
    print("unanswered", flush=True)
sys.stdin.readline()
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        proxy.drop_replies()  # the acquire lands, its reply never comes back...
        proxy.silence(existing=False)  # ...and no new connection gets through to clean up
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "unanswered"
        assert holder_id() is not None, "the row the unanswered acquire left"
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.heal()
        proxy.close()
    assert "could not delete" in stderr, stderr
    assert repr(lock_name) in stderr, stderr


def test_a_release_behind_a_heartbeats_reconnect_takes_one_connect_not_two(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, metrics: RecordingMetrics
) -> None:
    timeout = 0.75
    mutex = make_mutex(
        proxy_dsn,
        heartbeat_interval=0.2,
        alert_threshold=1.0,
        stale_threshold=3.0,
        operation_timeout=timeout,
        metrics=metrics,
    )
    acquire = mutex.acquire()
    assert acquire.__enter__()
    proxy.silence()
    wait_until(lambda: metrics.named("heartbeat_failed"), timeout=10)
    connections = proxy.accepted
    # The next heartbeat is reconnecting, on a network that answers nothing.
    wait_until(lambda: proxy.accepted > connections, timeout=10)
    started = time.monotonic()
    with pytest.raises(DatabaseError):
        acquire.__exit__(None, None, None)
    elapsed = time.monotonic() - started
    connect = 2.0  # libpq's least connect_timeout
    # The documented bound: one operation_timeout plus one connect, not the
    # heartbeat's connect and then one of its own.
    assert elapsed < timeout + connect + 0.5, elapsed


def test_an_acquire_whose_reply_is_lost_leaves_no_row_behind(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, holder_id: Holder
) -> None:
    mutex, other = make_mutex(proxy_dsn, operation_timeout=0.5), make_mutex()
    for _ in range(2):  # connected, the acquire prepared: the next one is a single message
        with mutex.acquire():
            pass
    proxy.drop_replies()  # the INSERT reaches the server; its answer never comes back
    started = time.monotonic()
    with pytest.raises(OperationTimeout) as caught, mutex.acquire():
        pytest.fail("must not run")
    assert time.monotonic() - started < 1.5, "one operation_timeout, the clean-up goes to the background"
    assert caught.value.outcome_unknown
    wait_until(lambda: holder_id() is None, timeout=5)  # the Mutex removed the row its unanswered acquire left
    with other.acquire() as acquired:
        assert acquired, "nobody waits out the stale threshold"


def test_a_blocking_acquire_takes_back_its_own_row_after_a_lost_reply(
    make_mutex: Callable[..., Mutex],
    proxy: FaultProxy,
    proxy_dsn: str,
    holder_id: Holder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    mutex = make_mutex(proxy_dsn, operation_timeout=0.5)
    for _ in range(2):  # connected, the acquire prepared: the next one is a single message
        with mutex.acquire():
            pass
    proxy.drop_replies()
    with mutex.acquire(blocking=True, timeout=10) as acquired:
        assert acquired
        assert holder_id() == mutex.instance_id
    assert "already carried" not in caplog.text, "taking back after a lost reply is expected, not suspicious"


def test_a_row_carrying_our_instance_id_is_taken_back_with_a_warning(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    mutex = make_mutex(instance_id="worker-7")
    # A previous process with the same instance_id died holding the lock a moment ago.
    admin.execute(
        "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) "
        "VALUES (%s, 'worker-7', now(), now())",
        (lock_name,),
    )
    with caplog.at_level(logging.WARNING, logger="postgres_mutex"), mutex.acquire() as acquired:
        assert acquired
    assert "already carried this Mutex's instance_id 'worker-7'" in caplog.text


def test_a_reset_connection_is_replaced_and_the_lock_kept(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, row: Row, metrics: RecordingMetrics
) -> None:
    mutex = make_mutex(proxy_dsn, metrics=metrics)
    with mutex.acquire():
        beats = len(metrics.named("heartbeat_latency"))
        opened = proxy.accepted
        proxy.reset()
        wait_until(lambda: len(metrics.named("heartbeat_latency")) > beats + 3)
        assert mutex.held
        assert proxy.accepted > opened, "the reset really broke the connection: a new one was opened"
        found = row()
        assert found is not None
        assert found[1] < FAST["alert_threshold"]
    assert metrics.named("heartbeat_failed") == [], "a connection reset while idle is replaced quietly"


def test_a_terminated_backend_is_replaced_and_the_lock_kept(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], metrics: RecordingMetrics, pg: PostgresServer
) -> None:
    name = f"terminated-{time.monotonic_ns()}"
    mutex = make_mutex(pg.dsn(application_name=name), metrics=metrics)
    with mutex.acquire():
        killed = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchall()
        assert killed == [(True,)], "the client's connection is visible by its application_name"
        beats = len(metrics.named("heartbeat_latency"))
        wait_until(lambda: len(metrics.named("heartbeat_latency")) > beats + 3)
        assert mutex.held


def test_the_lock_survives_a_postgres_restart(own_pg: PostgresServer, metrics: RecordingMetrics) -> None:
    dsn = own_pg.dsn()
    mutex = Mutex(dsn, "restart-survivor", metrics=metrics, **FAST)  # type: ignore[arg-type]
    mutex.create_schema()
    with mutex.acquire():
        # Down until a heartbeat has met the outage: one that only falls between two is not seen.
        own_pg.restart(while_down=lambda: wait_until(lambda: metrics.named("heartbeat_failed"), timeout=15))
        beats = len(metrics.named("heartbeat_latency"))
        wait_until(lambda: len(metrics.named("heartbeat_latency")) > beats + 3, timeout=15)
        assert mutex.held
        with psycopg.connect(dsn) as conn:
            found = conn.execute("SELECT instance_id FROM mutex_lock WHERE lock_name = 'restart-survivor'").fetchone()
        assert found == (mutex.instance_id,)
    assert len(metrics.named("heartbeat_failed")) >= 1, "the outage was seen and reported"
    mutex.close()


async def test_an_acquire_cancelled_while_its_reply_is_lost_leaves_no_row(
    amake_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, holder_id: Holder
) -> None:
    mutex, other = amake_mutex(proxy_dsn, operation_timeout=5.0), amake_mutex()
    for _ in range(2):  # connected, the acquire prepared: the next one is a single message
        async with mutex.acquire_async():
            pass
    proxy.drop_replies()  # the INSERT lands; the caller gives up before any reply or deadline
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(_enter(mutex), 0.5)
    # The cancelled acquire's row is removed in the background, at once.
    await _eventually(lambda: holder_id() is None)
    async with other.acquire_async(blocking=False) as acquired:
        assert acquired
    async with mutex.acquire_async(blocking=False) as again:
        assert again, "the cancelled Mutex is usable again"


async def test_a_release_cancelled_midway_is_finished_later_and_never_leaves_the_mutex_stuck(
    amake_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, holder_id: Holder
) -> None:
    mutex = amake_mutex(proxy_dsn, operation_timeout=5.0, **QUIET)
    acquire = mutex.acquire_async()
    assert await acquire.__aenter__()
    proxy.silence()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(mutex.release_async(), 0.3)
    assert not mutex.held
    wait_until(lambda: proxy.connections() == 0)  # the cut-off connection is gone, its DELETE with it
    proxy.heal()
    # Finished in the background as soon as the network is back, not after stale_threshold.
    await _eventually(lambda: holder_id() is None)
    async with mutex.acquire_async(blocking=False) as again:
        assert again, "the Mutex is not stuck"


def test_a_release_that_finds_the_row_gone_reports_the_loss(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str, metrics: RecordingMetrics
) -> None:
    lost: list[Any] = []
    mutex = make_mutex(on_lost=lost.append, metrics=metrics, **QUIET)
    with pytest.raises(LockNotHeldError, match="deleted or taken over"), mutex.acquire():
        admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
    wait_until(lambda: lost)  # on_lost runs on the client's event thread
    assert len(lost) == 1
    wait_until(lambda: metrics.named("lost"))
    assert len(metrics.named("lost")) == 1


def test_a_connection_closed_by_the_server_while_idle_does_not_fail_the_next_acquire(
    make_mutex: Callable[..., Mutex],
    admin: psycopg.Connection[Any],
    pg: PostgresServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = f"idle-closed-{time.monotonic_ns()}"
    mutex = make_mutex(pg.dsn(application_name=name))
    with mutex.acquire():
        pass
    killed = admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (name,)
    ).fetchall()
    assert killed == [(True,)]
    with caplog.at_level(logging.WARNING, logger="postgres_mutex"), mutex.acquire() as acquired:
        assert acquired
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == [], "no failure to report"


def test_a_waiter_stops_listening_once_it_has_the_lock(make_mutex: Callable[..., Mutex]) -> None:
    holder, waiter = make_mutex(), make_mutex()
    listener = core_of(waiter.client).engine().listener
    assert listener is not None
    holding = holder.acquire()
    assert holding.__enter__()
    stopped_listening: list[bool] = []

    def wait() -> None:
        with waiter.acquire(blocking=True, timeout=10) as acquired:
            assert acquired
            wait_until(lambda: not listener.listening)
            stopped_listening.append(True)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: listener.listening)  # the waiter listens for the release
    holding.__exit__(None, None, None)
    thread.join(timeout=15)
    assert stopped_listening == [True], "no LISTEN left behind to pile up notifications"


async def _eventually(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        await asyncio.sleep(0.02)


async def _enter(mutex: Mutex) -> None:
    async with mutex.acquire_async(blocking=False):
        pytest.fail("must not run")


def test_a_row_left_by_an_unanswered_acquire_is_removed_as_soon_as_the_network_is_back(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, holder_id: Holder, dsn: str
) -> None:
    slow_stale = {"heartbeat_interval": 0.5, "alert_threshold": 5.0, "stale_threshold": 30.0}
    mutex = make_mutex(proxy_dsn, operation_timeout=0.5, poll_interval=0.1, **slow_stale)
    other = make_mutex(dsn, **slow_stale)
    for _ in range(2):  # connected, the acquire prepared: the next one is a single message
        with mutex.acquire():
            pass
    proxy.drop_replies()  # the INSERT lands, its reply is lost...
    proxy.silence(existing=False)  # ...and no new connection gets through to clean up
    with pytest.raises(DatabaseError), mutex.acquire():
        pytest.fail("must not run")
    assert holder_id() == mutex.instance_id, "the row the unanswered acquire left"
    healed_at = time.monotonic()
    proxy.heal()
    wait_until(lambda: holder_id() is None, timeout=10)
    assert time.monotonic() - healed_at < 5.0, "swept up once the network came back, not after stale_threshold"
    with other.acquire() as acquired:
        assert acquired


def test_the_loss_is_declared_when_the_lease_runs_out_even_while_a_heartbeat_hangs_connecting(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, metrics: RecordingMetrics
) -> None:
    lost_at: list[float] = []
    mutex = make_mutex(
        proxy_dsn, operation_timeout=0.3, metrics=metrics, on_lost=lambda e: lost_at.append(time.monotonic())
    )
    with pytest.raises(LockNotHeldError), mutex.acquire():
        wait_until(lambda: len(metrics.named("heartbeat_latency")) >= 2)
        proxy.silence()  # the heartbeat times out, then hangs reconnecting (libpq waits at least 2 s)
        silenced = time.monotonic()
        wait_until(lambda: lost_at, timeout=10)
    proxy.heal()
    assert lost_at[0] - silenced < FAST["stale_threshold"], "declared before anyone may reclaim"


def test_a_cleanup_begun_before_an_acquire_is_never_sent_after_it(
    make_mutex: Callable[..., Mutex], holder_id: Holder
) -> None:
    from postgres_mutex._state.flows import stray_row_cleanup
    from postgres_mutex._state.steps import CleanupSuperseded, Execute, Shape

    mutex = make_mutex()
    lock = mutex._lock
    cleanup = stray_row_cleanup(lock, lock.generation)  # a clean-up begins...
    with mutex.acquire():  # ...an acquire supersedes it...

        def late_cleanup() -> Any:
            statements = yield Shape(lock.names, 2.0)
            yield Execute(statements.cleanup, lock.params(), 2.0, "cleanup", stray_row=cleanup)

        with pytest.raises(CleanupSuperseded):
            core_of(mutex.client).engine().run(late_cleanup())
        assert holder_id() == mutex.instance_id, "...so it cannot delete the new hold's row"


@pytest.mark.parametrize("source", ["its own connection", "a pool's connection"])
def test_an_acquire_the_server_reads_late_cannot_take_over_the_next_hold(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, holder_id: Holder, source: str
) -> None:
    # A statement given up on (cut off at its deadline, or by a signal handler's
    # exception) may still sit unread on the server, which runs it whenever it
    # gets to it: after the next acquire of the same Mutex, it would find that
    # hold's row carrying its own instance_id, take it over, and the hold would
    # be lost at its release.
    with contextlib.ExitStack() as stack:
        if source == "its own connection":
            mutex = make_mutex(proxy_dsn, operation_timeout=0.5)
        else:
            pool = stack.enter_context(ConnectionPool(proxy_dsn, min_size=1, max_size=1, open=True))
            mutex = make_mutex(pool=pool, operation_timeout=0.5)
        for _ in range(2):  # connected, the acquire prepared: the next one is a single message
            with mutex.acquire():
                pass
        proxy.delay_requests()  # the next acquire reaches the server only after the Mutex cut its connection
        with pytest.raises(OperationTimeout), mutex.acquire():
            pytest.fail("must not run")
        with mutex.acquire() as acquired:  # on a new connection, which nothing delays
            assert acquired
            proxy.deliver_late()  # the cut-off acquire reaches the server now
            assert holder_id() == mutex.instance_id
        assert holder_id() is None, "released: the late statement took nothing over"
        mutex.close()


async def test_an_async_acquire_the_server_reads_late_cannot_take_over_the_next_hold(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, holder_id: Holder
) -> None:
    mutex = make_mutex(proxy_dsn, operation_timeout=0.5)
    for _ in range(2):
        async with mutex.acquire_async():
            pass
    proxy.delay_requests()
    with pytest.raises(OperationTimeout):
        async with mutex.acquire_async(blocking=False):
            pytest.fail("must not run")
    async with mutex.acquire_async(blocking=False) as acquired:
        assert acquired
        await asyncio.to_thread(proxy.deliver_late)
        assert holder_id() == mutex.instance_id
    assert holder_id() is None, "released: the late statement took nothing over"
