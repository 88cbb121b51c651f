"""One client, one connection: what each operation costs, from `SELECT 1` to a Mutex cycle.

Every measure runs on this process against the same server, in interleaved
rounds (`bench.timing.interleave`), and is reported as a median with its ratio
to `SELECT 1` measured in the same rounds:

- ``select_1``: ``SELECT 1`` on a plain autocommit psycopg connection;
- ``advisory``: ``pg_try_advisory_lock`` + ``pg_advisory_unlock`` (two statements);
- ``insert_delete``: a plain INSERT of a lock row + its DELETE on the bench's
  table (two statements): the floor under any lock kept as a row;
- ``raw_bare``: the library's acquire and release statements without their
  settings prefix, with psycopg's defaults (server-side binding, prepared
  after five executions): the baseline of the 1.3x target, and what the
  library sends on a direct connection (where it prepares them at once);
- ``raw_bare_unprepared``: the same, never prepared (as behind PgBouncer);
- ``raw_prefixed``: the library's exact texts (``SET LOCAL`` prefix) on a
  `psycopg.ClientCursor`, as the library sends them behind a pooler;
- ``mutex_sync``: ``with mutex.acquire() as acquired`` (non-blocking, uncontended);
- ``semaphore_sync``: ``with semaphore.acquire() as acquired`` on a semaphore
  of 3 nobody else holds: the same cycle taking a permit row;
- ``mutex_sync_reclaim``: the same with ``reclaim_disconnected_after``: its row names
  its session, in the same statements (no round trip of its own);
- ``fair_sync``: the same cycle of a fair Mutex (``fair=True``), whose acquire also
  asks whether anyone waits in line before it;
- ``insert_delete_async``, ``raw_bare_async``, ``raw_bare_unprepared_async``,
  ``raw_prefixed_async``, ``mutex_async``: the same on an
  `AsyncConnection` and ``async with mutex.acquire_async(blocking=False)``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import psycopg

from postgres_mutex import Mutex, Semaphore

from .statements import AsyncRawCycle, RawCycle, insert_delete
from .timing import Measure, Timed, interleave

APPLICATION_NAME = "postgres-mutex-bench"
ADVISORY_KEY = 7_305_511


@dataclass(frozen=True)
class Sizes:
    rounds: int
    per_round: int
    warmup: int


def run(dsn: str, table: str, sizes: Sizes) -> dict[str, Timed]:
    conn = psycopg.connect(dsn, autocommit=True, application_name=APPLICATION_NAME)
    runner = asyncio.Runner()
    sync_mutex = Mutex(dsn, "bench-cycle-sync", table=table)
    reclaim_mutex = Mutex(dsn, "bench-cycle-reclaim", table=table, reclaim_disconnected_after=30.0)
    async_mutex = Mutex(dsn, "bench-cycle-async", table=table)
    semaphore = Semaphore(dsn, "bench-cycle-semaphore", permits=3, table=table)
    fair_mutex = Mutex(dsn, "bench-cycle-fair", table=table, fair=True)
    try:
        aconn = runner.run(psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name=APPLICATION_NAME))
        measures = [
            Measure("select_1", lambda: conn.execute("SELECT 1").fetchone()),
            Measure("advisory", _advisory(conn)),
            Measure("insert_delete", _insert_delete(conn, table)),
            Measure("raw_bare", RawCycle(conn, table, "bench-raw-bare", prefixed=False)),
            Measure(
                "raw_bare_unprepared", RawCycle(conn, table, "bench-raw-unprepared", prefixed=False, prepare=False)
            ),
            Measure("raw_prefixed", RawCycle(conn, table, "bench-raw-prefixed", prefixed=True)),
            Measure("mutex_sync", _cycle(sync_mutex)),
            Measure("mutex_sync_reclaim", _cycle(reclaim_mutex)),
            Measure("semaphore_sync", _cycle(semaphore)),
            Measure("fair_sync", _cycle(fair_mutex)),
            Measure("insert_delete_async", aop=_ainsert_delete(aconn, table)),
            Measure("raw_bare_async", aop=AsyncRawCycle(aconn, table, "bench-araw-bare", prefixed=False)),
            Measure(
                "raw_bare_unprepared_async",
                aop=AsyncRawCycle(aconn, table, "bench-araw-unprepared", prefixed=False, prepare=False),
            ),
            Measure("raw_prefixed_async", aop=AsyncRawCycle(aconn, table, "bench-araw-prefixed", prefixed=True)),
            Measure("mutex_async", aop=_acycle(async_mutex)),
        ]
        interleave(measures, rounds=sizes.rounds, per_round=sizes.per_round, warmup=sizes.warmup, runner=runner)
        runner.run(aconn.close())
        return {measure.name: measure.timed for measure in measures}
    finally:
        sync_mutex.close()
        reclaim_mutex.close()
        semaphore.close()
        fair_mutex.close()
        runner.run(async_mutex.aclose())
        runner.run(sync_mutex.client.aclose())
        runner.close()
        conn.close()


def _advisory(conn: psycopg.Connection[Any]) -> Any:
    def cycle() -> None:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (ADVISORY_KEY,)).fetchone()
        if row is None or not row[0]:
            raise RuntimeError("pg_try_advisory_lock did not lock")
        conn.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,)).fetchone()

    return cycle


def _insert_delete(conn: psycopg.Connection[Any], table: str) -> Any:
    insert, delete = insert_delete(table)

    def cycle() -> None:
        conn.execute(insert, ("bench-insert-delete", "bench-insert-delete-instance"))
        if conn.execute(delete, ("bench-insert-delete",)).rowcount != 1:
            raise RuntimeError("the DELETE deleted nothing")

    return cycle


def _ainsert_delete(conn: psycopg.AsyncConnection[Any], table: str) -> Any:
    insert, delete = insert_delete(table)

    async def cycle() -> None:
        await conn.execute(insert, ("bench-insert-delete-async", "bench-insert-delete-instance"))
        if (await conn.execute(delete, ("bench-insert-delete-async",))).rowcount != 1:
            raise RuntimeError("the DELETE deleted nothing")

    return cycle


def _cycle(mutex: Mutex | Semaphore) -> Any:
    def cycle() -> None:
        with mutex.acquire() as acquired:
            if not acquired:
                raise RuntimeError(f"{mutex.lock_name} was not acquired")

    return cycle


def _acycle(mutex: Mutex) -> Any:
    async def cycle() -> None:
        async with mutex.acquire_async(blocking=False) as acquired:
            if not acquired:
                raise RuntimeError(f"{mutex.lock_name} was not acquired")

    return cycle
