"""Many locks held by one process: what holding them costs while nothing else happens.

A worker process holds N locks (``Mutex(dsn, name, heartbeat_interval=1)``
each, entered and left open) and then idles for a window. It reaches the
server through a `CountingProxy`, which counts the round trips of each of its
connections. Measured:

- server connections: rows of ``pg_stat_activity`` whose ``application_name``
  names the worker's pid (the library names its connections
  ``postgres-mutex <host>:<pid>`` and ``postgres-mutex listener <host>:<pid>``),
  and the connections the proxy saw opened over the worker's whole life;
- threads: ``threading.active_count()`` inside the worker (and the OS's count);
- heartbeat statements per interval: round trips the proxy saw in the window
  (nothing else runs then), divided by the window's length in heartbeat
  intervals; with their duration and size. The library renews at most a
  few hundred holds per statement, sent one after another: the statements
  of one interval make a *round* (a statement sent within a tenth of an
  interval of the previous one's answer belongs to its round), whose duration (from
  the first statement sent to the last answered) and period (the median
  time from one round's start to the next) are measured too. Cross-check, approximate: rows updated in the
  table over the window (``pg_stat_user_tables.n_tup_upd``; the server flushes
  these counters about once a second) per lock and interval;
- idle CPU: the worker's CPU time (`time.process_time`: user + system, all threads) over the
  window's wall time, in % of one core; and, on the throwaway server, the CPU
  time of the worker's server backends (from /proc);
- memory per held lock: the worker's resident set size (RSS) after taking the
  N locks minus before (after a first lock was taken and released, so
  connections and threads already exist), divided by N;
- then, no longer idle: a Mutex cycle on one more lock, in that process and
  through the proxy, again and again for a while: its p99.9 and max say how
  long the process's other lock operations wait when they arrive during the
  heartbeat of N locks on the shared connection. The same cycles, for as
  long, in the same process before it took the N locks are their baseline:
  the tail the machine gives a cycle when nothing else is held.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from postgres_mutex import Mutex

from .processes import workers
from .proxy import CountingProxy, RoundTrip
from .timing import median, percentile

if TYPE_CHECKING:
    from .channel import Channel

HEARTBEAT = 1.0


def run(
    dsn: str,
    table: str,
    locks: int,
    *,
    window: float,
    settle: float,
    cycling: float,
    local_server: bool,
    thresholds: dict[str, float] | None = None,
) -> dict[str, Any]:
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "127.0.0.1")
    port = int(str(params.get("port") or 5432))
    with CountingProxy(host, port) as proxy, psycopg.connect(dsn, autocommit=True) as admin:
        through = make_conninfo(dsn, host="127.0.0.1", port=proxy.port, sslmode="disable", gssencmode="disable")
        config: dict[str, Any] = {"dsn": through, "table": table, "locks": locks, "heartbeat": HEARTBEAT}
        if thresholds is not None:
            config["thresholds"] = thresholds
        with workers("many-locks", [config]) as (worker,):
            # The same cycles first, holding none: what the machine's own noise makes of a p99.9.
            worker.send(cmd="cycle", seconds=cycling)
            alone = worker.receive(cycling + 30.0)
            worker.send(cmd="hold")
            held = worker.receive(60.0 + locks * 0.05)
            time.sleep(settle)
            server = backends(admin, worker.pid)
            server_cpu0 = backend_cpu([pid for pid, _ in server]) if local_server else None
            updated0 = _rows_updated(admin, table)
            worker.send(cmd="measure", seconds=window)
            measured = worker.receive(window + 30.0)
            updated1 = _rows_updated(admin, table)
            server_cpu1 = backend_cpu([pid for pid, _ in server]) if local_server else None
            worker.send(cmd="cycle", seconds=cycling)
            cycled = worker.receive(cycling + 30.0)
            worker.send(cmd="release")
            released = worker.receive(60.0 + locks * 0.05)
        start, end = float(measured["start"]), float(measured["end"])
        trips = [trip for _, trip in proxy.round_trips(start, end)]
        opened = len(proxy.connections)
    wall = end - start
    intervals = wall / HEARTBEAT
    rounds = _rounds(trips)
    server_cpu = None
    if server_cpu0 is not None and server_cpu1 is not None:
        server_cpu = round((server_cpu1 - server_cpu0) / wall * 100, 2)
    return {
        "locks": locks,
        "heartbeat_interval_s": HEARTBEAT,
        "window_s": round(wall, 3),
        "acquire_all_s": held["acquire_s"],
        "server_connections": len(server),
        "connection_names": sorted(name for _, name in server),
        "connections_opened": opened,
        "threads": measured["threads"],
        "thread_names": measured["thread_names"],
        "os_threads": measured["os_threads"],
        "heartbeat_statements": len(trips),
        "window_intervals": round(intervals, 3),
        "heartbeat_statements_per_interval": round(len(trips) / intervals, 3),
        "heartbeat_statement_ms": round(median([t.answered_at - t.sent_at for t in trips]) * 1e3, 3) if trips else None,
        "heartbeat_statement_max_ms": round(max(t.answered_at - t.sent_at for t in trips) * 1e3, 3) if trips else None,
        "heartbeat_rounds": len(rounds),
        "heartbeat_statements_per_round": round(len(trips) / len(rounds), 2) if rounds else None,
        "heartbeat_round_ms": round(median([r[-1].answered_at - r[0].sent_at for r in rounds]) * 1e3, 3)
        if rounds
        else None,
        "heartbeat_period_s": _period([r[0] for r in rounds]),
        "heartbeat_statement_bytes": int(median([float(t.bytes_sent) for t in trips])) if trips else None,
        "rows_updated_per_lock_per_interval": round((updated1 - updated0) / locks / intervals, 3),
        "idle_cpu_percent": round(float(measured["cpu"]) / wall * 100, 2),
        "server_cpu_percent": server_cpu,
        "rss_before_mib": round(held["rss_before"] / 2**20, 1),
        "rss_after_mib": round(held["rss_after"] / 2**20, 1),
        "memory_per_lock_bytes": round((held["rss_after"] - held["rss_before"]) / locks),
        "still_held": measured["held"],
        "cycles_while_holding": cycled["cycles"],
        "cycle_while_holding_p50_ms": round(median(cycled["samples"]) * 1e3, 3),
        "cycle_while_holding_p99_ms": round(percentile(cycled["samples"], 0.99) * 1e3, 3),
        "cycle_while_holding_p999_ms": round(percentile(cycled["samples"], 0.999) * 1e3, 3),
        "cycle_while_holding_max_ms": round(max(cycled["samples"]) * 1e3, 3),
        "cycles_holding_none": alone["cycles"],
        "cycle_holding_none_p50_ms": round(median(alone["samples"]) * 1e3, 3),
        "cycle_holding_none_p999_ms": round(percentile(alone["samples"], 0.999) * 1e3, 3),
        "cycle_holding_none_max_ms": round(max(alone["samples"]) * 1e3, 3),
        "release_all_s": released["release_s"],
    }


def _rounds(trips: list[RoundTrip]) -> list[list[RoundTrip]]:
    """The heartbeat statements grouped by interval: one sent within a tenth of an interval of the last one's
    answer belongs to its round (the next round begins most of an interval later)."""
    rounds: list[list[RoundTrip]] = []
    for trip in sorted(trips, key=lambda trip: trip.sent_at):
        if rounds and trip.sent_at - rounds[-1][-1].answered_at < HEARTBEAT / 10:
            rounds[-1].append(trip)
        else:
            rounds.append([trip])
    return rounds


def _period(trips: list[RoundTrip]) -> float | None:
    """The median time from one heartbeat round's first statement to the next's."""
    sent = sorted(trip.sent_at for trip in trips)
    gaps = [later - earlier for earlier, later in itertools.pairwise(sent)]
    return round(median(gaps), 3) if gaps else None


def backends(admin: psycopg.Connection[Any], pid: int) -> list[tuple[int, str]]:
    """The server backends of the worker process ``pid``: (backend pid, application_name)."""
    rows = admin.execute(
        "SELECT pid, application_name FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"postgres-mutex %:{pid}",),
    ).fetchall()
    return [(int(row[0]), str(row[1])) for row in rows]


def _rows_updated(admin: psycopg.Connection[Any], table: str) -> int:
    row = admin.execute("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relid = to_regclass(%s)", (table,)).fetchone()
    return int(row[0]) if row else 0


def backend_cpu(pids: list[int]) -> float | None:
    """CPU seconds (user + system) the server processes have used, from /proc/PID/stat."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _rss() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _os_threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def _cycle_for(seconds: float, dsn: str, table: str, heartbeat: float) -> list[float]:
    """Durations of back-to-back cycles of one more lock, for ``seconds``."""
    mutex = Mutex(dsn, "bench-many-cycling", table=table, heartbeat_interval=heartbeat)
    samples = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            started = time.perf_counter()
            with mutex.acquire() as acquired:
                if not acquired:
                    raise RuntimeError(f"{mutex.lock_name} was not acquired")
            samples.append(time.perf_counter() - started)
    finally:
        mutex.close()
    return samples


def work(config: dict[str, Any], channel: Channel) -> None:
    """Hold ``config["locks"]`` locks on command; ``config["thresholds"]`` (optional: ``alert_threshold`` and
    ``stale_threshold``) are passed to every Mutex, for a heartbeat interval the defaults would not suit."""
    dsn, table, count, heartbeat = config["dsn"], config["table"], int(config["locks"]), float(config["heartbeat"])
    thresholds: dict[str, Any] = {name: float(value) for name, value in config.get("thresholds", {}).items()}
    # A first lock taken and released: connections, threads and table shape exist before the baseline.
    first = Mutex(dsn, "bench-many-first", table=table, heartbeat_interval=heartbeat, **thresholds)
    with first.acquire() as acquired:
        assert acquired
    channel.send(ready=True)
    holding = contextlib.ExitStack()
    mutexes: list[Mutex] = []
    try:
        while True:
            command = channel.receive()
            if command["cmd"] == "hold":
                gc.collect()
                rss_before = _rss()
                started = time.monotonic()
                for index in range(count):
                    mutex = Mutex(
                        dsn, f"bench-many-{index:05d}", table=table, heartbeat_interval=heartbeat, **thresholds
                    )
                    mutexes.append(mutex)
                    if not holding.enter_context(mutex.acquire()):
                        raise RuntimeError(f"{mutex.lock_name} was not acquired")
                acquire_s = time.monotonic() - started
                gc.collect()
                channel.send(acquire_s=round(acquire_s, 3), rss_before=rss_before, rss_after=_rss())
            elif command["cmd"] == "measure":
                start, cpu0 = time.monotonic(), time.process_time()
                time.sleep(float(command["seconds"]))
                end, cpu1 = time.monotonic(), time.process_time()
                channel.send(
                    start=start,
                    end=end,
                    cpu=cpu1 - cpu0,
                    threads=threading.active_count(),
                    thread_names=sorted(thread.name for thread in threading.enumerate()),
                    os_threads=_os_threads(),
                    held=sum(mutex.held for mutex in mutexes),
                )
            elif command["cmd"] == "cycle":
                samples = _cycle_for(float(command["seconds"]), dsn, table, heartbeat)
                channel.send(cycles=len(samples), samples=samples)
            elif command["cmd"] == "release":
                started = time.monotonic()
                holding.close()
                channel.send(release_s=round(time.monotonic() - started, 3))
    finally:
        holding.close()
        for mutex in mutexes:
            mutex.close()
        first.close()
