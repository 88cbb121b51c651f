"""``postgres-mutex demo``: a fleet contends, its holder crashes, on-call is alerted, the lock comes back.

Worker processes (this module run as ``python -m postgres_mutex._cli._demo``)
take turns at one lock with short thresholds and report every event as a
JSON line; the demo kills the first holder in the middle of its job, runs a
stale-holder watcher, and prints one timeline: acquisitions, heartbeats, the
crash, the alert at the alert threshold, the reclaim at the stale threshold,
and a summary. It uses a table of its own and removes it, and without
``--dsn`` a throwaway PostgreSQL that it removes too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from .. import MetricsHook, Mutex
from ..watcher import StaleWatcher
from ._common import UsageError
from ._embedded import EmbeddedPostgres, EmbeddedPostgresError

HEARTBEAT, ALERT, STALE = 0.5, 2.0, 5.0
JOB_SECONDS = 1.5
LOCK = "nightly-report"
DEADLINE = 50.0


class DemoError(Exception):
    """The demo could not run (no server, no binaries): one line for the user."""


# -- the worker process ----------------------------------------------------------------


class _EventLine(MetricsHook):
    """Reports what happens to this worker's Mutex as JSON lines on stdout."""

    def __init__(self, worker: str) -> None:
        self._worker = worker
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.monotonic(), "worker": self._worker, "event": event, **fields})
        with self._lock:
            print(line, flush=True)

    def acquired(self, lock_name: str, *, instance_id: str, token: int | None = None) -> None:
        self.emit("acquired")

    def released(self, lock_name: str, *, instance_id: str) -> None:
        self.emit("released")

    def contended(self, lock_name: str, *, instance_id: str) -> None:
        self.emit("contended")

    def stale_reclaimed(
        self, lock_name: str, *, instance_id: str, previous_holder: str, token: int | None = None
    ) -> None:
        self.emit("reclaimed", previous_holder=previous_holder)

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        self.emit("alert", holder=holder, seconds=seconds_since_heartbeat)

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        self.emit("heartbeat", seconds=seconds)

    def lost(self, lock_name: str, *, instance_id: str, reason: str) -> None:
        self.emit("lost", reason=reason)


def worker_main(table: str, name: str) -> None:
    """Take turns at the lock, forever; SIGTERM leaves cleanly (the lock is released)."""

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)
    hook = _EventLine(name)
    mutex = Mutex(
        os.environ["POSTGRES_MUTEX_DSN"],
        LOCK,
        table=table,
        instance_id=name,
        heartbeat_interval=HEARTBEAT,
        alert_threshold=ALERT,
        stale_threshold=STALE,
        poll_interval=0.2,
        metrics=hook,
    )
    hook.emit("ready")
    while True:
        with mutex.acquire(blocking=True, timeout=120):
            hook.emit("job")
            time.sleep(JOB_SECONDS)
        time.sleep(0.2)


# -- the demo ---------------------------------------------------------------------


@dataclass
class _Timeline:
    out: TextIO
    started: float = field(default_factory=time.monotonic)
    counts: Counter[str] = field(default_factory=Counter)

    def line(self, at: float, who: str, text: str) -> None:
        print(f"{max(0.0, at - self.started):7.2f}s  {who:<9} {text}", file=self.out, flush=True)


class _WatcherEvents(MetricsHook):
    def __init__(self, events: queue.Queue[dict[str, Any]]) -> None:
        self._events = events

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        self._events.put(
            {
                "t": time.monotonic(),
                "worker": "watcher",
                "event": "alert",
                "holder": holder,
                "seconds": seconds_since_heartbeat,
            }
        )


def run_demo(*, dsn: str | None, workers: int, out: TextIO | None = None) -> int:
    """Run the demo; returns 0 when the whole story (crash, alert, reclaim) was seen."""

    stream = out or sys.stdout
    timeline = _Timeline(stream)
    # SIGTERM or SIGHUP unwinds like Ctrl-C: the server, the workers and the table go too.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _leave)
    table = f"postgres_mutex_demo_{secrets.token_hex(4)}"
    print(
        f"postgres-mutex demo: {workers} workers take turns at lock {LOCK!r} "
        f"(heartbeat {HEARTBEAT:g}s, alert after {ALERT:g}s, reclaim after {STALE:g}s of silence)",
        file=stream,
    )
    with contextlib.ExitStack() as stack:
        if dsn is None:
            try:
                server = EmbeddedPostgres()
                stack.enter_context(server)
            except EmbeddedPostgresError as exc:
                raise DemoError(f"{exc} (or run the demo on your own server with --dsn)") from None
            dsn = server.dsn
            timeline.line(
                time.monotonic(),
                "demo",
                f"started a throwaway PostgreSQL {server.version()} on {server.host}:{server.port}",
            )
        setup = Mutex(dsn, LOCK, table=table)
        setup.create_schema()
        stack.callback(_drop_table, dsn, setup, table)
        events: queue.Queue[dict[str, Any]] = queue.Queue()
        procs = stack.enter_context(_workers(dsn, table, workers, events))
        watcher = StaleWatcher(
            dsn,
            table=table,
            alert_threshold=ALERT,
            stale_threshold=STALE,
            interval=0.25,
            metrics=_WatcherEvents(events),
        )
        watcher.start()
        stack.callback(watcher.close)
        return _tell_the_story(timeline, events, procs)


def _leave(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _drop_table(dsn: str, setup: Any, table: str) -> None:
    import psycopg
    from psycopg import sql

    setup.close()
    with contextlib.suppress(Exception), psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        # The demo's table is a plain name of its own; its token sequence goes with it.
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))


@contextlib.contextmanager
def _workers(
    dsn: str, table: str, count: int, events: queue.Queue[dict[str, Any]]
) -> Iterator[dict[str, subprocess.Popen[str]]]:
    # The DSN travels in the environment, not the command line other users can read in ps.
    env = {**os.environ, "POSTGRES_MUTEX_DSN": dsn}
    procs = {
        f"worker-{n}": subprocess.Popen(
            [sys.executable, "-m", "postgres_mutex._cli._demo", table, f"worker-{n}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for n in range(1, count + 1)
    }
    for proc in procs.values():
        threading.Thread(target=_read_events, args=(proc, events), daemon=True).start()
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _read_events(proc: subprocess.Popen[str], events: queue.Queue[dict[str, Any]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        with contextlib.suppress(ValueError):
            events.put(json.loads(line))


def _tell_the_story(
    timeline: _Timeline, events: queue.Queue[dict[str, Any]], procs: dict[str, subprocess.Popen[str]]
) -> int:
    """Print events as they come; kill the first holder mid-job; stop once the lock has moved on after the reclaim."""
    counts = timeline.counts
    deadline = time.monotonic() + DEADLINE
    job_started: dict[str, float] = {}
    victim = holder = None
    crashed_at = alerted_at = reclaimed_at = None
    waiting: set[str] = set()
    released_at: float | None = None
    handed_off = False
    while time.monotonic() < deadline and not handed_off:
        with contextlib.suppress(queue.Empty):
            event = events.get(timeout=0.05)
            who, kind, at = str(event["worker"]), str(event["event"]), float(event["t"])
            counts[kind] += 1
            if kind == "acquired":
                holder = who
                waiting.discard(who)
            elif kind == "job":
                job_started[who] = at
                victim = victim or who
                if released_at is not None and reclaimed_at is not None:
                    handed_off = True
                    wait = f" {(at - released_at) * 1000:.0f} ms after the release: waiters are woken at once"
                else:
                    wait = ""
                timeline.line(at, who, f"acquired {LOCK!r} and started its job{wait}")
            elif kind == "heartbeat" and who == holder:
                timeline.line(at, who, f"heartbeat ({float(event['seconds']) * 1000:.1f} ms)")
            elif kind == "released":
                released_at = at
                holder = None
                waiting.clear()
                timeline.line(at, who, f"finished its job and released {LOCK!r}")
            elif kind == "contended" and who not in waiting and who != holder:
                waiting.add(who)
                timeline.line(at, who, f"waits: {LOCK!r} is held by {holder or 'another worker'}")
            elif kind == "alert" and alerted_at is None and crashed_at is not None:
                alerted_at = at
                timeline.line(
                    at,
                    who,
                    f"ALERT: {event['holder']} has not heartbeated for {float(event['seconds']):.1f}s "
                    f"(alert threshold {ALERT:g}s): slow, or dead?",
                )
            elif kind == "reclaimed":
                reclaimed_at, holder = at, who
                waiting.discard(who)
                timeline.line(at, who, f"RECLAIMED {LOCK!r} from {event['previous_holder']}, silent past {STALE:g}s")
        if (
            crashed_at is None
            and victim is not None
            and holder == victim
            and time.monotonic() - job_started[victim] >= JOB_SECONDS / 2
        ):
            procs[victim].send_signal(signal.SIGKILL)
            crashed_at = time.monotonic()
            timeline.line(crashed_at, victim, "CRASHED (SIGKILL) in the middle of its job, still holding the lock")
    _summary(timeline, crashed_at, alerted_at, reclaimed_at)
    return 0 if None not in (crashed_at, alerted_at, reclaimed_at) else 1


def _summary(timeline: _Timeline, crashed: float | None, alerted: float | None, reclaimed: float | None) -> None:
    out, counts = timeline.out, timeline.counts
    print("", file=out)
    print("summary", file=out)
    print(
        f"  acquisitions {counts['acquired']}, releases {counts['released']}, heartbeats {counts['heartbeat']}, "
        f"contended attempts {counts['contended']}, stale reclaims {counts['reclaimed']}",
        file=out,
    )
    print(
        f"  alerts {counts['alert']}: the watcher and each waiting worker alert once per silent episode",
        file=out,
    )
    since = "counted from the last heartbeat, just before the crash"
    if crashed is not None and alerted is not None:
        print(f"  crash -> alert:   {alerted - crashed:.2f}s (alert threshold {ALERT:g}s, {since})", file=out)
    if crashed is not None and reclaimed is not None:
        print(f"  crash -> reclaim: {reclaimed - crashed:.2f}s (stale threshold {STALE:g}s, {since})", file=out)
    if None in (crashed, alerted, reclaimed):
        print("  the demo did not see the whole story in time", file=out)


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        return run_demo(dsn=args.dsn, workers=args.workers)
    except DemoError as exc:
        raise UsageError(str(exc)) from None


if __name__ == "__main__":
    worker_main(*sys.argv[1:3])
