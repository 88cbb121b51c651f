"""A reader or a writer of a two-row ledger under one `RWLock`, as jobs sharing a catalogue would.

    python -m chaos.rw_ledger_worker DSN RWLOCK LEDGER ROLE NAME STOPFILE

The ledger has two rows, ``id`` 1 and 2, whose ``counter`` a writer moves on
together: a version of the ledger is both rows equal.

- ROLE ``writer`` holds the lock for writing, again and again (`WRITER_REST` apart); each hold makes
  `INCREMENTS` increments, each one transaction fenced with ``rw.fence(conn)``
  that reads row 1, works, writes it plus one, works again and writes row 2 the
  same: the read-modify-write a writer's hold is there to protect.
- ROLE ``reader`` holds it for reading, again and again; each hold reads row 1,
  row 2 and row 1 again in one fenced transaction (READ COMMITTED: each
  statement sees what was committed when it ran, so a writer committing in the
  middle would show as unequal counters).

Each prints, one per line: ``held <t>`` (a hold began), ``believed <t>``
(``held`` was true at ``t``), ``read <value>`` (a writer inside its transaction,
before writing: the test may freeze it there), ``committed <value>``,
``saw <a> <b> <a again>`` (a reader's three reads), ``fenced-out`` (a fence
refused: the transaction rolled back), ``exit <t> <held>`` (the hold's end, and
whether it still believed it held the lock), ``lost`` (the hold ended in
`LockNotHeldError`). Times are ``time.monotonic()``, which every process on the
machine shares. The worker stops when STOPFILE exists; while ``STOPFILE.NAME.slow``
exists, a writer's next increment works `SLOW_WORK` seconds (it removes the file and
prints ``read-slow <value>`` first), so that the test can freeze
or kill it in the middle of one. Thresholds come from ``CHAOS_TIMING`` (JSON).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import psycopg

from postgres_mutex import LockNotHeldError, MutexError, RWLock

INCREMENTS = 3
"""Increments per writer's hold."""

WORK = 0.01
"""Seconds between a transaction's statements: the work a half-done write would be seen in."""

WRITER_REST = 0.3
"""Seconds a writer rests between its holds, as writers do: writers that queue without a pause would keep
readers out (a waiting writer holds new readers back), and the readers are half of what is tested."""

SLOW_WORK = 3.0
"""Seconds of the one slow transaction the test asks for: long enough to freeze or kill the worker in it."""


def main(dsn: str, rwlock: str, ledger: str, role: str, name: str, stop_file: str) -> None:
    timing = json.loads(os.environ["CHAOS_TIMING"])
    rw = RWLock(dsn, rwlock, instance_id=name, **timing)
    conn = psycopg.connect(dsn)
    slow_file = f"{stop_file}.{name}.slow"
    deadline = time.monotonic() + 120  # bounded, whatever happens to the stop file
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        try:
            hold(rw, conn, ledger, role, stop_file, slow_file)
            if role == "writer":
                time.sleep(WRITER_REST)
        except LockNotHeldError:
            print("lost", flush=True)
        except MutexError as exc:
            print(f"error {type(exc).__name__}", flush=True)
        except psycopg.OperationalError:
            conn = psycopg.connect(dsn)  # a fence that timed out closes the connection: take a new one
    rw.close()


def hold(rw: RWLock, conn: psycopg.Connection[Any], ledger: str, role: str, stop_file: str, slow_file: str) -> None:
    acquire = rw.write if role == "writer" else rw.read
    with acquire(blocking=True, timeout=30) as got:
        if not got:
            return
        print(f"held {time.monotonic()}", flush=True)
        try:
            for _ in range(INCREMENTS if role == "writer" else 1):
                if os.path.exists(stop_file) or not rw.held:
                    break
                # After the check: the belief is dated no earlier than it was seen.
                print(f"believed {time.monotonic()}", flush=True)
                work = WORK
                if os.path.exists(slow_file):
                    os.remove(slow_file)
                    work = SLOW_WORK
                if role == "writer":
                    increment(rw, conn, ledger, work)
                else:
                    read(rw, conn, ledger)
        finally:
            print(f"exit {time.monotonic()} {int(rw.held)}", flush=True)


def increment(rw: RWLock, conn: psycopg.Connection[Any], ledger: str, work: float) -> None:
    try:
        with rw.fenced(conn):
            value = counter(conn, ledger, 1)
            print(f"{'read-slow' if work > WORK else 'read'} {value}", flush=True)
            time.sleep(work)  # the work between reading and writing
            conn.execute(f"UPDATE {ledger} SET counter = %s WHERE id = 1", (value + 1,))  # noqa: S608
            time.sleep(WORK)  # half done: a reader beside it would see the rows differ once it commits
            conn.execute(f"UPDATE {ledger} SET counter = %s WHERE id = 2", (value + 1,))  # noqa: S608
    except LockNotHeldError:
        print("fenced-out", flush=True)
        return
    print(f"committed {value + 1}", flush=True)


def read(rw: RWLock, conn: psycopg.Connection[Any], ledger: str) -> None:
    try:
        with rw.fenced(conn):
            first = counter(conn, ledger, 1)
            time.sleep(WORK)
            second = counter(conn, ledger, 2)
            time.sleep(WORK)
            again = counter(conn, ledger, 1)
    except LockNotHeldError:
        print("fenced-out", flush=True)
        return
    print(f"saw {first} {second} {again}", flush=True)


def counter(conn: psycopg.Connection[Any], ledger: str, row: int) -> int:
    found = conn.execute(f"SELECT counter FROM {ledger} WHERE id = %s", (row,)).fetchone()  # noqa: S608
    assert found is not None
    return int(found[0])


if __name__ == "__main__":
    main(*sys.argv[1:7])
