"""The lock table under long heartbeat load: are the renewals HOT updates, and does the table stop growing?

One worker process (the ``many-locks`` mode of `bench.many_locks`) holds N
locks with ``heartbeat_interval=0.1`` on a table of their own
(`bench.servers.LOAD_TABLE`, fresh, as `LockTable.create` makes it, so its
counters and sizes are this load's alone), then idles for a window while its
heartbeat renews them. The parent samples the table every few seconds:

- ``pg_stat_user_tables``: ``n_tup_upd``, ``n_tup_hot_upd``, ``n_dead_tup``,
  ``autovacuum_count``, ``last_autovacuum``. A backend flushes its counters at
  most about once a second while it works (``pg_stat_force_next_flush()``
  flushes only the calling session's, not the worker's), so each sample lags
  by up to a second; deltas over the window carry that lag at both ends;
- ``pg_relation_size``, ``pg_indexes_size`` and ``pg_total_relation_size``.

Reported: the renewals achieved (rows updated per second, over the window,
and so rounds per second: each round renews every lock once) against those
asked (N per interval); the HOT share of the window's updates; the sizes at
the start, after the first minute (a third of a shorter window) and at the
end, and their growth over the first half of the window against the last;
autovacuum's runs in the window; and the autovacuum settings in effect with
the table's reloptions (its fillfactor), since those decide whether dead row
versions are cleared.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from .many_locks import backend_cpu, backends
from .processes import workers
from .servers import LOAD_TABLE, bench_table

HEARTBEAT = 0.1

THRESHOLDS = {"alert_threshold": 3.0, "stale_threshold": 10.0}
"""Thresholds a user of a 0.1 s heartbeat might pick (the defaults, 30 s and 600 s, suit 10 s): a lease of
9.9 s, so a round that falls behind shows as fewer renewals per second, not as lost locks."""

AUTOVACUUM_SETTINGS = (
    "autovacuum",
    "autovacuum_naptime",
    "autovacuum_vacuum_threshold",
    "autovacuum_vacuum_scale_factor",
)

FIRST_MINUTE = 60.0

_SAMPLE = """
SELECT s.n_tup_upd, s.n_tup_hot_upd, s.n_dead_tup, s.autovacuum_count, s.last_autovacuum::text,
       pg_relation_size(s.relid), pg_indexes_size(s.relid), pg_total_relation_size(s.relid)
FROM pg_stat_user_tables s WHERE s.relid = to_regclass(%s)
"""


def run(dsn: str, locks: int, *, window: float, every: float, local_server: bool) -> dict[str, Any]:
    """Hold ``locks`` locks for ``window`` seconds on a fresh table, sampling it every ``every`` seconds."""
    with bench_table(dsn, LOAD_TABLE) as table, psycopg.connect(dsn, autocommit=True) as admin:
        config = {"dsn": dsn, "table": table, "locks": locks, "heartbeat": HEARTBEAT, "thresholds": THRESHOLDS}
        with workers("many-locks", [config]) as (worker,):
            worker.send(cmd="hold")
            held = worker.receive(60.0 + locks * 0.05)
            server = [pid for pid, _ in backends(admin, worker.pid)]
            server_cpu0 = backend_cpu(server) if local_server else None
            worker.send(cmd="measure", seconds=window)
            samples = _sample(admin, table, window, every)
            measured = worker.receive(window + 30.0)
            server_cpu1 = backend_cpu(server) if local_server else None
            settings = _settings(admin, table)
            worker.send(cmd="release")
            released = worker.receive(60.0 + locks * 0.05)
    first, last = samples[0], samples[-1]
    span = last["t"] - first["t"]
    updated = last["upd"] - first["upd"]
    middle = _at(samples, span / 2)
    early = _at(samples, min(FIRST_MINUTE, span / 3))
    wall = float(measured["end"]) - float(measured["start"])
    server_cpu = None
    if server_cpu0 is not None and server_cpu1 is not None:
        server_cpu = round((server_cpu1 - server_cpu0) / wall * 100, 1)
    return {
        "locks": locks,
        "heartbeat_interval_s": HEARTBEAT,
        **THRESHOLDS,
        "window_s": round(span, 1),
        "acquire_all_s": held["acquire_s"],
        "asked_updates_per_s": round(locks / HEARTBEAT),
        "updates": updated,
        "updates_per_s": round(updated / span, 1),
        "rounds_per_s": round(updated / span / locks, 3),
        "hot_updates": last["hot"] - first["hot"],
        "hot_share": round((last["hot"] - first["hot"]) / updated, 4) if updated else None,
        "sizes": {
            kind: {"start": first[kind], "early": early[kind], "middle": middle[kind], "end": last[kind]}
            for kind in ("table_bytes", "index_bytes", "total_bytes")
        },
        "early_s": round(early["t"] - first["t"], 1),
        "growth": {
            kind: {"first_half": middle[kind] - first[kind], "last_half": last[kind] - middle[kind]}
            for kind in ("table_bytes", "index_bytes", "total_bytes")
        },
        "dead_tuples": {
            "start": first["dead"],
            "least": min(s["dead"] for s in samples),
            "most": max(s["dead"] for s in samples),
            "end": last["dead"],
        },
        "autovacuum_runs": last["autovacuum_count"] - first["autovacuum_count"],
        "last_autovacuum": last["last_autovacuum"],
        "still_held": measured["held"],
        "client_cpu_percent": round(float(measured["cpu"]) / wall * 100, 1),
        "server_cpu_percent": server_cpu,
        "release_all_s": released["release_s"],
        "settings": settings,
        "samples": samples,
    }


def _sample(admin: psycopg.Connection[Any], table: str, window: float, every: float) -> list[dict[str, Any]]:
    """The table's counters and sizes at the window's start, every ``every`` seconds, and at its end."""
    start = time.monotonic()
    samples = [_read(admin, table, 0.0)]
    ticks = max(1, round(window / every))
    for tick in range(1, ticks + 1):
        # On a schedule from the start, so a slow sample does not push the others later.
        time.sleep(max(0.0, start + window * tick / ticks - time.monotonic()))
        samples.append(_read(admin, table, time.monotonic() - start))
    return samples


def _read(admin: psycopg.Connection[Any], table: str, t: float) -> dict[str, Any]:
    row = admin.execute(_SAMPLE, (table,)).fetchone()
    if row is None:
        raise RuntimeError(f"{table} is not in pg_stat_user_tables")
    upd, hot, dead, autovacuums, last_autovacuum, table_bytes, index_bytes, total_bytes = row
    return {
        "t": round(t, 2),
        "upd": int(upd),
        "hot": int(hot),
        "dead": int(dead),
        "autovacuum_count": int(autovacuums),
        "last_autovacuum": last_autovacuum,
        "table_bytes": int(table_bytes),
        "index_bytes": int(index_bytes),
        "total_bytes": int(total_bytes),
    }


def _at(samples: list[dict[str, Any]], t: float) -> dict[str, Any]:
    """The sample taken nearest ``t`` seconds after the first."""
    return min(samples, key=lambda sample: abs(sample["t"] - samples[0]["t"] - t))


def _settings(admin: psycopg.Connection[Any], table: str) -> dict[str, Any]:
    """The server's autovacuum settings in effect, and the table's own storage options (its fillfactor)."""
    out: dict[str, Any] = {}
    for name in AUTOVACUUM_SETTINGS:
        row = admin.execute("SELECT current_setting(%s)", (name,)).fetchone()
        out[name] = None if row is None else str(row[0])
    row = admin.execute("SELECT reloptions FROM pg_class WHERE oid = to_regclass(%s)", (table,)).fetchone()
    out["reloptions"] = list(row[0] or []) if row else []
    return out
