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
import functools
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

from ..errors import SchemaError
from ..metrics import ExtendedMetricsHook, MetricsHook
from ..mutex import Mutex
from ..watcher import StaleWatcher
from ._common import UsageError
from ._embedded import EmbeddedPostgres, EmbeddedPostgresError

HEARTBEAT, ALERT, RECLAIM, STALE = 0.5, 1.5, 2.5, 8.0
JOB_SECONDS = 1.5
FREEZE = 5.0
"""The frozen holder's pause: past its reclaim_disconnected_after, short of the stale threshold."""
LOCK = "nightly-report"
DEADLINE = 50.0
INSUFFICIENT_PRIVILEGE = "42501"


class DemoError(Exception):
    """The demo could not run (no server, no binaries): one line for the user."""


# -- the worker process ----------------------------------------------------------------


class _EventLine(ExtendedMetricsHook):
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
        self,
        lock_name: str,
        *,
        instance_id: str,
        previous_holder: str,
        token: int | None = None,
        reason: str = "stale",
        mode: str | None = None,
    ) -> None:
        self.emit("reclaimed", previous_holder=previous_holder, reason=reason)

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float, mode: str | None = None) -> None:
        self.emit("alert", holder=holder, seconds=seconds_since_heartbeat)

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        self.emit("heartbeat", seconds=seconds)

    def lost(self, lock_name: str, *, instance_id: str, reason: str) -> None:
        self.emit("lost", reason=reason)

    def hold_confirmed(self, lock_name: str, *, instance_id: str, seconds_in_doubt: float) -> None:
        self.emit("confirmed", seconds=seconds_in_doubt)


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
        reclaim_disconnected_after=RECLAIM,
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

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float, mode: str | None = None) -> None:
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
        f"postgres-mutex demo: {workers} workers take turns at lock {LOCK!r} (heartbeat {HEARTBEAT:g}s, alert "
        f"after {ALERT:g}s, reclaim after {RECLAIM:g}s of silence if the holder's session ended, else {STALE:g}s)",
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
        try:
            setup.create_schema()
        except SchemaError as exc:
            if exc.sqlstate != INSUFFICIENT_PRIVILEGE:
                raise
            raise DemoError(
                f"the demo creates a table of its own ({table}) and removes it, and this role may not create one: "
                "run it as a role that may create tables there, or without --dsn (it then starts a throwaway "
                "PostgreSQL)"
            ) from None
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
        # The demo's table is a plain name of its own; its token sequence goes with it, and the tables of
        # its semaphores, read/write locks' gates, fair locks' queue and leases; its functions do not.
        tables = [table, f"{table}_semaphores", f"{table}_rwlocks", f"{table}_queue", f"{table}_leases"]
        functions = [f"{table}_acquire", f"{table}_wake"]
        conn.execute(
            sql.SQL("DROP TABLE IF EXISTS {}; DROP FUNCTION IF EXISTS {}").format(
                sql.SQL(", ").join(map(sql.Identifier, tables)), sql.SQL(", ").join(map(sql.Identifier, functions))
            )
        )


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


class _Story:
    """The demo's two acts, told as events come: a holder killed mid-job, then a holder frozen mid-job.

    The first is reclaimed once its session is gone (``reclaim_disconnected_after``); the second keeps
    its session, is alerted on, is not reclaimed, and holds again when it resumes.
    """

    def __init__(self, timeline: _Timeline, procs: dict[str, subprocess.Popen[str]]) -> None:
        self.timeline, self.procs = timeline, procs
        self.job_started: dict[str, float] = {}
        self.holder: str | None = None
        self.waiting: set[str] = set()
        self.crashed_at: float | None = None
        self.reclaimed_at: float | None = None
        self.frozen_at: float | None = None
        self.resumed_at: float | None = None
        self.confirmed_at: float | None = None
        self.alerts: dict[str, float] = {}
        self.crashed: str | None = None
        self.frozen: str | None = None
        self.done = False

    def see(self, event: dict[str, Any]) -> None:
        who, kind, at = str(event["worker"]), str(event["event"]), float(event["t"])
        self.timeline.counts[kind] += 1
        line = functools.partial(self.timeline.line, at, who)
        if kind == "acquired":
            self.holder = who
            self.waiting.discard(who)
        elif kind == "job":
            self.job_started[who] = at
            line(f"acquired {LOCK!r} and started its job")
            if self.confirmed_at is not None:
                self.done = True  # the lock moved on after the frozen holder's job
        elif kind == "heartbeat" and who == self.holder and self.frozen is None:
            line(f"heartbeat ({float(event['seconds']) * 1000:.1f} ms)")
        elif kind == "released":
            self.holder = None
            self.waiting.clear()
            if who == self.frozen and self.resumed_at is not None and self.confirmed_at is None:
                # Resumed right at the end of its job: the lock it kept is released before a heartbeat says so.
                self.confirmed_at = at
                line(f"RESUMED: its lock was still its own; finished its job and released {LOCK!r}")
            else:
                line(f"finished its job and released {LOCK!r}")
        elif kind == "contended" and who not in self.waiting and who != self.holder:
            self.waiting.add(who)
            line(f"waits: {LOCK!r} is held by {self.holder or 'another worker'}")
        elif kind == "alert" and self._act() not in self.alerts and self._act() != "":
            self.alerts[self._act()] = at
            line(
                f"ALERT: {event['holder']} has not heartbeated for {float(event['seconds']):.1f}s "
                f"(alert threshold {ALERT:g}s): slow, or dead?"
            )
        elif kind == "reclaimed":
            self.reclaimed_at, self.holder = at, who
            self.waiting.discard(who)
            why = "its database session had ended" if event.get("reason") == "disconnected" else f"silent {STALE:g}s"
            line(f"RECLAIMED {LOCK!r} from {event['previous_holder']}: {why}")
        elif kind == "confirmed" and who == self.frozen:
            self.confirmed_at = at
            line(f"RESUMED: a heartbeat confirmed its hold after {float(event['seconds']):.1f}s in doubt")

    def _act(self) -> str:
        return "freeze" if self.frozen is not None else "crash" if self.crashed is not None else ""

    def strike(self) -> None:
        """Kill the first holder half-way through its job; after the reclaim, freeze the next one."""
        holder, now = self.holder, time.monotonic()
        if holder is None or now - self.job_started.get(holder, now) < JOB_SECONDS / 2:
            return
        if self.crashed is None:
            self.crashed, self.crashed_at = holder, now
            self.procs[holder].send_signal(signal.SIGKILL)
            self.timeline.line(now, holder, "CRASHED (SIGKILL) in the middle of its job, still holding the lock")
        elif self.frozen is None and self.reclaimed_at is not None and holder != self.crashed:
            self.frozen, self.frozen_at = holder, now
            self.procs[holder].send_signal(signal.SIGSTOP)
            self.timeline.line(now, holder, f"FROZEN (SIGSTOP) in the middle of its job, for {FREEZE:g}s")
        elif (
            self.frozen is not None
            and self.frozen_at is not None
            and self.resumed_at is None
            and (now - self.frozen_at >= FREEZE)
        ):
            self.resumed_at = now
            self.procs[self.frozen].send_signal(signal.SIGCONT)

    @property
    def whole(self) -> bool:
        seen = (self.crashed_at, self.reclaimed_at, self.frozen_at, self.alerts.get("freeze"), self.confirmed_at)
        return None not in seen


def _tell_the_story(
    timeline: _Timeline, events: queue.Queue[dict[str, Any]], procs: dict[str, subprocess.Popen[str]]
) -> int:
    """Print events as they come, strike on cue, stop once the lock has moved on after the frozen holder."""
    story = _Story(timeline, procs)
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline and not story.done:
        with contextlib.suppress(queue.Empty):
            story.see(events.get(timeout=0.05))
        story.strike()
    _summary(story)
    return 0 if story.whole else 1


def _summary(story: _Story) -> None:
    out, counts = story.timeline.out, story.timeline.counts
    print("", file=out)
    print("summary", file=out)
    print(
        f"  acquisitions {counts['acquired']}, releases {counts['released']}, heartbeats {counts['heartbeat']}, "
        f"contended attempts {counts['contended']}, reclaims {counts['reclaimed']}",
        file=out,
    )
    print(
        f"  alerts {len(story.alerts)}, one per silent holder as the timeline shows them ({counts['alert']} alert "
        "calls in all: the watcher and each waiting worker alert once per silent episode)",
        file=out,
    )
    if story.crashed_at is not None and story.reclaimed_at is not None:
        print(
            f"  crash -> reclaim: {story.reclaimed_at - story.crashed_at:.2f}s: its session ended with it "
            f"(reclaim_disconnected_after {RECLAIM:g}s; stale_threshold {STALE:g}s)",
            file=out,
        )
    if story.frozen_at is not None and story.confirmed_at is not None:
        alerted = story.alerts.get("freeze")
        after = "" if alerted is None else f"alerted after {alerted - story.frozen_at:.2f}s, "
        print(
            f"  freeze -> resumed: {after}not reclaimed: a frozen process keeps its session "
            f"(its lock still its own {story.confirmed_at - story.frozen_at:.2f}s after the freeze)",
            file=out,
        )
    if not story.whole:
        print("  the demo did not see the whole story in time", file=out)


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        return run_demo(dsn=args.dsn, workers=args.workers)
    except DemoError as exc:
        raise UsageError(str(exc)) from None


if __name__ == "__main__":
    worker_main(*sys.argv[1:3])
