"""``reclaim_disconnected_after``: a dead holder's lock back in seconds, a slow one kept, nobody robbed by a blip.

Real processes against real PostgreSQL: a holder killed (SIGKILL, as the OOM killer does; SIGTERM under
Python's default action) is reclaimed once its heartbeat is older than the option, not after the stale
threshold; a frozen one (SIGSTOP) keeps its session and its lock, alerted on; an ended connection or a
server restart shorter than the option costs no lock; a longer one puts the holder in doubt before anyone
may reclaim it. Rows of holders without the option are never reclaimed early.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from postgres_mutex import Election, Leadership, LockAcquisitionTimeout, LockNotHeldError, LockTable, Mutex, MutexClient
from postgres_mutex.client import core_of
from postgres_mutex.errors import InvalidArgument
from tests.support.fixtures import ROOT, RecordingMetrics, freeze, read_line, thaw, wait_until
from tests.support.postgres_server import PostgresServer

HEARTBEAT, ALERT, STALE, RECLAIM = 0.5, 1.5, 600.0, 3.0
OPTIONS: dict[str, Any] = {
    "heartbeat_interval": HEARTBEAT,
    "alert_threshold": ALERT,
    "stale_threshold": STALE,
    "reclaim_disconnected_after": RECLAIM,
    "poll_interval": 0.1,
}
HAND_OFF = 2.0
"""A generous bound on what a reclaim takes beyond the option: a poll, a statement, a loaded machine."""

HOLDER = """
import json, sys, time
from postgres_mutex import Mutex
dsn, lock, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
mutex = Mutex(dsn, lock, **options)
with mutex.acquire(blocking=True, timeout=60) as held:
    print(json.dumps({"held": held, "id": mutex.instance_id}), flush=True)
    while True:
        print(json.dumps({"held": mutex.held, "lease_remaining": mutex.lease_remaining}), flush=True)
        time.sleep(0.1)
"""
"""A holder process: acquires, says so, then says every 0.1 s whether it still holds."""


@pytest.fixture
def holders() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(dsn: str, lock: str, **options: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, dsn, lock, json.dumps({**OPTIONS, **options})],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        first = json.loads(read_line(proc.stdout, timeout=30))
        assert first["held"] is True
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def last_state(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The holder's next report of its state (the ones in the pipe first)."""
    assert proc.stdout is not None
    return dict(json.loads(read_line(proc.stdout, timeout=10)))


def heartbeat_age(admin: psycopg.Connection[Any], lock: str) -> float | None:
    row = admin.execute(
        "SELECT EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 FROM mutex_lock WHERE lock_name = %s", (lock,)
    ).fetchone()
    return None if row is None else float(row[0])


@pytest.mark.parametrize(
    "how",
    [signal.SIGKILL, signal.SIGTERM],
    ids=["killed (SIGKILL, as the OOM killer does)", "stopped (SIGTERM, Python's default action)"],
)
def test_a_holder_whose_process_died_is_reclaimed_after_the_option_not_the_stale_threshold(
    dsn: str,
    lock_name: str,
    admin: psycopg.Connection[Any],
    holders: Callable[..., subprocess.Popen[str]],
    metrics: RecordingMetrics,
    how: signal.Signals,
) -> None:
    holder = holders(dsn, lock_name)
    contender = Mutex(dsn, lock_name, metrics=metrics, **OPTIONS)
    try:
        os.kill(holder.pid, how)
        died = time.monotonic()
        holder.wait(10)
        with contender.acquire(blocking=True, timeout=RECLAIM + HAND_OFF + 5) as acquired:
            took = time.monotonic() - died
            assert acquired
        assert took <= RECLAIM + HAND_OFF, f"reclaimed {took:.2f}s after the holder died"
        (reclaim,) = metrics.named("stale_reclaimed")
        assert reclaim["reason"] == "disconnected"
    finally:
        contender.close()


def test_the_history_says_the_holder_was_reclaimed_because_its_session_ended(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], holders: Callable[..., subprocess.Popen[str]]
) -> None:
    table = f"history_{lock_name.replace('-', '_')}"
    LockTable(dsn, table=table).create(history=True)
    try:
        holder = holders(dsn, lock_name, table=table)
        holder.kill()
        holder.wait(10)
        contender = Mutex(dsn, lock_name, table=table, **OPTIONS)
        with contender.acquire(blocking=True, timeout=RECLAIM + HAND_OFF + 5) as acquired:
            assert acquired
        contender.close()
        endings = [record.ended_how for record in LockTable(dsn, table=table).history(lock_name)]
        assert endings == ["released", "reclaimed_disconnected"], "newest first"
    finally:
        admin.execute(
            sql.SQL("DROP TABLE IF EXISTS {}, {}").format(sql.Identifier(table), sql.Identifier(f"{table}_history"))
        )


def test_a_frozen_holder_is_alerted_on_and_keeps_its_lock_then_goes_on_holding(
    dsn: str,
    lock_name: str,
    admin: psycopg.Connection[Any],
    holders: Callable[..., subprocess.Popen[str]],
    metrics: RecordingMetrics,
) -> None:
    holder = holders(dsn, lock_name)
    contender = Mutex(dsn, lock_name, metrics=metrics, **OPTIONS)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        # Frozen past the option: its session is alive, so a contender waits and is told it is silent.
        with pytest.raises(LockAcquisitionTimeout), contender.acquire(blocking=True, timeout=RECLAIM + 3):
            pytest.fail("a frozen holder's lock was taken")
        age = heartbeat_age(admin, lock_name)
        assert age is not None
        assert age > RECLAIM, "silent past the option, not reclaimed"
        assert [alert["holder"] for alert in metrics.named("alert")] != []
        observed = LockTable(dsn).holders([lock_name])
        assert [(seen.session_alive, seen.reclaimable) for seen in observed] == [(True, False)]
        os.kill(holder.pid, signal.SIGCONT)
        # In doubt when it wakes (it cannot know its session survived), held again once a heartbeat says so.
        deadline = time.monotonic() + 10
        while not last_state(holder)["held"]:
            assert time.monotonic() < deadline, "the resumed holder never held again"
        assert [seen.holder for seen in LockTable(dsn).holders([lock_name])] != [contender.instance_id]
        with contender.acquire() as acquired:
            assert not acquired, "still held by the resumed holder"
    finally:
        contender.close()


def backend_holding(admin: psycopg.Connection[Any], lock: str) -> int:
    """The server process of the session whose key the lock's row names."""
    row = admin.execute(
        """SELECT l.pid FROM mutex_lock AS m JOIN pg_locks AS l
             ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
            AND ((l.classid::bigint << 32) | l.objid::bigint) = m.session_key
            WHERE m.lock_name = %s""",
        (lock,),
    ).fetchone()
    assert row is not None, "the row names a session that holds its key"
    return int(row[0])


def test_an_ended_connection_costs_the_holder_nothing(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], metrics: RecordingMetrics
) -> None:
    lost: list[LockNotHeldError] = []
    with MutexClient(dsn) as client:
        holder = client.mutex(lock_name, metrics=metrics, on_lost=lost.append, **OPTIONS)
        contender = Mutex(dsn, lock_name, **OPTIONS)
        try:
            with holder.acquire():
                first = backend_holding(admin, lock_name)
                admin.execute("SELECT pg_terminate_backend(%s)", (first,))
                # The holder reconnects and names its new session at its next heartbeat.
                wait_until(lambda: backend_holding_or_none(admin, lock_name) not in (None, first), timeout=10)
                until = time.monotonic() + RECLAIM + 1
                while time.monotonic() < until:
                    with contender.acquire() as acquired:
                        assert not acquired, "the holder's lock was taken after its connection ended"
                    time.sleep(0.2)
                assert holder.held
            assert lost == []
        finally:
            contender.close()


def backend_holding_or_none(admin: psycopg.Connection[Any], lock: str) -> int | None:
    try:
        return backend_holding(admin, lock)
    except AssertionError:
        return None


def test_a_server_restart_shorter_than_the_option_costs_no_lock(own_pg: PostgresServer, lock_name: str) -> None:
    dsn = own_pg.dsn()
    LockTable(dsn).create()
    lost: list[LockNotHeldError] = []
    holder = Mutex(dsn, lock_name, on_lost=lost.append, **{**OPTIONS, "reclaim_disconnected_after": 10.0})
    try:
        with holder.acquire():
            own_pg.restart()
            # Every session ended; the holder's next heartbeat names a new one, well within the option.
            with psycopg.connect(dsn, autocommit=True) as admin:
                wait_until(lambda: backend_holding_or_none(admin, lock_name) is not None, timeout=15)
            assert holder.held
            contender = Mutex(dsn, lock_name, **OPTIONS)
            with contender.acquire() as acquired:
                assert not acquired
            contender.close()
        assert lost == []
    finally:
        holder.close()


def test_an_outage_longer_than_the_option_puts_the_holder_in_doubt_before_anyone_reclaims(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], metrics: RecordingMetrics
) -> None:
    """The holder's connection ends and its heartbeats stop (frozen): in doubt before the reclaim."""
    in_doubt_at: list[float] = []
    holder_metrics = RecordingMetrics()
    holder = Mutex(dsn, lock_name, metrics=holder_metrics, **OPTIONS)
    contender = Mutex(dsn, lock_name, metrics=metrics, **OPTIONS)
    try:
        with pytest.raises(LockNotHeldError), holder.acquire():
            freeze(holder)  # no heartbeat from now on, as a process cut off would send none
            admin.execute("SELECT pg_terminate_backend(%s)", (backend_holding(admin, lock_name),))
            wait_until(lambda: not holder.held, timeout=RECLAIM + 2)
            in_doubt_at.append(time.monotonic())
            with contender.acquire(blocking=True, timeout=RECLAIM + HAND_OFF + 5) as acquired:
                reclaimed_at = time.monotonic()
                assert acquired
                assert reclaimed_at >= in_doubt_at[0], "the holder was told first"
                with pytest.raises(LockNotHeldError, match="in doubt"):
                    holder.ensure_held()
                thaw(holder)
                # Its next heartbeat finds the row gone: lost, never confirmed.
                wait_until(lambda: holder_metrics.named("lost"), timeout=10)
        assert [call["reason"] for call in metrics.named("stale_reclaimed")] == ["disconnected"]
        assert holder_metrics.named("hold_in_doubt") != []
        assert holder_metrics.named("hold_confirmed") == []
    finally:
        holder.close()
        contender.close()


def test_a_block_that_ends_on_seeing_its_hold_in_doubt_is_still_told_the_doubt(
    dsn: str, lock_name: str, schema: None
) -> None:
    """The block sees by the clock that its hold is in doubt (``held`` turns False) and ends, before
    the thread that tells doubts got round to it: the release tells it, once. Another instance may
    take the lock over while the release's reply is slow; the doubt is the holder's notice."""
    holder_metrics = RecordingMetrics()
    holder = Mutex(dsn, lock_name, metrics=holder_metrics, **OPTIONS)
    busy = threading.Event()
    try:
        with holder.acquire():
            freeze(holder)  # no heartbeat from now on: in doubt at reclaim_disconnected_after - heartbeat
            # The thread that tells doubts is kept busy meanwhile: only the block sees the doubt.
            core_of(holder.client).session.post(lambda: busy.wait(RECLAIM + 10))
            wait_until(lambda: not holder.held, timeout=RECLAIM + 2)
        assert holder_metrics.named("hold_in_doubt") == [], "not told before the event thread is free"
        busy.set()
        wait_until(lambda: holder_metrics.named("hold_in_doubt"), timeout=5)
        assert len(holder_metrics.named("hold_in_doubt")) == 1
    finally:
        busy.set()
        holder.close()


def test_an_election_leader_in_doubt_steps_down_before_another_may_take_over(
    dsn: str, lock_name: str, schema: None
) -> None:
    fast = {**OPTIONS, "heartbeat_interval": 0.2, "alert_threshold": 0.6, "reclaim_disconnected_after": 1.0}
    election = Election(dsn, lock_name, **fast)
    told: list[tuple[float, str | None]] = []

    def lead(leadership: Leadership) -> None:
        frozen_at = time.monotonic()
        freeze(election._mutex)  # its heartbeats stop, as a cut-off leader's would
        assert leadership.ended.wait(10), "the leader was never told"
        told.append((time.monotonic() - frozen_at, leadership.reason))
        with pytest.raises(LockNotHeldError):
            leadership.ensure_held()
        election.stop()

    try:
        election.run(lead)
    finally:
        election.close()
    ((after, reason),) = told
    assert after < 1.0, "told before another candidate may take the lock over"
    assert reason is not None
    assert "in doubt" in reason


def test_holders_without_the_option_are_never_reclaimed_early(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], holders: Callable[..., subprocess.Popen[str]]
) -> None:
    holder = holders(dsn, lock_name, reclaim_disconnected_after=None)
    holder.kill()
    holder.wait(10)
    contender = Mutex(dsn, lock_name, **OPTIONS)
    try:
        with pytest.raises(LockAcquisitionTimeout), contender.acquire(blocking=True, timeout=RECLAIM + 2):
            pytest.fail("a holder that did not opt in was reclaimed before stale_threshold")
        (seen,) = LockTable(dsn).holders([lock_name])
        assert (seen.session_alive, seen.reclaim_disconnected_after) == (None, None)
    finally:
        contender.close()
        admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))


def test_a_row_taken_over_by_a_process_that_knows_nothing_of_sessions_is_judged_by_the_thresholds(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], holders: Callable[..., subprocess.Popen[str]]
) -> None:
    """0.1.0 takes a row over with an UPDATE that leaves the session columns alone: they name no hold then."""
    holder = holders(dsn, lock_name)
    holder.kill()
    holder.wait(10)
    # As 0.1.0's reclaim does: a new instance and a new acquired_at, the other columns as they were.
    admin.execute(
        "UPDATE mutex_lock SET instance_id = 'written-for-0.1.0', last_heartbeat = now() - interval '10 s', "
        "acquired_at = now() WHERE lock_name = %s",
        (lock_name,),
    )
    contender = Mutex(dsn, lock_name, **OPTIONS)
    try:
        with contender.acquire() as acquired:
            assert not acquired, "the former holder's ended session says nothing of the new holder"
        (seen,) = LockTable(dsn).holders([lock_name])
        assert seen.session_alive is None
    finally:
        contender.close()
        admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))


def test_the_lease_remaining_is_public_and_runs_low_before_the_doubt(
    dsn: str, lock_name: str, metrics: RecordingMetrics
) -> None:
    mutex = Mutex(dsn, lock_name, metrics=metrics, **OPTIONS)

    def remaining() -> float | None:
        return mutex.lease_remaining

    try:
        assert remaining() is None
        with mutex.acquire():
            left = remaining()
            assert left is not None
            assert 0 < left <= RECLAIM - HEARTBEAT
            freeze(mutex)
            wait_until(lambda: metrics.named("lease_running_out"), timeout=RECLAIM)
            (running_out,) = metrics.named("lease_running_out")
            assert 0 < running_out["seconds_left"] <= (RECLAIM - HEARTBEAT) / 3 + 0.1
            assert mutex.held, "told before the hold is in doubt"
            wait_until(lambda: not mutex.held, timeout=RECLAIM)
            assert remaining() is None
            thaw(mutex)
            wait_until(lambda: mutex.held, timeout=5)
        assert [call["seconds_in_doubt"] >= 0 for call in metrics.named("hold_confirmed")] == [True]
    finally:
        mutex.close()


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"reclaim_disconnected_after": 600.0}, "stale_threshold"),
        ({"reclaim_disconnected_after": 1.0}, "heartbeat_interval"),
        ({"reclaim_disconnected_after": 2.0, "operation_timeout": 1.5}, "operation_timeout"),
        ({"reclaim_disconnected_after": -1.0}, "reclaim_disconnected_after"),
    ],
)
def test_the_option_is_checked_against_the_thresholds_at_construction(
    dsn: str, options: dict[str, Any], names: str
) -> None:
    with pytest.raises(InvalidArgument, match=names) as caught:
        Mutex(dsn, "job", **{**OPTIONS, **options})
    assert "reclaim_disconnected_after" in caught.value.arguments


def test_a_pool_cannot_name_this_processs_session(dsn: str) -> None:
    with ConnectionPool(dsn, open=False) as pool, pytest.raises(InvalidArgument, match="a pool's connections"):
        Mutex(pool=pool, lock_name="job", **OPTIONS)
