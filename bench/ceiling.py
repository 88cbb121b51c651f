"""The server's ceiling: many processes on distinct locks, acquire + release per second in total.

Each worker cycles its own lock as fast as it can over the same window, in
one of three ways: ``advisory`` (``pg_try_advisory_lock`` + unlock on its
own key), ``insert_delete`` (a plain INSERT + DELETE of its own row) and
``mutex`` (``with Mutex(dsn, own_name).acquire()``). With the clients on the
same machine as the server, this is the machine's ceiling, clients included;
each worker's CPU time over the window says how much of it was the client's.
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
    from .worker import Channel

KINDS = ("advisory", "insert_delete", "mutex")


def run(dsn: str, table: str, processes: int, seconds: float) -> dict[str, Any]:
    """Each kind in turn with the same number of processes; cycles per second and client CPU per cycle."""
    figures: dict[str, Any] = {"processes": processes, "seconds": seconds}
    for kind in KINDS:
        configs = [{"dsn": dsn, "table": table, "kind": kind, "index": index} for index in range(processes)]
        with workers("ceiling", configs) as started:
            reports = run_window(started, seconds)
        cycles = sum(int(report["cycles"]) for report in reports)
        cpu = sum(float(report["cpu"]) for report in reports)
        figures[kind] = {
            "cycles": cycles,
            "per_s": round(cycles / seconds, 1),
            "client_cpu_us_per_cycle": round(cpu / cycles * 1e6, 1) if cycles else None,
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
    _, end = channel.window()
    cycles = 0
    cpu0 = time.process_time()
    while time.monotonic() < end:
        cycle()
        cycles += 1
    cpu = time.process_time() - cpu0
    mutex.close()
    conn.close()
    channel.send(cycles=cycles, cpu=cpu)


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
