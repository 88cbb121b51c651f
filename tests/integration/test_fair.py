"""A fair Mutex (``fair=True``): waiters acquire in the order they came, across processes (`_sql.fair`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from postgres_mutex import LockAcquisitionTimeout, LockTable, Mutex, MutexClient, SchemaError
from postgres_mutex._sql import fair
from postgres_mutex._state.heartbeat_flows import LEASE_FROM
from tests.support.exclusion import overlaps, read_log
from tests.support.fixtures import ROOT, channel_of, wait_until

WORKERS = 10


def _start(dsn: str, lock: str, label: str, log: Path, poll: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.fair_worker", dsn, lock, label, str(log), str(poll)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def fair_workers() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _queued(admin: psycopg.Connection[Any], lock: str, table: str = "mutex_lock") -> list[str]:
    rows = admin.execute(
        f'SELECT instance_id FROM "{table}_queue" WHERE lock_name = %s ORDER BY ticket',  # noqa: S608
        [lock],
    ).fetchall()
    return [row[0] for row in rows]


def _queued_count_is(admin: psycopg.Connection[Any], lock: str, count: int) -> bool:
    return len(_queued(admin, lock)) == count


def _ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "ready\n", f"worker did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"


def _go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def test_waiters_in_ten_processes_acquire_in_the_order_they_came(
    make_mutex: Callable[..., Mutex],
    admin: psycopg.Connection[Any],
    dsn: str,
    lock_name: str,
    tmp_path: Path,
    fair_workers: list[subprocess.Popen[str]],
) -> None:
    log = tmp_path / "sections.log"
    holder = make_mutex(fair=True)
    assert holder.acquire(blocking=False).__enter__()
    for label in range(WORKERS):
        fair_workers.append(_start(dsn, lock_name, str(label), log, 1.0))
    for proc in fair_workers:
        _ready(proc)
    for count, proc in enumerate(fair_workers, 1):
        _go(proc)  # one at a time: each is queued before the next asks
        wait_until(functools.partial(_queued_count_is, admin, lock_name, count), timeout=30)
    holder.release()
    tokens: dict[int, int] = {}
    for label, proc in enumerate(fair_workers):
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:2] == ["held", str(label)], (line, proc.stderr.read() if proc.stderr else "")
        tokens[label] = int(line[2])
        assert proc.wait(timeout=30) == 0
    by_token = sorted(tokens, key=tokens.__getitem__)
    overtakes = sum(1 for i, label in enumerate(by_token) if label != i)
    assert overtakes == 0, by_token
    assert overlaps(read_log(log)) == []
    assert _queued(admin, lock_name) == []


@pytest.mark.parametrize("waiting_with", ["acquire", "acquire_async"])
def test_a_hand_off_is_told_to_the_waiters_process_alone(
    dsn: str, admin: psycopg.Connection[Any], lock_name: str, waiting_with: str
) -> None:
    """A fair release tells the waiter it hands the lock to on its process's own slot channel: no other process
    listening on the lock (the releaser's own lingering registration, a bystander here) wakes for it."""
    channel = channel_of(lock_name)
    # Polls half a minute apart: the waiter can only get the lock in time by being told.
    slow: dict[str, Any] = {"poll_interval": 30.0, "stale_threshold": 60.0, "alert_threshold": 30.0}
    got: list[float] = []
    leave = threading.Event()
    with (
        MutexClient(dsn) as releasing,
        MutexClient(dsn) as waiting,
        psycopg.connect(dsn, autocommit=True) as bystander,
    ):
        bystander.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        holder = releasing.mutex(lock_name, fair=True, **slow)
        waiter = waiting.mutex(lock_name, fair=True, **slow)
        assert holder.acquire().__enter__()

        def wait() -> None:
            if waiting_with == "acquire":
                with waiter.acquire(blocking=True, timeout=20.0) as acquired:
                    if acquired:
                        got.append(time.monotonic())
                    leave.wait(20.0)
                return

            async def wait_async() -> None:
                try:
                    async with waiter.acquire_async(blocking=True, timeout=20.0) as acquired:
                        if acquired:
                            got.append(time.monotonic())
                        await asyncio.to_thread(leave.wait, 20.0)
                finally:
                    await waiting.aclose()

            asyncio.run(wait_async())

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        try:

            def the_waiters_attempt_named_its_slot() -> bool:
                # Registered on the lock's channel, and its attempt since then named the slot in the line.
                return any(re.search(r"@[0-9]+$", wait_id) for wait_id in _wait_ids(admin, lock_name))

            wait_until(the_waiters_attempt_named_its_slot, timeout=20)
            released = time.monotonic()
            holder.release()
            wait_until(lambda: bool(got), timeout=20)
            assert got[0] - released < 5.0, "the waiter was not told of the hand-off"
            heard = [note.payload for note in bystander.notifies(timeout=0.5) if note.channel == channel]
        finally:
            leave.set()
            thread.join(20.0)
    assert not [payload for payload in heard if payload.startswith(fair.WAKE_FAIR)], heard


def _wait_ids(admin: psycopg.Connection[Any], lock: str) -> list[str]:
    rows = admin.execute("SELECT wait_id FROM mutex_lock_queue WHERE lock_name = %s", [lock]).fetchall()
    return [row[0] for row in rows]


def test_a_dead_waiter_is_passed_over(
    make_mutex: Callable[..., Mutex],
    admin: psycopg.Connection[Any],
    dsn: str,
    lock_name: str,
    tmp_path: Path,
    fair_workers: list[subprocess.Popen[str]],
) -> None:
    log = tmp_path / "sections.log"
    holder = make_mutex(fair=True, poll_interval=0.1, stale_threshold=30.0)
    assert holder.acquire(blocking=False).__enter__()
    dead, alive = (_start(dsn, lock_name, label, log, 0.1) for label in ("dead", "alive"))
    fair_workers.extend([dead, alive])
    for proc in (dead, alive):
        _ready(proc)
    _go(dead)
    wait_until(lambda: len(_queued(admin, lock_name)) == 1, timeout=30)
    _go(alive)
    wait_until(lambda: len(_queued(admin, lock_name)) == 2, timeout=30)
    dead.kill()
    dead.wait(timeout=10)
    # The dead waiter is older in line, but no longer seen (it attempted every 0.1 s).
    wait_until(
        lambda: (
            admin.execute(
                "SELECT count(*) FROM mutex_lock_queue WHERE lock_name = %s AND seen > now() - interval '1.5 s'",
                [lock_name],
            ).fetchone()
            == (1,)
        ),
        timeout=30,
    )
    released = time.monotonic()
    holder.release()
    assert alive.stdout is not None
    line = alive.stdout.readline().split()
    assert line[:2] == ["held", "alive"], (line, alive.stderr.read() if alive.stderr else "")
    # Long before the 30 s stale threshold a row handed to the dead waiter would have waited for.
    assert time.monotonic() - released < 5.0
    assert alive.wait(timeout=30) == 0


def test_a_waiter_timing_out_as_it_is_handed_the_lock_leaves_no_row(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], dsn: str, lock_name: str
) -> None:
    admin.execute(
        "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) "
        "VALUES (%s, 'someone-else', now(), now())",
        [lock_name],
    )
    waiter = make_mutex(fair=True, poll_interval=5.0, stale_threshold=30.0)
    outcome: list[BaseException | bool] = []

    def wait() -> None:
        try:
            outcome.append(waiter.acquire(timeout=1.0).__enter__())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: _queued(admin, lock_name) == [waiter.instance_id])
    # The release's hand-off lands after the waiter's last attempt (at its deadline) and before it leaves the
    # line: its entry is held (FOR KEY SHARE: its attempts may refresh it, its leaving may not delete it yet)
    # until the waiter has timed out, then the row is rewritten for it as a release does.
    with psycopg.connect(dsn, autocommit=False) as handing:
        handing.execute(
            "SELECT 1 FROM mutex_lock_queue WHERE lock_name = %s AND instance_id = %s FOR KEY SHARE",
            [lock_name, waiter.instance_id],
        )
        thread.join(timeout=10)
        assert len(outcome) == 1, outcome
        assert isinstance(outcome[0], LockAcquisitionTimeout), outcome
        wait_until(
            lambda: admin.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone() != (0,),
            timeout=10,
        )
        handing.execute(
            "UPDATE mutex_lock SET instance_id = %s, acquired_at = now(), last_heartbeat = now() WHERE lock_name = %s",
            [waiter.instance_id, lock_name],
        )
        handing.execute(
            "DELETE FROM mutex_lock_queue WHERE lock_name = %s AND instance_id = %s",
            [lock_name, waiter.instance_id],
        )
        handing.commit()
    assert not waiter.held
    # Nobody owns the row handed to it: it is handed on (here, to nobody: deleted), long before stale_threshold.
    wait_until(
        lambda: admin.execute("SELECT count(*) FROM mutex_lock WHERE lock_name = %s", [lock_name]).fetchone() == (0,),
        timeout=5,
    )
    assert _queued(admin, lock_name) == []


def test_fair_and_plain_mutexes_of_one_name_never_hold_it_at_once(make_mutex: Callable[..., Mutex]) -> None:
    fair_holder = make_mutex(fair=True)
    fair_waiter = make_mutex(fair=True)
    plain_waiter = make_mutex()
    order: list[str] = []
    held_at_once: list[int] = []
    guard = threading.Lock()
    inside = [0]

    def take(mutex: Mutex, name: str) -> None:
        with mutex.acquire(timeout=10):
            with guard:
                inside[0] += 1
                held_at_once.append(inside[0])
                order.append(name)
            time.sleep(0.05)
            with guard:
                inside[0] -= 1

    assert fair_holder.acquire(blocking=False).__enter__()
    plain = threading.Thread(target=take, args=(plain_waiter, "plain"))
    plain.start()
    wait_until(lambda: plain_waiter._lock.phase.value == "acquiring")
    fair = threading.Thread(target=take, args=(fair_waiter, "fair"))
    fair.start()
    wait_until(lambda: fair_waiter._lock.phase.value == "acquiring")
    time.sleep(0.2)  # both attempted and wait
    fair_holder.release()
    plain.join(timeout=15)
    fair.join(timeout=15)
    assert sorted(order) == ["fair", "plain"]
    assert max(held_at_once) == 1


def test_fair_needs_the_queue_which_migrate_adds(dsn: str, admin: psycopg.Connection[Any], lock_name: str) -> None:
    table = f"fair_{lock_name.replace('-', '_')}"
    LockTable(dsn, table=table).create()
    admin.execute(f'DROP TABLE "{table}_queue"')
    plain = Mutex(dsn, lock_name, table=table)
    fair = Mutex(dsn, lock_name + "-fair", table=table, fair=True)
    try:
        assert plain.acquire(blocking=False).__enter__()  # a table not migrated keeps working
        plain.release()
        with pytest.raises(SchemaError, match="migrate"):
            fair.acquire(blocking=False).__enter__()
        LockTable(dsn, table=table).migrate()
        assert fair.acquire(blocking=False).__enter__()
        fair.release()
    finally:
        plain.close()
        fair.close()
        admin.execute(f'DROP TABLE "{table}", "{table}_queue", "{table}_semaphores", "{table}_rwlocks" CASCADE')


def test_the_history_has_each_hold_of_a_hand_off(dsn: str, admin: psycopg.Connection[Any], lock_name: str) -> None:
    table = f"fair_h_{lock_name.replace('-', '_')}"
    lock_table = LockTable(dsn, table=table)
    lock_table.create(history=True)
    holder = Mutex(
        dsn,
        lock_name,
        table=table,
        fair=True,
        heartbeat_interval=0.1,
        alert_threshold=0.6,
        stale_threshold=30.0,
        poll_interval=0.05,
    )
    waiter = Mutex(
        dsn,
        lock_name,
        table=table,
        fair=True,
        heartbeat_interval=0.1,
        alert_threshold=0.6,
        stale_threshold=30.0,
        poll_interval=0.05,
    )
    got: list[bool] = []
    try:
        assert holder.acquire(blocking=False).__enter__()
        first = holder.token
        thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=10).__enter__()))
        thread.start()
        wait_until(lambda: _queued(admin, lock_name, table) == [waiter.instance_id])
        holder.release()
        thread.join(timeout=15)
        assert got == [True]
        second = waiter.token
        assert first is not None
        assert second is not None
        assert second > first
        waiter.release()
        records = sorted(lock_table.history(lock_name), key=lambda record: record.acquired_at)
        assert [(r.holder, r.token, r.ended_how) for r in records] == [
            (holder.instance_id, first, "released"),
            (waiter.instance_id, second, "released"),
        ]
    finally:
        holder.close()
        waiter.close()
        admin.execute(
            f'DROP TABLE "{table}", "{table}_queue", "{table}_history", "{table}_semaphores", "{table}_rwlocks" CASCADE'
        )


def test_a_row_handed_to_a_waiter_that_died_is_not_kept_fresh_by_the_releasers_lease(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    # Thresholds roomy enough for the holder's heartbeat to renew by its lease (`_sql.leases`).
    thresholds: dict[str, Any] = {
        "heartbeat_interval": 0.2,
        "alert_threshold": 1.0,
        "stale_threshold": 4.0,
        "poll_interval": 0.05,
        "operation_timeout": 1.0,
    }
    holder = make_mutex(fair=True, **thresholds)
    # Other locks of the same client, enough to renew by a lease (`heartbeat_flows.LEASE_FROM`), keep it renewed
    # after the fair lock is handed on.
    kept = [make_mutex(lock_name=f"{lock_name}-kept-{n}", **thresholds) for n in range(LEASE_FROM)]
    with contextlib.ExitStack() as stack:
        assert all(stack.enter_context(each.acquire()) for each in kept)
        assert holder.acquire().__enter__()
        wait_until(
            lambda: (
                admin.execute("SELECT lease_key FROM mutex_lock WHERE lock_name = %s", [lock_name]).fetchone()
                not in (None, (None,))
            ),
            timeout=10,
        )
        # A waiter that queued, then died before its next attempt: it is handed the row and never takes it.
        admin.execute(
            "INSERT INTO mutex_lock_queue (lock_name, instance_id, seen, wait_id) VALUES (%s, 'died', now(), 'died/1')",
            [lock_name],
        )
        holder.release()
        handed = admin.execute("SELECT instance_id FROM mutex_lock WHERE lock_name = %s", [lock_name]).fetchone()
        assert handed == ("died",)
        # Its row turns stale by its own heartbeat, the release's, whatever the releaser's lease does since.
        started = time.monotonic()
        with make_mutex(fair=True, **thresholds).acquire(timeout=3 * thresholds["stale_threshold"]) as taken:
            assert taken
        assert time.monotonic() - started < 2 * thresholds["stale_threshold"]
        assert all(each.held for each in kept)
