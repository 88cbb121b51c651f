"""The sync cycle through PgBouncer in transaction mode, next to the same cycle direct.

Debian's PgBouncer (see `bench.servers.pgbouncer`) stands in front of the
same server. On one connection each, interleaved: ``SELECT 1``, the library's
statements as it sends them through a pooler (`bench.statements.RawCycle`,
prefixed, ``prepare_threshold=None``: a statement prepared on one server
connection would be missing on the next one PgBouncer picks), and ``with
mutex.acquire()`` in dsn mode, direct and through PgBouncer: the library
finds the pooler by itself and prepares nothing through it, while on the
direct route it prepares its statements.
"""

from __future__ import annotations

from typing import Any

import psycopg

from postgres_mutex import Mutex

from .latency import APPLICATION_NAME, Sizes
from .statements import RawCycle
from .timing import Measure, Timed, interleave

POOL_SIZE = 4


def run(dsn: str, through: str, table: str, sizes: Sizes) -> dict[str, dict[str, Timed]]:
    """{"direct": {...}, "pgbouncer": {...}}, each with ``select_1``, ``raw_prefixed``, ``mutex_sync``."""
    conns: list[psycopg.Connection[Any]] = []
    mutexes: list[Mutex] = []
    measures: dict[str, list[Measure]] = {}
    try:
        for route, target in (("direct", dsn), ("pgbouncer", through)):
            conn = psycopg.connect(target, autocommit=True, application_name=APPLICATION_NAME, prepare_threshold=None)
            conns.append(conn)
            mutex = Mutex(target, f"bench-route-{route}", table=table)
            mutexes.append(mutex)
            measures[route] = [
                Measure("select_1", _select_1(conn)),
                Measure("raw_prefixed", RawCycle(conn, table, f"bench-route-raw-{route}", prefixed=True)),
                Measure("mutex_sync", _cycle(mutex)),
            ]
        interleave(
            measures["direct"] + measures["pgbouncer"],
            rounds=sizes.rounds,
            per_round=sizes.per_round,
            warmup=sizes.warmup,
        )
    finally:
        for mutex in mutexes:
            mutex.close()
            mutex.client.close()
        for conn in conns:
            conn.close()
    return {route: {measure.name: measure.timed for measure in items} for route, items in measures.items()}


def _select_1(conn: psycopg.Connection[Any]) -> Any:
    return lambda: conn.execute("SELECT 1").fetchone()


def _cycle(mutex: Mutex) -> Any:
    def cycle() -> None:
        with mutex.acquire() as acquired:
            if not acquired:
                raise RuntimeError(f"{mutex.lock_name} was not acquired")

    return cycle
