"""A worker that increments a ledger row under the lock, as a job protecting data in the same database would.

    python -m chaos.ledger_worker DSN LOCK LEDGER MODE NAME STOPFILE

MODE is ``fenced`` (each increment is a transaction that calls
``mutex.fence(conn)`` first) or ``unfenced`` (the same transaction without
it). Each increment reads the counter and writes it back plus one: the
read-modify-write a lock is there to protect. The worker prints, one per line:
``held <t>``, ``believed <t>`` (``held`` was true at ``t``, before an increment),
``read <value>`` (inside the transaction, before writing: the test freezes it
there), ``committed <value>`` (after the commit), ``fenced-out`` (a fence
refused: the transaction rolled back), ``exit <t> <held>`` (the end of its
critical section, and whether it still believed it held the lock), ``lost``.
Times are ``time.monotonic()``, the clock every process on the machine shares,
so the test can check the sections for overlaps. It holds the lock once, as a
job does, and stops when its hold ends or STOPFILE exists.
Thresholds come from ``CHAOS_TIMING`` (JSON), as in the rest of the suite;
``CHAOS_FIRST_WORK`` (seconds) makes the first increment's work that long, so
a test can freeze the worker in the middle of it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import psycopg

from postgres_mutex import LockNotHeldError, Mutex, MutexError


def main(dsn: str, lock: str, ledger: str, mode: str, name: str, stop_file: str) -> None:
    timing = json.loads(os.environ["CHAOS_TIMING"])
    mutex = Mutex(dsn, lock, instance_id=name, **timing)
    conn = psycopg.connect(dsn)
    first_work = float(os.environ.get("CHAOS_FIRST_WORK", "0.05"))
    try:
        with mutex.acquire(blocking=True, timeout=60):
            print(f"held {time.monotonic()}", flush=True)
            try:
                work = first_work
                while not os.path.exists(stop_file) and mutex.held:
                    # After the check: the belief is dated no earlier than it was seen.
                    print(f"believed {time.monotonic()}", flush=True)
                    increment(mutex, conn, ledger, fenced=mode == "fenced", work=work)
                    work = 0.05
            finally:
                print(f"exit {time.monotonic()} {int(mutex.held)}", flush=True)
    except LockNotHeldError:
        print("lost", flush=True)
    except MutexError as exc:
        print(f"error {type(exc).__name__}", flush=True)
    mutex.close()


def increment(mutex: Mutex, conn: psycopg.Connection[tuple[int]], ledger: str, *, fenced: bool, work: float) -> None:
    try:
        with conn.transaction():
            if fenced:
                mutex.fence(conn)
            row = conn.execute(f"SELECT counter FROM {ledger} WHERE id = 1").fetchone()  # noqa: S608
            assert row is not None
            value = int(row[0])
            print(f"read {value}", flush=True)
            time.sleep(work)  # the work between reading and writing
            conn.execute(f"UPDATE {ledger} SET counter = %s WHERE id = 1", (value + 1,))  # noqa: S608
    except LockNotHeldError:
        print("fenced-out", flush=True)
        return
    print(f"committed {value + 1}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:7])
