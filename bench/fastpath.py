"""What the library's own Python costs on an uncontended cycle: frames, calls, CPU and wall time against its floor.

``python -m bench.fastpath`` (``--dsn`` for a server of your own, else a
throwaway one). One process, one lock nobody else takes:

- ``frames at psycopg entry``: how many of the library's frames are on the
  stack each time a sync cycle enters psycopg's ``Cursor.execute`` (the most
  seen), counted with `sys.setprofile`;
- ``calls per cycle``: Python-level calls (the profiler's ``call`` events, the
  library's, psycopg's and the standard library's alike) in one
  ``with mutex.acquire():`` cycle, and in the two raw statements it sends
  (``raw``: the library's prepared acquire and release on a plain cursor);
- ``sync CPU / floor``: the client CPU (`time.process_time`, every thread) of a
  sync cycle over that of its floor, a plain ``INSERT ... ON CONFLICT DO
  NOTHING`` + ``DELETE`` of a lock row, measured in interleaved rounds. On a
  throwaway server of its own, with two CPUs or more, the client runs on one
  CPU and the server's backends on the others (see `apart`);
- ``async wall / raw``: the median wall time of ``async with
  mutex.acquire_async(blocking=False):`` over the same two statements sent on
  an `AsyncConnection`, interleaved likewise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import postgres_mutex
from postgres_mutex import Mutex

from .report import FASTPATH_TARGETS as TARGETS
from .servers import bench_table
from .servers import server as start_server
from .statements import AsyncRawCycle, RawCycle
from .timing import Measure, interleave

LIBRARY = str(Path(postgres_mutex.__file__).resolve().parent)
PSYCOPG = str(Path(psycopg.__file__).resolve().parent)


def _library_frames(frame: types.FrameType | None) -> int:
    count = 0
    while frame is not None:
        if frame.f_code.co_filename.startswith(LIBRARY):
            count += 1
        frame = frame.f_back
    return count


def frames_at_psycopg(cycle: Callable[[], object]) -> int:
    """The most library frames on the stack when the cycle enters a psycopg cursor's ``execute``."""
    most = 0

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        nonlocal most
        if event == "call" and frame.f_code.co_name == "execute" and frame.f_code.co_filename.startswith(PSYCOPG):
            most = max(most, _library_frames(frame.f_back))

    sys.setprofile(profile)
    try:
        cycle()
    finally:
        sys.setprofile(None)
    return most


def calls_per_cycle(cycle: Callable[[], object], cycles: int = 20) -> float:
    """Python-level calls per cycle (on this thread), averaged over ``cycles``."""
    calls = 0

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        for _ in range(cycles):
            cycle()
    finally:
        sys.setprofile(None)
    return calls / cycles


@contextlib.contextmanager
def apart(conn: psycopg.Connection[Any], local_server: bool) -> Iterator[str]:
    """The client on one CPU and the server's backends on the others, as when the database is another
    machine; yields where each runs (after "timed with the"), or why they run where the scheduler puts them.

    Left to the scheduler on a small machine, a client's CPU per round trip depends on where the backend it
    talks to runs: twice as much when it runs on another CPU than when on the client's (measured on two
    virtual CPUs, two identical floors on two connections: 58 and 108 µs), and each connection's backend
    lands where it lands, so a ratio of two measures on two connections was a draw between those placements.
    Placed apart, every measure pays what a client of a remote database pays. Only a throwaway server of
    the bench's own is placed (a server given with ``--dsn`` may be another machine's, whose process
    numbers mean nothing here).
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if not local_server or len(cpus) < 2:
        yield "client and server left to the scheduler" + ("" if local_server else " (a server of your own)")
        return
    backends = [
        row[0] for row in conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend'")
    ]
    threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    before = {}
    try:
        for pid in threads + backends:
            with contextlib.suppress(ProcessLookupError):
                before[pid] = os.sched_getaffinity(pid)
                os.sched_setaffinity(pid, {cpus[0]} if pid in threads else set(cpus[1:]))
    except PermissionError:
        _restore(before)
        yield "client and server left to the scheduler (no permission to place the server's processes)"
        return
    try:
        yield f"client on CPU {cpus[0]} and the server's backends on CPU {', '.join(map(str, cpus[1:]))}"
    finally:
        _restore(before)


def _restore(affinities: dict[int, set[int]]) -> None:
    for pid, cpus in affinities.items():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(pid, cpus)


def _floor(conn: psycopg.Connection[Any], table: str) -> Callable[[], None]:
    ident = sql.Identifier(table)
    insert = sql.SQL(
        "INSERT INTO {} (lock_name, instance_id, last_heartbeat, acquired_at) VALUES (%s, %s, now(), now()) "
        "ON CONFLICT DO NOTHING"
    ).format(ident)
    delete = sql.SQL("DELETE FROM {} WHERE locked = 1 AND lock_name = %s").format(ident)

    def cycle() -> None:
        conn.execute(insert, ("bench-fastpath-floor", "bench-fastpath-floor-instance"), prepare=True)
        if conn.execute(delete, ("bench-fastpath-floor",), prepare=True).rowcount != 1:
            raise RuntimeError("the DELETE deleted nothing")

    return cycle


def measure(dsn: str, table: str, *, rounds: int, per_round: int, warmup: int, local_server: bool) -> dict[str, Any]:
    conn = psycopg.connect(dsn, autocommit=True)
    runner = asyncio.Runner()
    mutex = Mutex(dsn, "bench-fastpath-sync", table=table)
    amutex = Mutex(dsn, "bench-fastpath-async", table=table)

    def cycle() -> None:
        with mutex.acquire() as acquired:
            if not acquired:
                raise RuntimeError(f"{mutex.lock_name} was not acquired")

    async def acycle() -> None:
        async with amutex.acquire_async(blocking=False) as acquired:
            if not acquired:
                raise RuntimeError(f"{amutex.lock_name} was not acquired")

    try:
        aconn = runner.run(psycopg.AsyncConnection.connect(dsn, autocommit=True))
        raw = RawCycle(conn, table, "bench-fastpath-raw", prefixed=False, prepare=True)
        araw = AsyncRawCycle(aconn, table, "bench-fastpath-araw", prefixed=False, prepare=True)
        for _ in range(warmup):
            cycle()
            raw()
        # Every connection open before the measures are placed (`apart`).
        runner.run(acycle())
        runner.run(araw())
        frames = frames_at_psycopg(cycle)
        calls = calls_per_cycle(cycle)
        raw_calls = calls_per_cycle(raw)
        measures = [
            Measure("floor", _floor(conn, table)),
            Measure("mutex_sync", cycle),
            Measure("raw_async", aop=araw),
            Measure("mutex_async", aop=acycle),
        ]
        with apart(conn, local_server) as placement:
            interleave(measures, rounds=rounds, per_round=per_round, warmup=warmup, runner=runner)
        runner.run(aconn.close())
        timed = {m.name: m.timed for m in measures}
    finally:
        mutex.close()
        runner.run(amutex.aclose())
        runner.run(mutex.client.aclose())
        runner.close()
        conn.close()
    floor_cpu, sync_cpu = timed["floor"].cpu_per_op, timed["mutex_sync"].cpu_per_op
    raw_wall, async_wall = timed["raw_async"].median, timed["mutex_async"].median
    return {
        "frames_at_psycopg": frames,
        "calls_per_cycle": calls,
        "raw_calls_per_cycle": raw_calls,
        "floor_cpu_us": round(floor_cpu * 1e6, 1),
        "sync_cpu_us": round(sync_cpu * 1e6, 1),
        "sync_cpu_ratio": round(sync_cpu / floor_cpu, 3),
        "placement": placement,
        "raw_async_ms": round(raw_wall * 1e3, 4),
        "async_ms": round(async_wall * 1e3, 4),
        "async_wall_ratio": round(async_wall / raw_wall, 3),
    }


def render(figures: dict[str, Any]) -> str:
    rows = [
        ("library frames at psycopg entry (sync)", f"{figures['frames_at_psycopg']}", TARGETS["frames"]),
        (
            "Python calls per sync cycle",
            f"{figures['calls_per_cycle']:.0f} (raw statements: {figures['raw_calls_per_cycle']:.0f})",
            TARGETS["calls"],
        ),
        (
            "sync client CPU / floor",
            f"{figures['sync_cpu_us']} / {figures['floor_cpu_us']} µs = {figures['sync_cpu_ratio']:.2f}x",
            f"{TARGETS['sync_cpu_ratio']}x",
        ),
        (
            "async wall / raw async",
            f"{figures['async_ms']} / {figures['raw_async_ms']} ms = {figures['async_wall_ratio']:.2f}x",
            f"{TARGETS['async_wall_ratio']}x",
        ),
    ]
    width = max(len(row[0]) for row in rows)
    lines = [f"{'measure'.ljust(width)}  measured  (target at most)"]
    lines += [f"{name.ljust(width)}  {value}  ({target})" for name, value, target in rows]
    lines.append(f"(timed with the {figures['placement']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fastpath", description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="the PostgreSQL to measure on (default: a throwaway server of its own)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    with start_server(args.dsn) as target, bench_table(target.dsn) as table:
        figures = measure(
            target.dsn, table, rounds=args.rounds, per_round=args.per_round, warmup=30, local_server=target.throwaway
        )
    print(json.dumps(figures) if args.json else render(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
