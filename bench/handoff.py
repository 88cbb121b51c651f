"""Hand-off latency: from the holder's release to the blocked waiter's acquire returning.

Two worker processes share one lock and swap roles at each hand-off. The
parent tells the waiter to acquire, waits `SETTLE` seconds so that it is
surely blocked (its attempt failed and it listens for the release), then
tells the holder to release. The holder notes `time.monotonic()` just before
calling release; the waiter notes it just after its acquire returned; every
process of the machine shares that clock. Only the waiter ever tries to
acquire, so no hand-off is lost to the releaser taking the lock back: the p99
is not censored.

Two pairs take turns, in blocks of `BLOCK` hand-offs: Mutexes
(``acquire(blocking=True)``, woken by the library's listener), and the
baseline, plain psycopg sending the library's own statements as the library
sends them, with a LISTEN connection of its own and ``conn.notifies()``
(`RawWaiter`): what a hand-off costs with the same SQL and nothing else.
A third pair hands a `Semaphore` of one permit back and forth: the same
hand-off through a permit row; a fourth, a fair Mutex (``fair=True``), whose
release hands the row to the waiter. `bench.rwlocks` runs a pair of its own, an
`RWLock`'s writer and reader, whose hand-offs alternate: writer to reader,
reader to writer (`pairs`, with each worker's ``mode``).
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from postgres_mutex import Mutex, RWLock, Semaphore

from .processes import Worker, workers
from .statements import library_statements, params
from .timing import median, percentile

if TYPE_CHECKING:
    from collections.abc import Callable

    from .channel import Channel

SETTLE = 0.02
"""How long the waiter waits in acquire before the holder releases (seconds)."""

BLOCK = 25
"""Hand-offs in a row for one pair before the other pair's turn."""

LOCKS = {
    "mutex": "bench-handoff",
    "fair": "bench-handoff-fair",
    "raw": "bench-handoff-raw",
    "semaphore": "bench-handoff-semaphore",
    "rwlock": "bench-handoff-rwlock",
}


class Pair:
    """Two workers handing one lock back and forth; each hand-off is labelled with the releasing worker's label."""

    def __init__(self, first: Worker, second: Worker, labels: tuple[str, str] = ("", "")) -> None:
        first.send(cmd="acquire")
        first.receive(10)  # waiting
        first.receive(10)  # acquired
        self.holder, self.waiter = first, second
        self._labels = {first.pid: labels[0], second.pid: labels[1]}
        self.latencies: list[float] = []
        self.release_calls: list[float] = []
        self.released_by: list[str] = []

    def hand_off(self) -> None:
        self.released_by.append(self._labels[self.holder.pid])
        self.waiter.send(cmd="acquire")
        self.waiter.receive(10)  # waiting
        time.sleep(SETTLE)
        self.holder.send(cmd="release")
        released = self.holder.receive(10)
        acquired = self.waiter.receive(10)
        self.latencies.append(float(acquired["acquired"]) - float(released["released"]))
        self.release_calls.append(float(released["done"]) - float(released["released"]))
        self.holder, self.waiter = self.waiter, self.holder

    def finish(self) -> None:
        self.holder.send(cmd="release")
        self.holder.receive(10)

    def figures(self, released_by: str | None = None) -> dict[str, Any]:
        """The hand-offs' figures; with ``released_by``, of those released by the worker of that label only."""
        chosen = [n for n, label in enumerate(self.released_by) if released_by in (None, label)]
        latencies = [self.latencies[n] for n in chosen]
        release_calls = [self.release_calls[n] for n in chosen]
        return {
            "handoffs": len(latencies),
            "p50_ms": round(median(latencies) * 1e3, 3),
            "p99_ms": round(percentile(latencies, 0.99) * 1e3, 3),
            "max_ms": round(max(latencies) * 1e3, 3),
            "release_call_p50_ms": round(median(release_calls) * 1e3, 3),
            # A waiter that returned before the holder began its release: two holders at once.
            "acquired_before_release": sum(1 for value in latencies if value < 0),
        }


def pairs(
    dsn: str,
    table: str,
    workers_of: dict[str, tuple[dict[str, Any], dict[str, Any]]],
    handoffs: int,
    max_seconds: float,
) -> dict[str, Pair]:
    """A pair per name, of two workers with those configs (a ``flavour`` each, a ``mode`` for an RWLock's),
    taking turns in blocks of `BLOCK` until each made ``handoffs`` hand-offs or ``max_seconds`` passed."""
    configs = [{"dsn": dsn, "table": table, **config} for two in workers_of.values() for config in two]
    with workers("handoff", configs) as started:
        made = {
            name: Pair(started[2 * n], started[2 * n + 1], (str(two[0].get("mode", "")), str(two[1].get("mode", ""))))
            for n, (name, two) in enumerate(workers_of.items())
        }
        deadline = time.monotonic() + max_seconds
        while min(len(pair.latencies) for pair in made.values()) < handoffs and time.monotonic() < deadline:
            for pair in made.values():
                for _ in range(min(BLOCK, handoffs - len(pair.latencies))):
                    pair.hand_off()
        for pair in made.values():
            pair.finish()
    return made


def run(dsn: str, table: str, handoffs: int, *, max_seconds: float) -> dict[str, Any]:
    flavours = ("mutex", "raw", "semaphore", "fair")
    made = pairs(dsn, table, {f: ({"flavour": f}, {"flavour": f}) for f in flavours}, handoffs, max_seconds)
    mutex, raw = made["mutex"].figures(), made["raw"].figures()
    semaphore, fair = made["semaphore"].figures(), made["fair"].figures()
    for figures in (semaphore, fair):
        figures["p50_to_raw"] = round(figures["p50_ms"] / raw["p50_ms"], 3)
        figures["p99_to_raw"] = round(figures["p99_ms"] / raw["p99_ms"], 3)
    return {
        "settle_s": SETTLE,
        **mutex,
        "raw": raw,
        "semaphore": semaphore,
        "fair": fair,
        "p50_to_raw": round(mutex["p50_ms"] / raw["p50_ms"], 3),
        "p99_to_raw": round(mutex["p99_ms"] / raw["p99_ms"], 3),
    }


def work(config: dict[str, Any], channel: Channel) -> None:
    waiter: _MutexWaiter | RawWaiter
    if config["flavour"] in ("mutex", "fair", "semaphore", "rwlock"):
        waiter = _MutexWaiter(config["dsn"], config["table"], config["flavour"], config.get("mode"))
    else:
        waiter = RawWaiter(config["dsn"], config["table"])
    channel.send(ready=True)
    try:
        while True:
            command = channel.receive()["cmd"]
            if command == "acquire":
                channel.send(waiting=time.monotonic())
                waiter.acquire()
                channel.send(acquired=time.monotonic())
            elif command == "release":
                released = time.monotonic()
                waiter.release()
                channel.send(released=released, done=time.monotonic())
    finally:
        waiter.close()


class _MutexWaiter:
    def __init__(self, dsn: str, table: str, flavour: str, mode: str | None) -> None:
        self._mutex: Mutex | Semaphore | RWLock
        self._acquire: Callable[..., contextlib.AbstractContextManager[bool]]
        if flavour == "semaphore":
            self._mutex = Semaphore(dsn, LOCKS["semaphore"], permits=1, table=table)
            self._acquire = self._mutex.acquire
        elif flavour == "rwlock":
            self._mutex = RWLock(dsn, LOCKS["rwlock"], table=table)
            self._acquire = self._mutex.read if mode == "read" else self._mutex.write
        else:
            self._mutex = Mutex(dsn, LOCKS[flavour], table=table, fair=flavour == "fair")
            self._acquire = self._mutex.acquire
        self._holding = contextlib.ExitStack()

    def acquire(self) -> None:
        self._holding.enter_context(self._acquire(blocking=True, timeout=30))

    def release(self) -> None:
        self._holding.close()

    def close(self) -> None:
        self._holding.close()
        self._mutex.close()


class RawWaiter:
    """The library's statements as it sends them on a direct connection (prepared), on plain psycopg,
    woken by a LISTEN of its own.

    The LISTEN is issued once, at the start, on a second connection; a
    notification of this process's own earlier release may wake it once for
    nothing, before the settle period ends.
    """

    def __init__(self, dsn: str, table: str) -> None:
        self._texts = library_statements(table, LOCKS["raw"])
        self._params = params(self._texts, LOCKS["raw"], f"bench-raw-{os.getpid()}", prefixed=False)
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._listener = psycopg.connect(dsn, autocommit=True)
        self._listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._texts.channel)))
        self._acquired_at: datetime | None = None

    def acquire(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            row = self._conn.execute(self._texts.acquire, self._params, prepare=True).fetchone()
            if row is not None and row[0]:
                self._acquired_at = row[3]
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the raw waiter did not get the lock within 30 s")
            for _ in self._listener.notifies(timeout=min(left, 0.5), stop_after=1):
                pass

    def release(self) -> None:
        assert self._acquired_at is not None
        bound = {**self._params, "acquired_at": self._acquired_at}
        row = self._conn.execute(self._texts.release, bound, prepare=True).fetchone()
        if row is None:
            raise RuntimeError("the raw release deleted nothing")
        self._acquired_at = None

    def close(self) -> None:
        self._conn.close()
        self._listener.close()
