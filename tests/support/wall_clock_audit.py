"""Run the library's whole life cycle while recording every wall-clock read its own code makes.

    python -m tests.support.wall_clock_audit DSN LOCK    prints {"probe": [...], "reads": [...], "steps": [...]}

The audit is installed before the library is imported, so that even a
``from time import time`` inside it would be caught:

- every function of ``time`` that reads the wall clock (``time``, ``time_ns``,
  ``clock_gettime`` / ``clock_gettime_ns`` of ``CLOCK_REALTIME`` or
  ``CLOCK_TAI``, and ``localtime``, ``gmtime``, ``ctime``, ``asctime``,
  ``strftime`` when they read "now") is replaced by a wrapper;
- the C methods of ``datetime`` that read it (``datetime.now``, ``utcnow``,
  ``today``, ``date.today``) are seen through a profile hook on every thread.

A read counts when the calling frame belongs to a ``postgres_mutex`` module.
A probe (code compiled as a ``postgres_mutex`` module, on the main thread and
on another) checks first that each kind of read is caught, so an audit that
went blind fails the test rather than passing it. Then the life cycle runs:
acquire and heartbeats, a waiter woken by the release's notification, a
watcher's alert, a frozen holder's lease running out, a reclaim at the stale
threshold, fencing, the admin API, and the async twins of acquire, heartbeat
and hand-off. tests/integration/test_wall_clock.py runs this and fails on any read.
"""

from __future__ import annotations

import datetime as _datetime
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

_LIBRARY = "postgres_mutex"
_reads: list[dict[str, object]] = []
_reads_lock = threading.Lock()


def _record(api: str, frame: FrameType | None) -> None:
    if frame is None:
        return
    module = str(frame.f_globals.get("__name__", ""))
    if module == _LIBRARY or module.startswith(_LIBRARY + "."):
        with _reads_lock:
            _reads.append({"api": api, "module": module, "function": frame.f_code.co_name, "line": frame.f_lineno})


def _wrap(name: str, reads_now: Callable[..., bool]) -> None:
    real = getattr(time, name)

    def audited(*args: Any) -> Any:
        if reads_now(*args):
            _record(f"time.{name}", sys._getframe(1))
        return real(*args)

    audited.__name__ = name
    setattr(time, name, audited)


_WALL_CLOCKS = {time.CLOCK_REALTIME, getattr(time, "CLOCK_TAI", time.CLOCK_REALTIME)}

_wrap("time", lambda: True)
_wrap("time_ns", lambda: True)
_wrap("clock_gettime", lambda clock: clock in _WALL_CLOCKS)
_wrap("clock_gettime_ns", lambda clock: clock in _WALL_CLOCKS)
for _name in ("localtime", "gmtime", "ctime"):
    _wrap(_name, lambda secs=None: secs is None)
_wrap("asctime", lambda t=None: t is None)
_wrap("strftime", lambda fmt, t=None: t is None)

_DATETIME_NOW = {"datetime": ("now", "utcnow", "today"), "date": ("today",)}


def _profile(frame: FrameType, event: str, arg: object) -> None:
    if event != "c_call":
        return
    owner = getattr(arg, "__self__", None)
    if owner is _datetime.datetime or owner is _datetime.date:
        name = getattr(arg, "__name__", "")
        if name in _DATETIME_NOW[owner.__name__]:
            _record(f"datetime.{owner.__name__}.{name}", frame)


sys.setprofile(_profile)
threading.setprofile(_profile)

# Only now the library (and anything of the suite's that imports it).
import asyncio  # noqa: E402
import json  # noqa: E402

import psycopg  # noqa: E402

from postgres_mutex import LockNotHeldError, Mutex, MutexClient  # noqa: E402
from postgres_mutex.watcher import StaleWatcher  # noqa: E402
from tests.support.timing import FAST  # noqa: E402

PROBE = """
import datetime, threading, time
def read_all():
    time.time()
    time.time_ns()
    time.clock_gettime(time.CLOCK_REALTIME)
    time.localtime()
    datetime.datetime.now()
    datetime.date.today()
read_all()
reader = threading.Thread(target=lambda: datetime.datetime.utcnow())
reader.start()
reader.join()
time.clock_gettime(time.CLOCK_MONOTONIC)  # not a wall clock: not recorded
time.localtime(0)  # a conversion, not a reading of the clock: not recorded
"""


def probe() -> list[str]:
    """Plant one read of each kind in code that claims to be the library's; return what the audit caught."""
    exec(compile(PROBE, "<probe>", "exec"), {"__name__": f"{_LIBRARY}._audit_probe"})  # noqa: S102
    with _reads_lock:
        caught = [str(read["api"]) for read in _reads]
        _reads.clear()
    return caught


def until(predicate: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"audit step never happened: {predicate}")
        threading.Event().wait(0.01)


async def async_until(predicate: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"audit step never happened: {predicate}")
        await asyncio.sleep(0.01)


class Counts:
    """A metrics hook counting its calls by name."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def __getattr__(self, name: str) -> Callable[..., None]:
        def count(*args: object, **kwargs: object) -> None:
            self.counts[name] = self.counts.get(name, 0) + 1

        return count


def life_cycle(dsn: str, lock: str, steps: list[str]) -> None:
    timing: dict[str, Any] = dict(FAST)
    waiting: dict[str, Any] = {**timing, "poll_interval": 30.0}  # only a notification wakes it in time
    counts: dict[str, int] = {}
    lost, woken, reclaimed = threading.Event(), threading.Event(), threading.Event()
    client = MutexClient(dsn)
    holder = client.mutex(lock, metrics=Counts(counts), **timing)
    waiter = client.mutex(lock, metrics=Counts(counts), on_lost=lambda error: lost.set(), **waiting)
    holder.create_schema()
    watcher = StaleWatcher(
        dsn,
        lock_names=[lock],
        alert_threshold=timing["alert_threshold"],
        stale_threshold=timing["stale_threshold"],
        interval=0.1,
        metrics=Counts(counts),
    )
    watcher.start()

    def wait() -> None:
        try:
            with waiter.acquire(blocking=True, timeout=20):
                woken.set()
                # Then it freezes: its heartbeats stop, its lease runs out, a reclaimer takes over.
                hold = waiter._lock.hold
                assert hold is not None
                hold.paused = True
                until(reclaimed.is_set)
        except LockNotHeldError:
            pass  # leaving the block after the loss says so: expected

    with holder.acquire() as acquired:
        assert acquired
        until(lambda: counts.get("heartbeat_latency", 0) >= 2)
        steps.append("heartbeats")
        thread = threading.Thread(target=wait)
        thread.start()
        until(lambda: counts.get("contended", 0) >= 2)  # it listens, and waits to be woken
    until(woken.is_set, timeout=10)
    steps.append("notified hand-off")
    until(lost.is_set)
    steps.append("lease ran out")
    until(lambda: counts.get("alert", 0) >= 1)
    steps.append("alert")
    reclaimer = client.mutex(lock, metrics=Counts(counts), **timing)
    with reclaimer.acquire(blocking=True, timeout=20) as acquired:
        assert acquired
        assert counts.get("stale_reclaimed") == 1
        reclaimed.set()
        steps.append("reclaimed")
        with psycopg.connect(dsn) as conn, conn.transaction():
            reclaimer.fence(conn)
        steps.append("fenced")
        assert client.table().holders(alert_threshold=timing["alert_threshold"], stale_threshold=60)
        steps.append("status")
    thread.join(20)
    watcher.close()
    asyncio.run(async_life_cycle(client, lock, timing, steps))
    client.close()
    steps.append("closed")


async def async_life_cycle(client: MutexClient, lock: str, timing: dict[str, Any], steps: list[str]) -> None:
    counts: dict[str, int] = {}
    holder: Mutex = client.mutex(lock, **timing)
    waiter: Mutex = client.mutex(lock, metrics=Counts(counts), **{**timing, "poll_interval": 30.0})
    async with holder.acquire_async():
        task = asyncio.create_task(_hold_briefly(waiter))
        await holder.heartbeat_async()
        await async_until(lambda: counts.get("contended", 0) >= 2)
    await asyncio.wait_for(task, 20)
    steps.append("async hand-off")
    await holder.aclose()
    await waiter.aclose()


async def _hold_briefly(mutex: Mutex) -> None:
    async with mutex.acquire_async(timeout=20):
        await mutex.heartbeat_async()


def main(dsn: str, lock: str) -> None:
    caught = probe()
    steps: list[str] = []
    life_cycle(dsn, lock, steps)
    sys.setprofile(None)
    threading.setprofile(None)
    with _reads_lock:
        reads = list(_reads)
    print(json.dumps({"probe": caught, "reads": reads, "steps": steps}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
