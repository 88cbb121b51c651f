"""The server's ceiling: many processes on distinct locks, acquire + release per second in total.

Each worker cycles its own lock as fast as it can over the same windows, in
one of three ways: ``advisory`` (``pg_try_advisory_lock`` + unlock on its
own key), ``insert_delete`` (a plain INSERT + DELETE of its own row) and
``mutex`` (``with Mutex(dsn, own_name).acquire()``). With the clients on the
same machine as the server, this is the machine's ceiling, clients included;
each worker's CPU time over the windows says how much of it was the client's.
The three kinds take turns in short slices (`run`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg

from postgres_mutex import Mutex

from .processes import run_window, workers
from .statements import insert_delete

if TYPE_CHECKING:
    from .channel import Channel

KINDS = ("advisory", "insert_delete", "mutex")


def run(dsn: str, table: str, processes: int, seconds: float, *, slices: int) -> dict[str, Any]:
    """Each kind with the same number of processes, in turns of ``seconds / slices``; cycles/s and CPU per cycle.

    Every kind's workers are started first; then the kinds take turns, a
    slice each, ``slices`` times, so that whatever else loads the machine
    falls on all three alike.
    """
    figures: dict[str, Any] = {"processes": processes, "seconds": seconds, "slices": slices}
    configs = [
        {"dsn": dsn, "table": table, "kind": kind, "index": index} for kind in KINDS for index in range(processes)
    ]
    cycles_of = dict.fromkeys(KINDS, 0)
    cpu_of = dict.fromkeys(KINDS, 0.0)
    rates_of: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with workers("ceiling", configs) as started:
        by_kind = {kind: started[number * processes : (number + 1) * processes] for number, kind in enumerate(KINDS)}
        for turn in range(slices):
            for kind in KINDS[turn % len(KINDS) :] + KINDS[: turn % len(KINDS)]:
                reports = run_window(by_kind[kind], seconds / slices)
                cycles = sum(int(report["cycles"]) for report in reports)
                cycles_of[kind] += cycles
                cpu_of[kind] += sum(float(report["cpu"]) for report in reports)
                rates_of[kind].append(round(cycles / (seconds / slices), 1))
    for kind in KINDS:
        cycles = cycles_of[kind]
        figures[kind] = {
            "cycles": cycles,
            "per_s": round(cycles / seconds, 1),
            "client_cpu_us_per_cycle": round(cpu_of[kind] / cycles * 1e6, 1) if cycles else None,
            "per_s_by_slice": rates_of[kind],
        }
    advisory = figures["advisory"]["per_s"]
    figures["mutex_to_advisory"] = round(figures["mutex"]["per_s"] / advisory, 3) if advisory else None
    return figures


def work(config: dict[str, Any], channel: Channel) -> None:
    kind, index, table = config["kind"], int(config["index"]), config["table"]
    conn = psycopg.connect(config["dsn"], autocommit=True, application_name="postgres-mutex-bench")
    mutex = Mutex(config["dsn"], f"bench-ceiling-{index}", table=table)
    cycle = _cycle(kind, conn, mutex, index, table)
    for _ in range(50):
        cycle()
    channel.send(ready=True)
    try:
        while True:  # one window per turn, until the parent says quit
            _, end = channel.window()
            cycles = 0
            cpu0 = time.process_time()
            while time.monotonic() < end:
                cycle()
                cycles += 1
            channel.send(cycles=cycles, cpu=time.process_time() - cpu0)
    finally:
        mutex.close()
        conn.close()


def _cycle(kind: str, conn: psycopg.Connection[Any], mutex: Mutex, index: int, table: str) -> Callable[[], None]:
    if kind == "advisory":
        key = 7_305_600 + index

        def advisory() -> None:
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
            if row is None or not row[0]:
                raise RuntimeError("pg_try_advisory_lock did not lock")
            conn.execute("SELECT pg_advisory_unlock(%s)", (key,)).fetchone()

        return advisory
    if kind == "insert_delete":
        insert, delete = insert_delete(table)
        name = f"bench-ceiling-row-{index}"

        def insert_and_delete() -> None:
            conn.execute(insert, (name, name))
            conn.execute(delete, (name,))

        return insert_and_delete
    assert kind == "mutex", kind

    def mutex_cycle() -> None:
        with mutex.acquire() as acquired:
            if not acquired:
                raise RuntimeError(f"{mutex.lock_name} was not acquired")

    return mutex_cycle
