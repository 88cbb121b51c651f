"""The lock history: one row per hold, written by the statements that acquire, renew and end it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from postgres_mutex import (
    DatabaseError,
    HoldRecord,
    LockNotHeldError,
    LockTable,
    Mutex,
    MutexClient,
    OperationTimeout,
    RWLock,
    SchemaError,
    Semaphore,
)
from tests.support.faultproxy import FaultProxy
from tests.support.fixtures import FAST, ROOT, RecordingMetrics, freeze, wait_until
from tests.support.postgres_server import PostgresServer


def drop(dsn: str, table: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_history, {table}_semaphores, {table}_rwlocks")
        conn.execute(f"DROP SEQUENCE IF EXISTS {table}_token_seq")


@pytest.fixture
def table(dsn: str) -> Iterator[str]:
    """A lock table of this test's own, with a history."""
    name = f"hist_{uuid.uuid4().hex[:10]}"
    assert LockTable(dsn, table=name).create(history=True)
    yield name
    drop(dsn, name)


@pytest.fixture
def make(make_mutex: Callable[..., Mutex], table: str) -> Callable[..., Mutex]:
    return functools.partial(make_mutex, table=table)


def history(dsn: str, table: str, lock_name: str) -> list[HoldRecord]:
    return LockTable(dsn, table=table).history(lock_name)


def ended(records: list[HoldRecord]) -> list[tuple[str | None, str | None]]:
    """(how, by whom) for each hold, oldest first."""
    return [(record.ended_how, record.ended_by) for record in reversed(records)]


# -- off unless asked ------------------------------------------------------------------------


def test_the_history_is_off_unless_asked_for_and_one_migration_turns_it_on(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str
) -> None:
    name = f"plain_{uuid.uuid4().hex[:10]}"
    lock_table = LockTable(dsn, table=name)
    try:
        lock_table.create()
        assert not lock_table.has_history()
        with psycopg.connect(dsn) as conn:
            found = conn.execute("SELECT to_regclass(%s)", (f"{name}_history",)).fetchone()
        assert found == (None,), "no second table unless asked for"
        mutex = make_mutex(table=name)
        with mutex.acquire() as acquired:
            assert acquired
        with pytest.raises(SchemaError, match=r"keeps no history.*migrate\(history=True\)"):
            lock_table.history()

        assert lock_table.migrate(history=True), "the migration added the history"
        assert not lock_table.migrate(history=True), "and is idempotent"
        with mutex.acquire():
            token = mutex.token
        [record] = lock_table.history(lock_name)
        assert (record.token, record.ended_how) == (token, "released"), "this process writes it from now on"
    finally:
        drop(dsn, name)


# -- every way a hold ends -----------------------------------------------------------------------


def test_released_and_force_released_holds_are_recorded_with_their_tokens(
    make: Callable[..., Mutex], dsn: str, table: str, lock_name: str
) -> None:
    mutex = make(instance_id="worker-1")
    with mutex.acquire():
        released_token = mutex.token
        [open_hold] = history(dsn, table, lock_name)
        assert (open_hold.ended_at, open_hold.ended_how) == (None, None), "an open hold while it lasts"
    with pytest.raises(LockNotHeldError), mutex.acquire():
        forced_token = mutex.token
        assert LockTable(dsn, table=table).force_release(lock_name) is not None
        wait_until(lambda: not mutex.held)
    records = history(dsn, table, lock_name)
    assert ended(records) == [("released", None), ("force_released", None)]
    assert [r.token for r in reversed(records)] == [released_token, forced_token]
    assert all(r.holder == "worker-1" and r.ended_at is not None and r.ended_at >= r.acquired_at for r in records)
    assert all(r.held_for == pytest.approx((r.ended_at - r.acquired_at).total_seconds(), abs=1e-3) for r in records)  # type: ignore[operator]


def test_a_reclaim_after_a_crash_names_the_reclaimer_and_counts_the_silence(
    make: Callable[..., Mutex], dsn: str, table: str, lock_name: str
) -> None:
    crasher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from postgres_mutex import Mutex
                mutex = Mutex({dsn!r}, {lock_name!r}, table={table!r}, instance_id="crasher", **{FAST!r})
                mutex.acquire().__enter__()
                print(mutex.token, flush=True)
                time.sleep(120)
                """
            ),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert crasher.stdout is not None
        crashed_token = int(crasher.stdout.readline())
        crasher.send_signal(signal.SIGKILL)  # no release, no clean-up: only the row's silence
    finally:
        crasher.kill()
        crasher.wait(timeout=10)
    rescuer = make(instance_id="rescuer")
    with rescuer.acquire(blocking=True, timeout=15) as acquired:
        assert acquired
        records = history(dsn, table, lock_name)
    assert ended(records) == [("reclaimed", "rescuer"), (None, None)]
    crashed, current = reversed(records)
    assert (crashed.holder, crashed.token) == ("crasher", crashed_token)
    assert crashed.alerts == 1, "its last silence went past the alert threshold"
    assert crashed.ended_at == current.acquired_at, "ended by the statement that took the lock over"
    assert crashed.held_for >= FAST["stale_threshold"]
    assert current.holder == "rescuer"


def test_a_hold_whose_lease_ran_out_is_recorded_lost(
    make: Callable[..., Mutex], dsn: str, table: str, lock_name: str, holder_id: Callable[..., str | None]
) -> None:
    mutex = make()
    with pytest.raises(LockNotHeldError), mutex.acquire():
        freeze(mutex)
        wait_until(lambda: not mutex.held, timeout=10)
    # Nobody took the lock over: the holder deleted its own row, and says why.
    wait_until(lambda: holder_id(table=table) is None, timeout=10)
    [record] = history(dsn, table, lock_name)
    assert (record.ended_how, record.ended_by, record.alerts) == ("lost", None, 1)


def test_a_hold_taken_back_by_a_restarted_instance_is_recorded_replaced(
    make: Callable[..., Mutex], dsn: str, table: str, lock_name: str
) -> None:
    before = make(instance_id="pod-7")
    with contextlib.closing(MutexClient(dsn)) as client:
        # The same instance_id from another process (a restart reusing it): it takes its row back.
        after = client.mutex(lock_name, table=table, instance_id="pod-7", **FAST)
        with pytest.raises(LockNotHeldError), before.acquire(), after.acquire() as acquired:
            assert acquired
            wait_until(lambda: not before.held)
            records = history(dsn, table, lock_name)
            assert records[0].token == after.token
    assert ended(records) == [("replaced", "pod-7"), (None, None)]
    assert ended(history(dsn, table, lock_name)) == [("replaced", "pod-7"), ("released", None)]


def test_a_row_left_by_an_unanswered_acquire_is_recorded_abandoned(
    make: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, dsn: str, table: str, lock_name: str
) -> None:
    mutex = make(proxy_dsn, operation_timeout=0.5)
    for _ in range(2):  # connected, the acquire prepared: the next one is a single message
        with mutex.acquire():
            pass
    proxy.drop_replies()  # the acquire lands, its answer never comes back
    with pytest.raises(OperationTimeout), mutex.acquire():
        pytest.fail("must not run")
    proxy.heal()
    wait_until(lambda: len(history(dsn, table, lock_name)) == 3 and history(dsn, table, lock_name)[0].ended_at)
    assert ended(history(dsn, table, lock_name)) == [("released", None), ("released", None), ("abandoned", None)]


def test_an_alert_episode_the_holder_recovers_from_is_counted_once(
    make: Callable[..., Mutex], dsn: str, table: str, lock_name: str, row: Callable[..., tuple[Any, ...] | None]
) -> None:
    # A stale threshold far past the silence, so the pause cannot cost the lock.
    mutex = make(heartbeat_interval=0.1, alert_threshold=0.5, stale_threshold=6.0)
    with mutex.acquire():
        hold = mutex._lock.hold
        assert hold is not None
        hold.paused = True  # a pause past the alert threshold (a long GC, a slow disk)
        wait_until(lambda: (found := row(table=table)) is not None and found[1] > 0.7, timeout=10)
        hold.paused = False
        wait_until(lambda: (found := row(table=table)) is not None and found[1] < 0.3, timeout=10)
    [record] = history(dsn, table, lock_name)
    assert (record.ended_how, record.alerts) == ("released", 1)


# -- reading it ----------------------------------------------------------------------------------


def test_history_filters_by_lock_and_by_the_moment_holds_ended(
    make: Callable[..., Mutex], dsn: str, table: str, lock_name: str
) -> None:
    lock_table = LockTable(dsn, table=table)
    other = make(lock_name=f"{lock_name}-other")
    mutex = make()
    with other.acquire():
        pass
    with mutex.acquire():
        pass
    [done] = lock_table.history(lock_name)
    assert done.ended_at is not None
    with mutex.acquire():
        assert [r.ended_how for r in lock_table.history(lock_name)] == [None, "released"]
        later = lock_table.history(lock_name, since=done.ended_at + timedelta(microseconds=1))
        assert [r.token for r in later] == [mutex.token], "since: only holds that had not ended by then"
        assert len(lock_table.history()) == 3
        assert len(lock_table.history(limit=1)) == 1
    with pytest.raises(ValueError, match="timezone-aware"):
        lock_table.history(since=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="limit"):
        lock_table.history(limit=0)


async def test_history_async_reads_what_the_sync_api_wrote(
    make: Callable[..., Mutex], dsn: str, table: str, lock_name: str
) -> None:
    mutex = make()
    async with mutex.acquire_async():
        pass
    [record] = await LockTable(dsn, table=table).history_async(lock_name)
    assert record.ended_how == "released"
    assert await LockTable(dsn, table=table).has_history_async()


# -- semaphores and read/write locks -------------------------------------------------------------


@pytest.fixture
def holders(dsn: str, table: str) -> Iterator[list[Semaphore | RWLock]]:
    """Semaphores and RWLocks on this test's table (``FAST``), closed at its end."""
    made: list[Semaphore | RWLock] = []
    yield made
    for holder in made:
        with contextlib.suppress(Exception):
            holder.close()


def test_permits_and_read_write_holds_are_recorded_with_what_they_held_and_read_by_their_lock(
    dsn: str, table: str, lock_name: str, holders: list[Semaphore | RWLock]
) -> None:
    options: dict[str, Any] = {**FAST, "table": table}
    semaphore = Semaphore(dsn, f"{lock_name}-sem", permits=2, instance_id="sem-1", **options)
    reader = RWLock(dsn, f"{lock_name}-rw", instance_id="reader-1", **options)
    writer = RWLock(dsn, f"{lock_name}-rw", instance_id="writer-1", **options)
    mutex = Mutex(dsn, lock_name, instance_id="mutex-1", **options)
    holders += [semaphore, reader, writer, mutex]  # type: ignore[list-item]
    with semaphore.acquire() as got:
        assert got
        permit = semaphore.permit
    with reader.read() as got:
        assert got
    with writer.write() as got:
        assert got
        write_token = writer.token
    with mutex.acquire():
        pass

    lock_table = LockTable(dsn, table=table)
    [held] = lock_table.history(f"{lock_name}-sem")
    assert (held.semaphore, held.permit, held.holder, held.ended_how) == (
        f"{lock_name}-sem",
        permit,
        "sem-1",
        "released",
    )
    assert (held.rwlock, held.mode) == (None, None)
    assert lock_table.history(held.lock_name) == [held], "a permit's row, by its own name"
    assert lock_table.history(f"{lock_name}-sem\x1f{1 - permit}") == []  # type: ignore[operator]
    wrote, read = lock_table.history(f"{lock_name}-rw")
    assert [(r.rwlock, r.mode, r.holder, r.ended_how) for r in (read, wrote)] == [
        (f"{lock_name}-rw", "read", "reader-1", "released"),
        (f"{lock_name}-rw", "write", "writer-1", "released"),
    ]
    assert wrote.token == write_token
    assert lock_table.history(read.lock_name) == [read]
    assert (wrote.semaphore, wrote.permit) == (None, None)
    [alone] = lock_table.history(lock_name)
    assert (alone.holder, alone.semaphore, alone.rwlock, alone.mode) == ("mutex-1", None, None, None), (
        "a lock's name reads its own holds, not those of a lock whose name it begins"
    )


def test_a_dead_writer_removed_by_a_reader_is_recorded_reclaimed_by_that_reader(
    dsn: str, table: str, lock_name: str, holders: list[Semaphore | RWLock]
) -> None:
    options: dict[str, Any] = {**FAST, "table": table}
    writer = RWLock(dsn, lock_name, instance_id="writer-1", **options)
    reader = RWLock(dsn, lock_name, instance_id="reader-1", **options)
    holders += [writer, reader]
    with pytest.raises(LockNotHeldError), writer.write() as got:
        assert got
        freeze(writer._writer)  # its process froze: no more heartbeats
        with reader.read(blocking=True, timeout=15) as read:
            assert read
    records = LockTable(dsn, table=table).history(lock_name)
    assert [(r.mode, r.holder, r.ended_how, r.ended_by) for r in reversed(records)] == [
        ("write", "writer-1", "reclaimed", "reader-1"),
        ("read", "reader-1", "released", None),
    ]
    assert records[-1].alerts == 1, "the silence that let it be reclaimed"


def test_the_cli_history_of_a_read_write_lock_or_semaphore_says_each_holds_mode_or_permit(
    dsn: str, table: str, lock_name: str, holders: list[Semaphore | RWLock]
) -> None:
    options: dict[str, Any] = {**FAST, "table": table}
    rw = RWLock(dsn, lock_name, instance_id="rw-1", **options)
    semaphore = Semaphore(dsn, f"{lock_name}-sem", permits=1, instance_id="sem-1", **options)
    holders += [rw, semaphore]
    with rw.read() as got:
        assert got
    with rw.write() as got:
        assert got
    with semaphore.acquire() as got:
        assert got

    text = cli("history", "--dsn", dsn, "--table", table, "--lock", lock_name)
    assert text.returncode == 0, text.stderr
    assert [line.split()[:2] for line in text.stdout.splitlines()[1:]] == [
        [lock_name, "(write)"],
        [lock_name, "(read)"],
    ]
    as_json = cli("history", "--dsn", dsn, "--table", table, "--lock", f"{lock_name}-sem", "--json")
    assert as_json.returncode == 0, as_json.stderr
    [hold] = json.loads(as_json.stdout)["holds"]
    assert (hold["semaphore"], hold["permit"], hold["rwlock"], hold["mode"]) == (f"{lock_name}-sem", 0, None, None)
    every = json.loads(cli("history", "--dsn", dsn, "--table", table, "--json").stdout)["holds"]
    assert [(h["rwlock"], h["mode"]) for h in every if h["rwlock"]] == [(lock_name, "write"), (lock_name, "read")]


# -- retention -----------------------------------------------------------------------------------


def test_retention_removes_ended_holds_without_a_job_of_the_users(
    make: Callable[..., Mutex], dsn: str, table: str, lock_name: str
) -> None:
    lock_table = LockTable(dsn, table=table)
    assert not lock_table.migrate(history=True, history_retention=0.2), "a retention change is no schema change"
    mutex = make()
    with mutex.acquire():
        pass
    old = lock_table.history(lock_name)
    assert len(old) == 1

    def old_hold_gone() -> bool:
        with mutex.acquire():  # acquires remove what expired: no cron job
            pass
        return old[0] not in lock_table.history(lock_name, limit=1000)

    wait_until(old_hold_gone, timeout=10, interval=0.1)
    with mutex.acquire():
        assert lock_table.history(lock_name)[0].ended_at is None, "an open hold is never removed"
    lock_table.migrate(history=True, history_retention=3600)
    with mutex.acquire():
        pass
    with mutex.acquire():
        kept = [r for r in lock_table.history(lock_name) if r.ended_at is not None]
    assert kept, "a longer retention keeps holds that end after it was set"


# -- one round trip each, and a restart ------------------------------------------------------------


def test_acquire_heartbeat_and_release_stay_one_round_trip_each(
    make: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, dsn: str, table: str, lock_name: str
) -> None:
    quiet = {"heartbeat_interval": 5.0, "alert_threshold": 10.0, "stale_threshold": 20.0}
    mutex = make(proxy_dsn, **quiet)
    for _ in range(2):  # connect, and prepare each statement, first
        with mutex.acquire():
            mutex.heartbeat()

    def round_trips(operation: Callable[[], object]) -> int:
        before = proxy.ready_for_query
        operation()
        return proxy.ready_for_query - before

    acquire = mutex.acquire()
    assert round_trips(acquire.__enter__) == 1
    assert round_trips(mutex.heartbeat) == 1
    assert round_trips(functools.partial(acquire.__exit__, None, None, None)) == 1
    assert ended(history(dsn, table, lock_name)) == [("released", None)] * 3


def test_the_history_and_a_hold_across_it_survive_a_server_restart(own_pg: PostgresServer, lock_name: str) -> None:
    dsn = own_pg.dsn()
    name = f"hist_{uuid.uuid4().hex[:10]}"
    lock_table = LockTable(dsn, table=name)
    lock_table.create(history=True)
    mutex = Mutex(dsn, lock_name, table=name, instance_id="survivor", **FAST)  # type: ignore[arg-type]
    try:
        with mutex.acquire():
            pass
        with mutex.acquire():
            own_pg.restart()
            wait_until(functools.partial(renewed, mutex), timeout=15)  # heartbeats resume
            assert mutex.held
        records = lock_table.history(lock_name)
        assert ended(records) == [("released", None), ("released", None)]
        assert records[0].held_for > 0
    finally:
        mutex.close()
        drop(dsn, name)


def renewed(mutex: Mutex) -> bool:
    try:
        mutex.heartbeat()
    except DatabaseError:
        return False
    return True


# -- the command line ----------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postgres_mutex", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "POSTGRES_MUTEX_DSN": ""},
        check=False,
    )


def test_the_cli_creates_migrates_and_reads_the_history_in_text_and_json(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str
) -> None:
    name = f"clihist_{uuid.uuid4().hex[:8]}"
    try:
        made = cli("init", "--dsn", dsn, "--table", name)
        assert made.returncode == 0, made.stderr
        missing = cli("history", "--dsn", dsn, "--table", name)
        assert missing.returncode == 69
        assert "'postgres-mutex migrate --history'" in missing.stderr, missing.stderr
        assert "LockTable" not in missing.stderr, "in the words of the command"
        migrated = cli("migrate", "--dsn", dsn, "--table", name, "--history", "--history-retention", "86400")
        assert migrated.returncode == 0, migrated.stderr
        assert "now has" in migrated.stdout

        first, second = make_mutex(table=name, instance_id="alpha"), make_mutex(table=name, instance_id="beta")
        with first.acquire():
            pass
        with pytest.raises(LockNotHeldError), first.acquire():
            freeze(first)
            with second.acquire(blocking=True, timeout=15):
                tokens = (first.token, second.token)

        text = cli("history", "--dsn", dsn, "--table", name, "--lock", lock_name)
        assert text.returncode == 0, text.stderr
        header, *lines = text.stdout.splitlines()
        assert header.split()[:3] == ["LOCK", "TOKEN", "HOLDER"]
        assert [line.split()[2] for line in lines] == ["beta", "alpha", "alpha"]
        assert [line.rsplit(None, 1)[0].split("  ")[-1].strip() for line in lines] == [
            "released",
            "reclaimed by beta",
            "released",
        ]

        as_json = cli("history", "--dsn", dsn, "--table", name, "--since", "1h", "--json")
        assert as_json.returncode == 0, as_json.stderr
        holds = json.loads(as_json.stdout)["holds"]
        assert [(h["holder"], h["ended_how"], h["ended_by"]) for h in holds] == [
            ("beta", "released", None),
            ("alpha", "reclaimed", "beta"),
            ("alpha", "released", None),
        ]
        assert holds[1]["alerts"] == 1
        assert datetime.fromisoformat(holds[0]["acquired_at"]).tzinfo is not None
        assert holds[0]["token"] == tokens[1] is not None

        later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        assert json.loads(cli("history", "--dsn", dsn, "--table", name, "--since", later, "--json").stdout) == {
            "table": name,
            "holds": [],
        }
        assert cli("history", "--dsn", dsn, "--table", name, "--since", "yesterday").returncode == 2
        assert cli("history", "--dsn", dsn, "--table", name, "--limit", "0").returncode == 2
        assert cli("init", "--dsn", dsn, "--history-retention", "5").returncode == 2, "retention without --history"
    finally:
        drop(dsn, name)


def test_dropping_the_history_under_running_holders_costs_them_nothing(
    make: Callable[..., Mutex], dsn: str, table: str, lock_name: str, admin: psycopg.Connection[Any]
) -> None:
    # Heartbeats far apart: the release and the waiter meet the dropped table first.
    slow = {"heartbeat_interval": 2.0, "alert_threshold": 10.0, "stale_threshold": 20.0}
    seen = RecordingMetrics()
    mutex, waiter = make(instance_id="holder", **slow), make(instance_id="waiter", metrics=seen, **slow)
    got: list[bool] = []
    with mutex.acquire():
        thread = threading.Thread(target=lambda: got.append(take(waiter)))
        thread.start()
        wait_until(lambda: seen.named("contended"), timeout=10)  # it waits for the release
        admin.execute(f"DROP TABLE {table}_history")  # an operator turns the history off
    thread.join(timeout=20)
    assert got == [True], "the release went through, and the waiter got the lock"
    assert not LockTable(dsn, table=table).has_history()


def test_a_history_dropped_under_a_holder_is_said_once_and_is_no_failed_heartbeat(
    make: Callable[..., Mutex], table: str, admin: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    seen = RecordingMetrics()
    mutex = make(metrics=seen)
    with caplog.at_level(logging.WARNING, logger="postgres_mutex"), mutex.acquire():
        wait_until(lambda: len(seen.named("heartbeat_latency")) >= 2)  # renewing, with its history
        admin.execute(f"DROP TABLE {table}_history")  # an operator turns the history off
        renewed = len(seen.named("heartbeat_latency"))
        wait_until(lambda: len(seen.named("heartbeat_latency")) >= renewed + 5)  # and it goes on renewing
        assert mutex.held
    said = [record.getMessage() for record in caplog.records]
    assert seen.named("heartbeat_failed") == [], said
    assert not any("does not exist" in line for line in said), said
    gone = [line for line in said if "history of lock table" in line]
    assert len(gone) == 1, said
    assert f"{table}_history" in gone[0]
    assert "holds go on without a history" in gone[0]


def test_a_history_dropped_is_said_by_the_client_whichever_of_its_loops_finds_out(
    make: Callable[..., Mutex], table: str, admin: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    # The client learns the table's shape from its sync side; the heartbeats that
    # find the history gone are its async side's: it is the same client, said once.
    seen = RecordingMetrics()
    mutex = make(metrics=seen)
    with mutex.acquire() as acquired:
        assert acquired
    holding, done = threading.Event(), threading.Event()

    async def hold() -> None:
        async with mutex.acquire_async() as got:
            assert got
            holding.set()
            await asyncio.to_thread(done.wait, 20)

    holder = threading.Thread(target=asyncio.run, args=(hold(),))
    with caplog.at_level(logging.WARNING, logger="postgres_mutex"):
        holder.start()
        try:
            assert holding.wait(10)
            admin.execute(f"DROP TABLE {table}_history")
            renewed = len(seen.named("heartbeat_latency"))
            wait_until(lambda: len(seen.named("heartbeat_latency")) >= renewed + 5)
        finally:
            done.set()
            holder.join(10)
    said = [record.getMessage() for record in caplog.records]
    assert seen.named("heartbeat_failed") == [], said
    assert len([line for line in said if "history of lock table" in line]) == 1, said


def take(mutex: Mutex) -> bool:
    with mutex.acquire(blocking=True, timeout=15) as acquired:
        return acquired


def test_an_end_nobody_wrote_is_closed_by_the_next_acquire_and_expires(
    make: Callable[..., Mutex], dsn: str, table: str, lock_name: str, admin: psycopg.Connection[Any]
) -> None:
    # A hold by a process that keeps no history ended without a word (0.1.0 released it, say).
    admin.execute(
        f"INSERT INTO {table}_history (lock_name, holder, acquired_at) VALUES (%s, 'old-process', now())",  # noqa: S608
        (lock_name,),
    )
    with make().acquire():
        records = history(dsn, table, lock_name)
    assert [(r.holder, r.ended_how) for r in records] == [(records[0].holder, None), ("old-process", None)]
    assert records[1].ended_at is not None, "closed: not shown as holding for ever"
    found = admin.execute(
        f"SELECT keep_until IS NOT NULL FROM {table}_history WHERE holder = 'old-process'"  # noqa: S608
    ).fetchone()
    assert found == (True,), "and retention removes it in time"


def test_a_retention_change_waits_for_readers_without_stalling_the_holders(
    make: Callable[..., Mutex],
    dsn: str,
    table: str,
    row: Callable[..., tuple[Any, ...] | None],
    admin: psycopg.Connection[Any],
) -> None:
    mutex = make()
    changed: list[bool] = []
    with mutex.acquire(), psycopg.connect(dsn) as reader:
        reader.execute(f"SELECT count(*) FROM {table}_history")  # noqa: S608 - a dashboard's open transaction
        thread = threading.Thread(
            target=lambda: changed.append(LockTable(dsn, table=table).migrate(history=True, history_retention=60))
        )
        thread.start()
        # While the change waits for the reader, heartbeats go on: the holder keeps its lock.
        watched_until = time.monotonic() + 2 * FAST["stale_threshold"]
        while time.monotonic() < watched_until:
            assert heartbeat_age(row, table) < FAST["alert_threshold"], "a heartbeat queued behind the change"
            stamp = last_heartbeat(admin, table)
            wait_until(lambda: last_heartbeat(admin, table) != stamp, timeout=5)  # noqa: B023
        assert mutex.held
        assert thread.is_alive(), "the change waits for the reader"
        reader.rollback()
        thread.join(timeout=30)
    assert changed == [False], "done once the reader ended (a retention is no schema change)"


def heartbeat_age(row: Callable[..., tuple[Any, ...] | None], table: str) -> float:
    found = row(table=table)
    assert found is not None
    return float(found[1])


def last_heartbeat(admin: psycopg.Connection[Any], table: str) -> object:
    found = admin.execute(f"SELECT last_heartbeat FROM {table}").fetchone()  # noqa: S608
    assert found is not None
    return found[0]


def test_history_reads_a_history_added_after_this_client_first_looked(
    make: Callable[..., Mutex], dsn: str, lock_name: str
) -> None:
    name = f"late_{uuid.uuid4().hex[:10]}"
    try:
        with contextlib.closing(MutexClient(dsn)) as client:
            lock_table = LockTable(client=client, table=name)
            lock_table.create()
            with client.mutex(lock_name, table=name, **FAST).acquire():  # this client knows the table's shape
                pass
            with contextlib.closing(MutexClient(dsn)) as other:
                LockTable(client=other, table=name).migrate(history=True)  # another process adds the history
            assert lock_table.history() == []
    finally:
        drop(dsn, name)
