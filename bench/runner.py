"""``python -m bench``: measure what postgres-mutex costs, print a table, write JSON and markdown.

Every figure printed is measured in the run that prints it; timings are
medians (and p99 where it matters), each with its ratio to a baseline measured
in the same run. See docs/performance.md for what each section measures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

import postgres_mutex

from . import (
    arrival,
    ceiling,
    contention,
    fastpath,
    handoff,
    history,
    latency,
    many_locks,
    peers,
    peers_report,
    pgbouncer,
    report,
    rwlocks,
    table_load,
    waiters,
)
from .latency import Sizes
from .servers import HISTORY_TABLE, SWEEP_TABLE, bench_table
from .servers import pgbouncer as start_pgbouncer
from .servers import server as start_server

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results"
DOCS_FIGURES = ROOT / "docs" / "figures" / "bench.md"
CONTENDED_PERMITS = 3
"""The semaphore the contended section sets beside the mutex: at most this many hold at once."""


@dataclass(frozen=True)
class Plan:
    """How big each measure is."""

    latency: Sizes
    handoffs: int
    contended_processes: int
    contended_seconds: float
    ceiling_processes: tuple[int, ...]
    ceiling_seconds: float
    ceiling_slices: int
    many_locks: int
    many_window: float
    many_settle: float
    many_cycling: float
    pgbouncer: Sizes
    starvation_rounds: int
    starvation_hold: float
    waiters: tuple[int, ...]
    waiters_seconds: float
    waiters_warmup: float
    arrival_waiters: int
    arrival_rounds: int
    load_locks: int
    load_window: float
    load_every: float


FULL = Plan(
    latency=Sizes(rounds=200, per_round=10, warmup=50),
    handoffs=600,
    contended_processes=4,
    contended_seconds=10.0,
    ceiling_processes=(1, 4),
    ceiling_seconds=5.0,
    ceiling_slices=5,
    many_locks=10_000,
    many_window=10.0,
    many_settle=3.0,
    many_cycling=5.0,
    pgbouncer=Sizes(rounds=100, per_round=10, warmup=50),
    starvation_rounds=20,
    starvation_hold=0.5,
    waiters=(1, 10, 100),
    waiters_seconds=10.0,
    waiters_warmup=2.0,
    arrival_waiters=10,
    arrival_rounds=10,
    load_locks=10_000,
    load_window=180.0,
    load_every=10.0,
)

QUICK = Plan(
    latency=Sizes(rounds=10, per_round=6, warmup=10),
    handoffs=20,
    contended_processes=2,
    contended_seconds=1.5,
    ceiling_processes=(2,),
    ceiling_seconds=1.0,
    ceiling_slices=1,
    many_locks=200,
    many_window=3.0,
    many_settle=1.0,
    many_cycling=1.0,
    pgbouncer=Sizes(rounds=6, per_round=6, warmup=10),
    starvation_rounds=3,
    starvation_hold=0.2,
    waiters=(1, 4),
    waiters_seconds=1.5,
    waiters_warmup=0.5,
    arrival_waiters=3,
    arrival_rounds=2,
    load_locks=500,
    load_window=6.0,
    load_every=2.0,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure what postgres-mutex costs against baselines measured in the same run.",
    )
    parser.add_argument("--dsn", help="the PostgreSQL to measure on (default: a throwaway server of its own)")
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds, rough figures (as CI runs it)")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"where to write bench.json and bench.md (default: {DEFAULT_OUT.relative_to(ROOT)}; a full run "
        f"there also rewrites {DOCS_FIGURES.relative_to(ROOT)})",
    )
    parser.add_argument(
        "--pgbouncer", action="store_true", help="also the sync cycle through PgBouncer (Debian's pgbouncer)"
    )
    parser.add_argument(
        "--note",
        default="",
        help="a sentence on the machine, printed with the run's description "
        "(e.g. 'The machine was shared with other work.')",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--skip-peers",
        action="store_true",
        help="leave out the peers (postgres-mutex 0.1.0, PALs, redis-py, python-redis-lock, etcd)",
    )
    which.add_argument(
        "--only-peers",
        action="store_true",
        help=f"measure the peers alone (a full run without --out rewrites their section of "
        f"{DOCS_FIGURES.relative_to(ROOT)} only)",
    )
    which.add_argument(
        "--only-rwlocks",
        action="store_true",
        help=f"measure the read/write locks alone, beside a Mutex measured in the same run (a full run without "
        f"--out rewrites their section of {DOCS_FIGURES.relative_to(ROOT)} only)",
    )
    which.add_argument(
        "--only-waiters",
        action="store_true",
        help=f"measure many waiters on one lock alone (a full run without --out rewrites their section of "
        f"{DOCS_FIGURES.relative_to(ROOT)} only)",
    )
    which.add_argument(
        "--only-table-load",
        action="store_true",
        help=f"measure the table under long heartbeat load alone (a full run without --out rewrites its section "
        f"of {DOCS_FIGURES.relative_to(ROOT)} only)",
    )
    return parser.parse_args(argv)


def progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = time.monotonic()
    results: dict[str, Any] = {}
    with start_server(args.dsn) as target, bench_table(target.dsn) as table:
        progress(f"PostgreSQL {target.version} ({target.settings})")
        results["meta"] = _meta(args, target.version, target.settings)
        if args.only_rwlocks:
            results["rwlocks"] = _measure_rwlocks(plan, target.dsn, table, floor=None)
        elif args.only_waiters:
            results["waiters"] = _measure_waiters(plan, target.dsn, table)
        elif args.only_table_load:
            results["table_load"] = _measure_table_load(plan, target.dsn, target.throwaway)
        elif not args.only_peers:
            _measure_the_library(args, plan, target.dsn, table, target.throwaway, results)
        if args.skip_peers or args.only_rwlocks or args.only_waiters or args.only_table_load:
            results["peers"] = {"skipped": "run without --skip-peers to measure them"}
        else:
            progress("the peers: postgres-mutex 0.1.0, PALs, redis-py, python-redis-lock, etcd")
            results["peers"] = peers.run(target.dsn, target.version, peers.QUICK if args.quick else peers.FULL)
    results["meta"]["seconds"] = round(time.monotonic() - started, 1)

    out = args.out or DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    figures = report.markdown(results, markers=True)
    (out / "bench.md").write_text(figures)
    written = [out / "bench.json", out / "bench.md"]
    if args.out is None and not args.quick:
        alone = _measured_alone(args)
        if alone is not None:
            # The other sections stay as their own run measured them; this one says it is from another.
            name, title, what = alone
            said = f"From a run of {what} alone, not the run described at the top of this file: "
            body = [said + report.sections(results)["meta"][0], "", *report.sections(results)[name]]
            peers_report.splice(DOCS_FIGURES, name, title, body)
        else:
            DOCS_FIGURES.write_text(figures)
        written.append(DOCS_FIGURES)
    print(report.markdown(results, markers=False))
    progress("wrote " + ", ".join(str(path) for path in written))
    return 0


def _measured_alone(args: argparse.Namespace) -> tuple[str, str, str] | None:
    """The section a run measured alone (``--only-...``): its name, title, and what it is in words; else None."""
    if args.only_peers:
        return "peers", report.PEERS_TITLE, "the peers"
    if args.only_rwlocks:
        return "rwlocks", report.RWLOCKS_TITLE, "the read/write locks"
    if args.only_waiters:
        return "waiters", report.WAITERS_TITLE, "many waiters on one lock"
    if args.only_table_load:
        return "table_load", report.TABLE_LOAD_TITLE, "the table under long heartbeat load"
    return None


def _measure_the_library(
    args: argparse.Namespace, plan: Plan, dsn: str, table: str, throwaway: bool, results: dict[str, Any]
) -> None:
    """Every section but the peers, in order, into ``results``."""
    progress("latency, one connection")
    timed = latency.run(dsn, table, plan.latency)
    select_1 = timed["select_1"].median
    results["latency"] = {name: value.summary(select_1) for name, value in timed.items()}
    results["target"] = report.target(results["latency"])

    progress("an uncontended cycle's own Python: frames at psycopg's entry, calls, CPU against the floor")
    sizes = plan.latency
    results["fastpath"] = fastpath.measure(
        dsn, table, rounds=sizes.rounds, per_round=sizes.per_round, warmup=sizes.warmup, local_server=throwaway
    )

    progress("the lock history's cost: the same operations on a table with a history and without")
    with (
        bench_table(dsn, HISTORY_TABLE, history=True) as history_table,
        bench_table(dsn, SWEEP_TABLE, history=True) as sweep_table,
    ):
        results["history"] = history.run(dsn, table, history_table, sweep_table, plan.latency)

    progress(f"hand-off, {plan.handoffs} times")
    results["handoff"] = handoff.run(dsn, table, plan.handoffs, max_seconds=60 + plan.handoffs * 0.2)

    results["waiters"] = _measure_waiters(plan, dsn, table)

    progress(f"contended throughput, {plan.contended_processes} processes, {plan.contended_seconds:g} s")
    results["contended"] = contention.run(
        dsn, table, plan.contended_processes, plan.contended_seconds, timed["insert_delete"].median
    )
    # More processes than permits, or the semaphore is not contended at all.
    processes = max(plan.contended_processes, CONTENDED_PERMITS + 1)
    progress(f"contended throughput, a semaphore of {CONTENDED_PERMITS}, {processes} processes, the same window")
    results["contended"]["semaphore"] = contention.run(
        dsn,
        table,
        processes,
        plan.contended_seconds,
        timed["insert_delete"].median,
        permits=CONTENDED_PERMITS,
    )
    progress(f"contended throughput, a fair Mutex, {plan.contended_processes} processes, the same window")
    results["contended"]["fair_mutex"] = contention.run(
        dsn, table, plan.contended_processes, plan.contended_seconds, timed["insert_delete"].median, fair=True
    )

    results["rwlocks"] = _measure_rwlocks(
        plan,
        dsn,
        table,
        floor=timed["insert_delete"].median,
        mutex_contended={
            key: value for key, value in results["contended"].items() if key not in ("semaphore", "fair_mutex")
        },
    )

    results["ceiling"] = []
    for processes in plan.ceiling_processes:
        progress(
            f"server ceiling, {processes} processes, {plan.ceiling_seconds:g} s per kind in {plan.ceiling_slices} turns"
        )
        results["ceiling"].append(ceiling.run(dsn, table, processes, plan.ceiling_seconds, slices=plan.ceiling_slices))

    progress(f"many locks: {plan.many_locks} held by one process")
    results["many_locks"] = many_locks.run(
        dsn,
        table,
        plan.many_locks,
        window=plan.many_window,
        settle=plan.many_settle,
        cycling=plan.many_cycling,
        local_server=throwaway,
    )

    results["table_load"] = _measure_table_load(plan, dsn, throwaway)

    if args.pgbouncer:
        progress("through PgBouncer (transaction mode) and direct")
        with start_pgbouncer(dsn, pool_size=pgbouncer.POOL_SIZE) as through:
            routes = pgbouncer.run(dsn, through, table, plan.pgbouncer)
        results["pgbouncer"] = {
            "version": _pgbouncer_version(),
            "pool_mode": "transaction",
            "pool_size": pgbouncer.POOL_SIZE,
            **{route: {name: value.summary() for name, value in timed.items()} for route, timed in routes.items()},
        }
    else:
        results["pgbouncer"] = {"skipped": "run with --pgbouncer to measure it"}


def _measure_waiters(plan: Plan, dsn: str, table: str) -> dict[str, Any]:
    progress(
        f"many waiters on one lock: {', '.join(map(str, plan.waiters))} waiters, {plan.waiters_seconds:g} s each "
        f"after {plan.waiters_warmup:g} s"
    )
    measured = waiters.run_all(dsn, table, plan.waiters, seconds=plan.waiters_seconds, warmup=plan.waiters_warmup)
    progress(f"arrival order: {plan.arrival_waiters} waiters of a fair Mutex, {plan.arrival_rounds} rounds")
    measured["arrival"] = arrival.run(dsn, table, plan.arrival_waiters, plan.arrival_rounds)
    return measured


def _measure_table_load(plan: Plan, dsn: str, throwaway: bool) -> dict[str, Any]:
    progress(
        f"the table under long heartbeat load: {plan.load_locks} locks renewed every {table_load.HEARTBEAT:g} s "
        f"for {plan.load_window:g} s, sampled every {plan.load_every:g} s"
    )
    return table_load.run(dsn, plan.load_locks, window=plan.load_window, every=plan.load_every, local_server=throwaway)


def _measure_rwlocks(
    plan: Plan, dsn: str, table: str, floor: float | None, mutex_contended: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The read/write locks' section; ``floor`` (the plain INSERT + DELETE) and the Mutex's contended row are
    measured here if not given."""
    if floor is None:
        progress("the floor: a plain INSERT + DELETE")
        floor = rwlocks.floor(dsn, table, plan.latency)
    progress(
        f"read/write locks: cycle, {plan.handoffs} hand-offs, {plan.contended_processes} processes contending, "
        f"a writer behind a stream of readers {plan.starvation_rounds} times"
    )
    return rwlocks.run(
        dsn,
        table,
        plan.latency,
        handoffs=plan.handoffs,
        processes=plan.contended_processes,
        seconds=plan.contended_seconds,
        floor=floor,
        rounds=plan.starvation_rounds,
        hold=plan.starvation_hold,
        mutex_contended=mutex_contended,
    )


def _meta(args: argparse.Namespace, server_version: str, settings: str) -> dict[str, Any]:
    command = ["python", "-m", "bench"]
    command += ["--dsn", "..."] if args.dsn else []
    command += ["--quick"] if args.quick else []
    command += ["--pgbouncer"] if args.pgbouncer else []
    command += ["--skip-peers"] if args.skip_peers else []
    command += ["--only-peers"] if args.only_peers else []
    command += ["--only-rwlocks"] if args.only_rwlocks else []
    command += ["--only-waiters"] if args.only_waiters else []
    command += ["--only-table-load"] if args.only_table_load else []
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "library": postgres_mutex.__version__,
        "commit": _commit(),
        "server_version": server_version,
        "server": settings,
        "command": shlex.join(command),
        "quick": bool(args.quick),
        "note": args.note,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _commit() -> str:
    try:
        found = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except OSError:
        return "unknown commit"
    return found.stdout.strip() or "unknown commit"


def _pgbouncer_version() -> str:
    try:
        found = subprocess.run(["pgbouncer", "--version"], capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return "unknown"
    first = (found.stdout or found.stderr).splitlines()
    return first[0].split()[-1] if first else "unknown"
