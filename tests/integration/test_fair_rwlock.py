"""A fair read/write lock (``fair=True``): writers are served in the order they came, across processes."""

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

from postgres_mutex import LockAcquisitionTimeout, RWLock
from postgres_mutex._sql import Names
from postgres_mutex._sql.lock import Statements
from postgres_mutex._sql.shape import CURRENT
from postgres_mutex._state.rows import rw_row_name
from tests.support.exclusion import overlaps, read_log
from tests.support.fixtures import ROOT, wait_until
from tests.support.timing import FAST

WRITERS = 5


def _start(dsn: str, name: str, label: str, log: Path, poll: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.fair_worker", dsn, name, label, str(log), str(poll), "write"],
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
def make_rwlock(dsn: str, lock_name: str, admin: psycopg.Connection[Any]) -> Iterator[Callable[..., RWLock]]:
    """Fair RWLocks of the test's name with fast thresholds; each closed after the test."""
    made: list[RWLock] = []

    def make(**kwargs: Any) -> RWLock:
        options: dict[str, Any] = {**FAST, "stale_threshold": 30.0, "fair": True, **kwargs}
        rwlock = RWLock(dsn, lock_name, **options)
        made.append(rwlock)
        return rwlock

    yield make
    for rwlock in made:
        rwlock.close()


def _queued(admin: psycopg.Connection[Any], name: str) -> list[str]:
    rows = admin.execute(
        "SELECT instance_id FROM mutex_lock_queue WHERE lock_name = %s || chr(31) || 'w' ORDER BY ticket", [name]
    ).fetchall()
    return [row[0] for row in rows]


def _queued_count_is(admin: psycopg.Connection[Any], name: str, count: int) -> bool:
    return len(_queued(admin, name)) == count


def _rows(admin: psycopg.Connection[Any], name: str) -> int:
    row = admin.execute("SELECT count(*) FROM mutex_lock WHERE rwlock = %s", [name]).fetchone()
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


def test_writers_in_five_processes_write_in_the_order_they_came(
    make_rwlock: Callable[..., RWLock],
    admin: psycopg.Connection[Any],
    dsn: str,
    lock_name: str,
    tmp_path: Path,
    workers: list[subprocess.Popen[str]],
) -> None:
    log = tmp_path / "sections.log"
    holder = make_rwlock()
    assert holder.write(blocking=False).__enter__()
    for label in range(WRITERS):
        workers.append(_start(dsn, lock_name, str(label), log, 1.0))
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
    assert overlaps(read_log(log)) == []
    assert _queued(admin, lock_name) == []
    assert _rows(admin, lock_name) == 0


def test_a_reader_that_comes_after_a_waiting_writer_reads_after_it(
    make_rwlock: Callable[..., RWLock], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    holder, writer, reader = make_rwlock(), make_rwlock(poll_interval=1.0), make_rwlock(poll_interval=0.05)
    assert holder.write(blocking=False).__enter__()
    order: list[str] = []
    failures: list[BaseException] = []

    def take(rwlock: RWLock, mode: str) -> None:
        try:
            with rwlock.write(timeout=30) if mode == "write" else rwlock.read(timeout=30):
                order.append(mode)
                time.sleep(0.05)
        except BaseException as exc:
            failures.append(exc)

    writing = threading.Thread(target=take, args=(writer, "write"))
    writing.start()
    wait_until(lambda: _queued(admin, lock_name) == [writer.instance_id])
    reading = threading.Thread(target=take, args=(reader, "read"))
    reading.start()
    wait_until(lambda: reader.last_holder is not None)  # it attempted, found the lock taken, and waits
    holder.release()
    writing.join(timeout=30)
    reading.join(timeout=30)
    assert failures == []
    assert order == ["write", "read"]


def test_a_dead_writer_in_line_is_passed_over(
    make_rwlock: Callable[..., RWLock],
    admin: psycopg.Connection[Any],
    dsn: str,
    lock_name: str,
    tmp_path: Path,
    workers: list[subprocess.Popen[str]],
) -> None:
    log = tmp_path / "sections.log"
    holder = make_rwlock(poll_interval=0.1)
    assert holder.write(blocking=False).__enter__()
    dead, alive = (_start(dsn, lock_name, label, log, 0.1) for label in ("dead", "alive"))
    workers.extend([dead, alive])
    for proc in (dead, alive):
        _ready(proc)
    _go(dead)
    wait_until(lambda: len(_queued(admin, lock_name)) == 1, timeout=30)
    _go(alive)
    wait_until(lambda: len(_queued(admin, lock_name)) == 2, timeout=30)
    dead.kill()
    dead.wait(timeout=10)
    # The dead writer is older in line, but no longer seen (it attempted every 0.1 s).
    wait_until(
        lambda: (
            admin.execute(
                "SELECT count(*) FROM mutex_lock_queue WHERE lock_name = %s || chr(31) || 'w'"
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
    # Long before the 30 s stale threshold a row handed to the dead writer would have waited for.
    assert time.monotonic() - released < 5.0
    assert alive.wait(timeout=30) == 0


def test_a_writer_timing_out_as_it_is_handed_the_lock_leaves_no_row_and_lets_readers_in(
    make_rwlock: Callable[..., RWLock], admin: psycopg.Connection[Any], dsn: str, lock_name: str
) -> None:
    admin.execute("INSERT INTO mutex_lock_rwlocks (name, mode) VALUES (%s, 'write')", [lock_name])
    admin.execute(
        "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at, rwlock, rw_mode) "
        "VALUES (%s || chr(31) || 'w', 'someone-else', now(), now(), %s, 'write')",
        [lock_name, lock_name],
    )
    waiter = make_rwlock(poll_interval=5.0)
    outcome: list[BaseException | bool] = []

    def wait() -> None:
        try:
            outcome.append(waiter.write(timeout=1.0).__enter__())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: _queued(admin, lock_name) == [waiter.instance_id])
    # The hand-off lands after the writer's last attempt and before it leaves the line (its entry held until
    # it timed out), as a release's would: the writer's row rewritten for it, its entry dequeued.
    with psycopg.connect(dsn, autocommit=False) as handing:
        handing.execute(
            "SELECT 1 FROM mutex_lock_queue WHERE lock_name = %s || chr(31) || 'w' AND instance_id = %s FOR KEY SHARE",
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
            "UPDATE mutex_lock SET instance_id = %s, acquired_at = now(), last_heartbeat = now() WHERE rwlock = %s",
            [waiter.instance_id, lock_name],
        )
        handing.execute(
            "DELETE FROM mutex_lock_queue WHERE lock_name = %s || chr(31) || 'w' AND instance_id = %s",
            [lock_name, waiter.instance_id],
        )
        handing.commit()
    assert not waiter.held
    # Nobody owns the row handed to it: it is handed on (here, to nobody: deleted), long before stale_threshold.
    wait_until(lambda: _rows(admin, lock_name) == 0, timeout=5)
    assert _queued(admin, lock_name) == []
    # And its claim on the gate went with it: a reader gets in at once, not after the claim's 12 s.
    reader = make_rwlock()
    assert reader.read(blocking=False).__enter__()


_STATEMENTS = Statements(Names("mutex_lock"), CURRENT)


def _params(name: str, instance_id: str, mode: str = "write", acquired_at: object = None) -> dict[str, Any]:
    """A fair writer's (or a reader's) acquire's or release's parameters, as an RWLock sends them."""
    row = rw_row_name(name, instance_id, mode)
    return {
        "lock_name": row, "rwlock": name, "row_name": row, "waiting": True, "waiting_seconds": 5.0,
        "instance_id": instance_id, "stale_seconds": 30.0, "reclaim_seconds": None, "channel": "mutex_lock_test",
        "acquired_at": acquired_at, "ended_how": "released", "alert_seconds": 10.0, "hold_seconds": None,
        "waiter_live_seconds": 30.0, "wait_id": f"{instance_id}/1", "_session_key": None, "_backend_pid": None,
        "own_slot": None,
    }  # fmt: skip


def test_a_writer_in_line_passed_over_by_a_release_still_goes_before_readers(
    dsn: str, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    acquire, release, read = _STATEMENTS.acquire_write_fair, _STATEMENTS.release_write_fair, _STATEMENTS.acquire_read
    assert acquire is not None
    assert release is not None
    assert read is not None
    assert acquire.bare is not None
    assert release.bare is not None
    assert read.bare is not None
    with (
        psycopg.connect(dsn, autocommit=True) as first,
        psycopg.connect(dsn, autocommit=True) as second,
        psycopg.connect(dsn) as blocker,
    ):
        held = first.execute(acquire.bare, _params(lock_name, "first")).fetchone()
        assert held is not None
        assert held[3] is not None
        queued = second.execute(acquire.bare, _params(lock_name, "second")).fetchone()
        assert queued is not None
        assert queued[3] is None  # in line
        # The second writer's next attempt runs (its entry row-locked) as the first one's release does: the
        # release passes it over and deletes the row. The gate's row held a moment orders the two.
        blocker.execute("SELECT 1 FROM mutex_lock_rwlocks WHERE name = %s FOR UPDATE", [lock_name])
        done: dict[str, object] = {}

        def run(key: str, conn: psycopg.Connection[Any], text: str, params: dict[str, Any]) -> None:
            done[key] = conn.execute(text, params).fetchall()

        attempt = threading.Thread(target=run, args=("attempt", second, acquire.bare, _params(lock_name, "second")))
        attempt.start()
        wait_until(lambda: admin.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone() != (0,))
        params = _params(lock_name, "first", acquired_at=held[3])
        releasing = threading.Thread(target=run, args=("release", first, release.bare, params))
        releasing.start()
        wait_until(
            lambda: (
                "release" in done or admin.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone() == (2,)
            )
        )
        blocker.rollback()
        attempt.join(timeout=10)
        releasing.join(timeout=10)
        assert set(done) == {"attempt", "release"}
        assert _rows(admin, lock_name) == 0  # passed over: the row deleted, not handed to it
        assert _queued(admin, lock_name) == ["second"]
        # A reader coming now waits: the writer in line takes the lock at its next attempt.
        reader = admin.execute(read.bare, _params(lock_name, "reader", "read")).fetchone()
        assert reader is not None
        assert reader[3] is None
