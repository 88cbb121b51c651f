"""What the lock history costs: the same operations on a table with a history and on one without.

The history is opt-in (``LockTable.create(history=True)``) and written by the statements
that acquire, renew and end a hold, in the same round trip: the question is how much
longer those statements take. Every measure runs on this process, one connection per
table (the library's shared client), in interleaved rounds (`bench.timing.interleave`),
and each is reported as a median with its ratio to its twin on the table without a
history, measured in the same rounds:

- ``cycle`` / ``cycle_history``: ``with mutex.acquire()`` (sync, uncontended);
- ``heartbeat`` / ``heartbeat_history``: ``mutex.heartbeat()`` of a held lock (one
  heartbeat statement; with a history it also ends an alert episode, if there is one,
  which there is not here);
- ``cycle_sweep``: the cycle with a history, when its acquire finds `SWEEP_ROWS` expired
  history rows to remove (the retention that needs no cron job). They are inserted before
  each cycle, outside its timing, on a table of their own (every acquire on a table looks
  for expired rows, and the index entries of the rows just removed would lie in the way of
  ``cycle_history``'s); its ratio is to ``cycle_history``, the same cycle with nothing to
  remove.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from postgres_mutex import Mutex
from postgres_mutex._sql import Names

from .latency import Sizes
from .timing import Measure, interleave

SWEEP_ROWS = 100
"""Expired rows an acquire removes at most: the library's batch (the ``LIMIT`` of the acquire's sweep)."""


def run(dsn: str, table: str, history_table: str, sweep_table: str, sizes: Sizes) -> dict[str, Any]:
    """Time the measures above; ``table`` has no history, ``history_table`` and ``sweep_table`` have one."""
    plain = Mutex(dsn, "bench-history-off", table=table)
    kept = Mutex(dsn, "bench-history-on", table=history_table)
    sweeping = Mutex(dsn, "bench-history-sweep", table=sweep_table)
    held = Mutex(dsn, "bench-history-held-off", table=table)
    held_kept = Mutex(dsn, "bench-history-held-on", table=history_table)
    conn = psycopg.connect(dsn, autocommit=True)
    try:
        with held.acquire() as acquired, held_kept.acquire() as acquired_kept:
            if not (acquired and acquired_kept):
                raise RuntimeError("the heartbeat measures' locks were not acquired")
            measures = [
                Measure("cycle", _cycle(plain)),
                Measure("cycle_history", _cycle(kept)),
                Measure("cycle_sweep", _cycle(sweeping), setup=_expired_rows(conn, sweep_table)),
                Measure("heartbeat", held.heartbeat),
                Measure("heartbeat_history", held_kept.heartbeat),
            ]
            interleave(measures, rounds=sizes.rounds, per_round=sizes.per_round, warmup=sizes.warmup)
        timed = {measure.name: measure.timed for measure in measures}
        left = _expired_left(conn, sweep_table)
    finally:
        for mutex in (plain, kept, sweeping, held, held_kept):
            mutex.close()
        conn.close()
    return {
        **{name: value.summary() for name, value in timed.items()},
        "sweep_rows": SWEEP_ROWS,
        "expired_left": left,
        "cycle_ratio": round(timed["cycle_history"].median / timed["cycle"].median, 3),
        "heartbeat_ratio": round(timed["heartbeat_history"].median / timed["heartbeat"].median, 3),
        "sweep_ratio": round(timed["cycle_sweep"].median / timed["cycle_history"].median, 3),
    }


def _cycle(mutex: Mutex) -> Any:
    def cycle() -> None:
        with mutex.acquire() as acquired:
            if not acquired:
                raise RuntimeError(f"{mutex.lock_name} was not acquired")

    return cycle


def _expired_rows(conn: psycopg.Connection[Any], history_table: str) -> Any:
    """Insert `SWEEP_ROWS` ended holds of another lock, expired a second ago: the next acquire removes them."""
    insert = sql.SQL(
        """INSERT INTO {history} (lock_name, holder, acquired_at, ended_at, ended_how, keep_until)
SELECT 'bench-history-expired', 'bench', now() - interval '2 hours', now() - interval '1 hour', 'released',
       now() - interval '1 second'
  FROM generate_series(1, %s)"""
    ).format(history=Names(history_table).history)

    def setup() -> None:
        conn.execute(insert, (SWEEP_ROWS,))

    return setup


def _expired_left(conn: psycopg.Connection[Any], history_table: str) -> int:
    """Expired rows no acquire removed: more than a batch means the sweep fell behind (it must not)."""
    query = sql.SQL("SELECT count(*) FROM {history} WHERE keep_until < now()").format(
        history=Names(history_table).history
    )
    row = conn.execute(query).fetchone()
    return 0 if row is None else int(row[0])
