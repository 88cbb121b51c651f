"""A fair Semaphore (``fair=True``): a released permit goes to the oldest live waiter, across processes."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from postgres_mutex import LockAcquisitionTimeout, LockTable, Mutex, PermitsMismatchError, Semaphore
from postgres_mutex._sql import Names
from postgres_mutex._sql.lock import Statements
from postgres_mutex._sql.shape import CURRENT
from tests.support.exclusion import read_log
from tests.support.fixtures import ROOT, wait_until
from tests.support.timing import FAST

WORKERS = 6


def _start(dsn: str, name: str, label: str, log: Path, poll: float, permits: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.fair_worker", dsn, name, label, str(log), str(poll), str(permits)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def make_semaphore(dsn: str, lock_name: str, admin: psycopg.Connection[Any]) -> Iterator[Callable[..., Semaphore]]:
    """Fair Semaphores of the test's name with fast thresholds; each closed after the test."""
    made: list[Semaphore] = []

    def make(**kwargs: Any) -> Semaphore:
        options: dict[str, Any] = {**FAST, "stale_threshold": 30.0, "fair": True, **kwargs}
        semaphore = Semaphore(dsn, lock_name, **options)
        made.append(semaphore)
        return semaphore

    yield make
    for semaphore in made:
        semaphore.close()


def _queued(admin: psycopg.Connection[Any], name: str) -> list[str]:
    rows = admin.execute(
        "SELECT instance_id FROM mutex_lock_queue WHERE lock_name = %s || chr(31) ORDER BY ticket", [name]
    ).fetchall()
    return [row[0] for row in rows]


def _queued_count_is(admin: psycopg.Connection[Any], name: str, count: int) -> bool:
    return len(_queued(admin, name)) == count


def _held(admin: psycopg.Connection[Any], name: str) -> int:
    row = admin.execute("SELECT count(*) FROM mutex_lock WHERE semaphore = %s", [name]).fetchone()
    assert row is not None
    return int(row[0])


def _ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "ready\n", f"worker did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"


def _go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _held_by(proc: subprocess.Popen[str], label: str) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:2] == ["held", label], (line, proc.stderr.read() if proc.stderr else "")
    return int(line[2])


def test_waiters_in_six_processes_take_the_permit_in_the_order_they_came(
    make_semaphore: Callable[..., Semaphore],
    admin: psycopg.Connection[Any],
    dsn: str,
    lock_name: str,
    tmp_path: Path,
    workers: list[subprocess.Popen[str]],
) -> None:
    log = tmp_path / "sections.log"
    holder = make_semaphore(permits=1)
    assert holder.acquire(blocking=False).__enter__()
    for label in range(WORKERS):
        workers.append(_start(dsn, lock_name, str(label), log, 1.0, 1))
    for proc in workers:
        _ready(proc)
    for count, proc in enumerate(workers, 1):
        _go(proc)  # one at a time: each is queued before the next asks
        wait_until(functools.partial(_queued_count_is, admin, lock_name, count), timeout=30)
    holder.release()
    tokens = {label: _held_by(proc, str(label)) for label, proc in enumerate(workers)}
    for proc in workers:
        assert proc.wait(timeout=30) == 0
    by_token = sorted(tokens, key=tokens.__getitem__)
    overtakes = sum(1 for i, label in enumerate(by_token) if label != i)
    assert overtakes == 0, by_token
    assert _queued(admin, lock_name) == []
    assert _held(admin, lock_name) == 0


def test_released_permits_go_to_the_oldest_waiters_and_never_to_more_than_permits(
    make_semaphore: Callable[..., Semaphore], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    permits = 2
    holders = [make_semaphore(permits=permits) for _ in range(permits)]
    for holder in holders:
        assert holder.acquire(blocking=False).__enter__()
    waiters = [make_semaphore(permits=permits, poll_interval=1.0) for _ in range(6)]
    guard = threading.Lock()
    inside = [0]
    most = [0]
    order: list[int] = []
    failures: list[BaseException] = []

    def take(index: int) -> None:
        try:
            with waiters[index].acquire(timeout=30):
                with guard:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                    order.append(index)
                time.sleep(0.05)
                with guard:
                    inside[0] -= 1
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=take, args=(index,)) for index in range(len(waiters))]
    for count, thread in enumerate(threads, 1):
        thread.start()  # one at a time: each is queued before the next asks
        wait_until(functools.partial(_queued_count_is, admin, lock_name, count), timeout=30)
    for holder in holders:
        holder.release()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == []
    assert sorted(order) == list(range(len(waiters)))
    # Two permits: the two oldest waiters are handed them, and each takes its own with an attempt of its
    # own, so neighbours may swap; none comes in before a waiter two places ahead of it.
    assert all(abs(position - index) < permits for position, index in enumerate(order)), order
    assert most[0] == permits
    assert _queued(admin, lock_name) == []
    assert _held(admin, lock_name) == 0


def test_a_dead_waiter_is_passed_over(
    make_semaphore: Callable[..., Semaphore],
    admin: psycopg.Connection[Any],
    dsn: str,
    lock_name: str,
    tmp_path: Path,
    workers: list[subprocess.Popen[str]],
) -> None:
    log = tmp_path / "sections.log"
    holder = make_semaphore(permits=1, poll_interval=0.1)
    assert holder.acquire(blocking=False).__enter__()
    dead, alive = (_start(dsn, lock_name, label, log, 0.1, 1) for label in ("dead", "alive"))
    workers.extend([dead, alive])
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
                "SELECT count(*) FROM mutex_lock_queue WHERE lock_name = %s || chr(31)"
                " AND seen > now() - interval '1.5 s'",
                [lock_name],
            ).fetchone()
            == (1,)
        ),
        timeout=30,
    )
    released = time.monotonic()
    holder.release()
    _held_by(alive, "alive")
    # Long before the 30 s stale threshold a permit handed to the dead waiter would have waited for.
    assert time.monotonic() - released < 5.0
    assert alive.wait(timeout=30) == 0
    assert [section.who for section in read_log(log)] == ["alive"]


def test_a_waiter_timing_out_as_it_is_handed_a_permit_leaves_no_row(
    make_semaphore: Callable[..., Semaphore], admin: psycopg.Connection[Any], dsn: str, lock_name: str
) -> None:
    admin.execute("INSERT INTO mutex_lock_semaphores (name, permits) VALUES (%s, 1)", [lock_name])
    admin.execute(
        "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at, semaphore, permit, permits) "
        "VALUES (%s || chr(31) || '0', 'someone-else', now(), now(), %s, 0, 1)",
        [lock_name, lock_name],
    )
    waiter = make_semaphore(permits=1, poll_interval=5.0)
    outcome: list[BaseException | bool] = []

    def wait() -> None:
        try:
            outcome.append(waiter.acquire(timeout=1.0).__enter__())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: _queued(admin, lock_name) == [waiter.instance_id])
    # The hand-off lands after the waiter's last attempt and before it leaves the line (its entry held until
    # it timed out), as a release's would: the permit's row rewritten for it, its entry dequeued.
    with psycopg.connect(dsn, autocommit=False) as handing:
        handing.execute(
            "SELECT 1 FROM mutex_lock_queue WHERE lock_name = %s || chr(31) AND instance_id = %s FOR KEY SHARE",
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
            "UPDATE mutex_lock SET instance_id = %s, acquired_at = now(), last_heartbeat = now() WHERE semaphore = %s",
            [waiter.instance_id, lock_name],
        )
        handing.execute(
            "DELETE FROM mutex_lock_queue WHERE lock_name = %s || chr(31) AND instance_id = %s",
            [lock_name, waiter.instance_id],
        )
        handing.commit()
    assert not waiter.held
    # Nobody owns the permit handed to it: it is handed on (here, to nobody: deleted), long before stale_threshold.
    wait_until(lambda: _held(admin, lock_name) == 0, timeout=5)
    assert _queued(admin, lock_name) == []


def test_a_waiter_refused_for_its_number_of_permits_leaves_the_line(
    make_semaphore: Callable[..., Semaphore], admin: psycopg.Connection[Any], dsn: str, lock_name: str
) -> None:
    holder, waiter = make_semaphore(permits=1), make_semaphore(permits=1, poll_interval=1.0)
    assert holder.acquire(blocking=False).__enter__()
    outcome: list[BaseException | bool] = []

    def wait() -> None:
        try:
            outcome.append(waiter.acquire(timeout=10).__enter__())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: _queued(admin, lock_name) == [waiter.instance_id])
    LockTable(dsn).set_permits(lock_name, 2)
    thread.join(timeout=10)
    assert len(outcome) == 1, outcome
    assert isinstance(outcome[0], PermitsMismatchError), outcome
    # It leaves the line at once (not when its entry stops counting as live, seconds later) ...
    wait_until(lambda: _queued(admin, lock_name) == [], timeout=3)
    holder.release()
    # ... so the permit released is not handed to it, where nobody would renew it.
    rows = admin.execute("SELECT instance_id FROM mutex_lock WHERE semaphore = %s", [lock_name]).fetchall()
    assert rows == []


_STATEMENTS = Statements(Names("mutex_lock"), CURRENT)


def _params(name: str, instance_id: str, acquired_at: object = None) -> dict[str, Any]:
    """A fair permit's acquire's or release's parameters, as a Semaphore of 2 permits sends them."""
    return {
        "lock_name": name, "semaphore": name, "permits": 2, "instance_id": instance_id, "stale_seconds": 30.0,
        "reclaim_seconds": None, "channel": "mutex_lock_test", "acquired_at": acquired_at, "ended_how": "released",
        "alert_seconds": 10.0, "hold_seconds": None, "waiter_live_seconds": 30.0, "wait_id": f"{instance_id}/1",
        "_session_key": None, "_backend_pid": None, "own_slot": None,
    }  # fmt: skip


def _acquire(conn: psycopg.Connection[Any], name: str, instance_id: str) -> tuple[Any, ...]:
    statement = _STATEMENTS.acquire_permit_fair
    assert statement is not None
    assert statement.bare is not None
    row = conn.execute(statement.bare, _params(name, instance_id)).fetchone()
    assert row is not None
    return tuple(row)


def _release(conn: psycopg.Connection[Any], name: str, instance_id: str, acquired_at: object) -> None:
    statement = _STATEMENTS.release_permit_fair
    assert statement is not None
    assert statement.bare is not None
    conn.execute(statement.bare, _params(name, instance_id, acquired_at)).fetchall()


def _rows_of(admin: psycopg.Connection[Any], name: str, instance_id: str) -> int:
    row = admin.execute(
        "SELECT count(*) FROM mutex_lock WHERE semaphore = %s AND instance_id = %s", [name, instance_id]
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_waiter_handed_a_permit_as_its_attempt_finds_one_free_holds_one_only(
    dsn: str, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    with (
        psycopg.connect(dsn, autocommit=True) as first,
        psycopg.connect(dsn, autocommit=True) as second,
        psycopg.connect(dsn) as handing,
        psycopg.connect(dsn, autocommit=True) as waiting,
    ):
        one, two = _acquire(first, lock_name, "one"), _acquire(second, lock_name, "two")
        assert one[4] is not None
        assert two[4] is not None
        assert _acquire(waiting, lock_name, "waiter")[4] is None  # queued
        # The first release chooses the waiter (its entry locked) and hands it the permit, not committed yet;
        # the second finds nobody else in line and frees its permit.
        _release(handing, lock_name, "one", one[3])
        _release(second, lock_name, "two", two[3])
        # The waiter's attempt now sees a free permit and nobody ahead of it, while the first release commits.
        attempt: list[tuple[Any, ...]] = []
        thread = threading.Thread(target=lambda: attempt.append(_acquire(waiting, lock_name, "waiter")))
        thread.start()
        wait_until(lambda: admin.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone() != (0,))
        handing.commit()
        thread.join(timeout=10)
        assert len(attempt) == 1
        # The permit handed to it is the one it holds: no second permit, which nobody would renew.
        assert _rows_of(admin, lock_name, "waiter") == 1
        assert _acquire(waiting, lock_name, "waiter")[4] is not None  # its next attempt takes it
        assert _rows_of(admin, lock_name, "waiter") == 1


def test_a_waiter_leaving_with_two_permits_hands_one_on(
    dsn: str, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    leave = _STATEMENTS.leave_permit_fair
    assert leave is not None
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert _acquire(conn, lock_name, "one")[4] is not None
        assert _acquire(conn, lock_name, "two")[4] is not None
        assert _acquire(conn, lock_name, "next")[4] is None  # queued
        # Both permits are the leaver's (one won, one handed to it as it won), as a race can leave them.
        admin.execute("UPDATE mutex_lock SET instance_id = 'leaver' WHERE semaphore = %s", [lock_name])
        psycopg.ClientCursor(conn).execute(leave.text, {**_params(lock_name, "leaver"), "_server_timeout_ms": 10_000})
        # The next waiter waits for one permit: it is handed one; the other is free for whoever comes.
        assert _rows_of(admin, lock_name, "next") == 1
        assert _held(admin, lock_name) == 1


def test_a_fair_mutex_of_the_same_name_waits_in_a_line_of_its_own(
    make_semaphore: Callable[..., Semaphore],
    make_mutex: Callable[..., Mutex],
    admin: psycopg.Connection[Any],
    lock_name: str,
) -> None:
    holder, waiter = make_mutex(fair=True), make_mutex(fair=True, poll_interval=1.0)
    assert holder.acquire(blocking=False).__enter__()
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=30).__enter__()))
    thread.start()
    wait_until(
        lambda: (
            admin.execute("SELECT count(*) FROM mutex_lock_queue WHERE lock_name = %s", [lock_name]).fetchone() == (1,)
        )
    )
    # The Mutex's waiter came first, but is not the semaphore's: its free permit is taken at once.
    semaphore = make_semaphore(permits=1)
    assert semaphore.acquire(blocking=False).__enter__()
    semaphore.release()
    holder.release()
    thread.join(timeout=30)
    assert got == [True]
