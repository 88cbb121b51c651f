"""Many waiters on one lock: what a release costs, and how fast the lock changes hands, as waiters grow.

For W waiters, W + 1 participants take one lock in turn, so that at every
release W of them are blocked in ``acquire(blocking=True)``: W = 1 is the
hand-off section's pair. Each participant is a thread with a `Mutex` of its
own (``Mutex(dsn, name, heartbeat_interval=HEARTBEAT, metrics=...)``, the
default ``poll_interval``), in worker processes of `layout`: one participant
per process up to `MAX_PROCESSES` processes, then several threads in each
(threads of one process share its client: one connection, one listener). A
NOTIFY reaches every process's listener, so spreading the waiters over
processes is what shows how many of them one release wakes.

Each participant loops: acquire (blocking), hold `HOLD`, release, rest
`REST`, and again, until the window ends or it made its share of cycles.
The rest is shorter than a hold, so a releaser is back among the waiters
before the next release, and longer than a usual hand-off, so it seldom takes
the lock back before a woken waiter gets it (when it does, that change of
hands is counted, ``taken_back``, but is no hand-off to a waiter and is left
out of the latencies).

Measured over the window after a warm-up (connections and listeners opened):

- hand-off latency: from ``time.monotonic()`` just before a holder calls
  release to just after the next holder's acquire returned (every process of
  the machine shares that clock);
- statements per hand-off: every round trip that a `CountingProxy` in front of
  the server saw answered in the window, on every connection of every worker
  (lock connections, listeners, heartbeats), divided by the changes of hands
  in the window. A change of hands costs at least two (the winning acquire
  and the release); the rest is split into
- attempts that found the lock held, counted exactly in each participant by
  its metrics hook's ``contended`` (one call per such attempt): the woken
  waiters that lost, the polls (every waiter tries every ``poll_interval``:
  what a user pays too), and a releaser's first attempt after its rest;
- heartbeats (the hook's ``heartbeat_latency``, one per lock renewed; few with
  `HEARTBEAT` long against a hold), and what is left: the listeners' own
  statements.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from postgres_mutex import LockAcquisitionTimeout, Mutex

from .processes import run_window, workers
from .proxy import CountingProxy
from .timing import median, percentile

if TYPE_CHECKING:
    from .channel import Channel

LOCK = "bench-waiters"

HOLD = 0.01
"""How long each participant holds the lock (seconds)."""

REST = 0.005
"""How long a participant waits after its release before it acquires again (seconds): less than `HOLD`."""

HEARTBEAT = 1.0
"""Each Mutex's heartbeat interval (seconds): a hold lasts `HOLD`, so few are renewed at all."""

MAX_PROCESSES = 20
"""At most this many worker processes (the machine has two cores); more participants share them as threads."""


def layout(waiters: int) -> list[int]:
    """Threads per worker process for ``waiters`` waiters (``waiters + 1`` participants), as evenly as may be."""
    participants = waiters + 1
    processes = min(participants, MAX_PROCESSES)
    return [participants // processes + (n < participants % processes) for n in range(processes)]


def run(dsn: str, table: str, waiters: int, *, seconds: float, warmup: float) -> dict[str, Any]:
    """The figures of ``waiters`` waiters over a window of ``seconds`` after ``warmup`` seconds."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "127.0.0.1")
    port = int(str(params.get("port") or 5432))
    threads = layout(waiters)
    # A count bound besides the time, generous so as never to cut the window short: twice the cycles the
    # whole window holds at full speed, shared by the processes rather than by the participants.
    cycles = int((warmup + seconds) / (HOLD + REST) * 2 / len(threads)) + 10
    with CountingProxy(host, port) as proxy:
        through = make_conninfo(dsn, host="127.0.0.1", port=proxy.port, sslmode="disable", gssencmode="disable")
        configs = [{"dsn": through, "table": table, "threads": n, "cycles": cycles} for n in threads]
        with workers("waiters", configs) as started:
            reports = run_window(started, warmup + seconds)
        start = min(float(report["start"]) for report in reports)
        since, until = start + warmup, start + warmup + seconds
        statements = len(proxy.round_trips(since, until))
    sections = sorted(
        (float(acquired), float(released), f"{n}.{who}")
        for n, report in enumerate(reports)
        for acquired, released, who in report["sections"]
    )
    latencies: list[float] = []
    taken_back = 0
    for (_, released, before), (acquired, _, after) in itertools.pairwise(sections):
        if not since <= acquired < until or released < since:
            continue
        if after == before:
            taken_back += 1
        else:
            latencies.append(acquired - released)
    changes = len(latencies) + taken_back
    contended = sum(1 for report in reports for at in report["contended"] if since <= at < until)
    heartbeats = sum(1 for report in reports for at in report["heartbeats"] if since <= at < until)
    per = (lambda count: round(count / changes, 2)) if changes else (lambda count: None)
    return {
        "waiters": waiters,
        "processes": len(threads),
        "threads": threads,
        "window_s": seconds,
        "handoffs": len(latencies),
        "taken_back": taken_back,
        "statements": statements,
        "statements_per_handoff": per(statements),
        "contended_per_handoff": per(contended),
        "heartbeats": heartbeats,
        # The winning acquire and the release of each change of hands, the attempts that found the lock held,
        # the heartbeats: what is left is the listeners' own.
        "other_per_handoff": per(statements - 2 * changes - contended - heartbeats),
        "p50_ms": round(median(latencies) * 1e3, 3) if latencies else None,
        "p99_ms": round(percentile(latencies, 0.99) * 1e3, 3) if latencies else None,
        "max_ms": round(max(latencies) * 1e3, 3) if latencies else None,
        # A holder that acquired before the previous one began its release: two holders at once.
        "acquired_before_release": sum(1 for value in latencies if value < 0),
    }


def run_all(dsn: str, table: str, counts: tuple[int, ...], *, seconds: float, warmup: float) -> dict[str, Any]:
    """Every count of waiters in turn; each p50 also as a ratio to the first count's (the single waiter's)."""
    runs = [run(dsn, table, waiters, seconds=seconds, warmup=warmup) for waiters in counts]
    single = runs[0]["p50_ms"]
    for figures in runs:
        figures["p50_to_single"] = round(figures["p50_ms"] / single, 3) if single and figures["p50_ms"] else None
    return {
        "hold_ms": HOLD * 1e3,
        "rest_ms": REST * 1e3,
        "heartbeat_interval_s": HEARTBEAT,
        # Left at its default: a waiter polls as well as listens, and those attempts are counted too.
        "poll_interval_s": inspect.signature(Mutex).parameters["poll_interval"].default,
        "runs": runs,
    }


class _Counts:
    """A metrics hook that notes when each attempt found the lock held, and each heartbeat."""

    def __init__(self) -> None:
        self.contended_at: list[float] = []
        self.heartbeat_at: list[float] = []

    def contended(self, lock_name: str, *, instance_id: str) -> None:
        self.contended_at.append(time.monotonic())

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        self.heartbeat_at.append(time.monotonic())


def work(config: dict[str, Any], channel: Channel) -> None:
    counts = _Counts()
    mutexes = [
        Mutex(config["dsn"], LOCK, table=config["table"], heartbeat_interval=HEARTBEAT, metrics=counts)
        for _ in range(int(config["threads"]))
    ]
    try:
        # A first cycle outside the window: the connection open, the table's shape known.
        with mutexes[0].acquire(blocking=True, timeout=30):
            pass
        channel.send(ready=True)
        start, end = channel.window()
        sections: list[list[tuple[float, float, int]]] = [[] for _ in mutexes]
        failures: list[BaseException] = []
        threads = [
            threading.Thread(
                target=_participate,
                args=(mutex, end, int(config["cycles"]), sections[n], n, failures),
                name=f"bench-waiter-{n}",
            )
            for n, mutex in enumerate(mutexes)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()) + 60)
        if failures:
            raise failures[0]
        if any(thread.is_alive() for thread in threads):
            raise RuntimeError("a waiter thread did not end within 60 s of the window's end")
        channel.send(
            start=start,
            sections=[section for mine in sections for section in mine],
            contended=list(counts.contended_at),
            heartbeats=list(counts.heartbeat_at),
        )
    finally:
        for mutex in mutexes:
            mutex.close()


def _participate(
    mutex: Mutex,
    end: float,
    cycles: int,
    sections: list[tuple[float, float, int]],
    who: int,
    failures: list[BaseException],
) -> None:
    """Acquire, hold, release, rest, until ``end`` or ``cycles`` cycles; a failure is kept for the worker."""
    try:
        for _ in range(cycles):
            left = end - time.monotonic()
            if left <= 0:
                return
            with contextlib.ExitStack() as holding:
                try:
                    holding.enter_context(mutex.acquire(blocking=True, timeout=left))
                except LockAcquisitionTimeout:
                    return
                acquired = time.monotonic()
                time.sleep(HOLD)
                released = time.monotonic()
            sections.append((acquired, released, who))
            time.sleep(REST)
    except BaseException as exc:
        failures.append(exc)
