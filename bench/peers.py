"""The peers: what a user would pick instead of this library, measured beside it in the same run.

Six locks, on this machine, one after another or in interleaved rounds:
this version of postgres-mutex, postgres-mutex 0.1.0 (from PyPI, in a venv
of its own) and PALs (session advisory locks through SQLAlchemy) on the same
PostgreSQL; redis-py's ``Lock`` and python-redis-lock on a redis-server the
bench starts; etcd (Debian's etcd-server, started by the bench) through
aetcd, an asyncio gRPC client that is maintained and works with etcd 3.4 and
today's protobuf (``etcd3``, the older gRPC client, was last released in 2020).

Three measures, each the same for every peer (see `bench.peer_locks` for how
each library is called):

- the uncontended acquire + release cycle, one worker per peer, in
  interleaved rounds (a round of each peer in rotating order), median and
  p99, with its ratio to this version's cycle in the same rounds;
- hand-off: two workers per peer swap one lock as `bench.handoff` does (the
  waiter blocks, the holder releases after a settle period), blocks of a few
  hand-offs per peer in turn; the latency from the release call to the
  waiter's acquire returning;
- contended throughput: 4 processes (2 in a quick run), one lock, a 2 ms
  hold, one window per peer; every critical section is checked for overlaps.

A peer whose server or package is missing gets the reason instead of figures;
so does one whose worker fails in a measure (the others go on).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import itertools
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

import postgres_mutex

from . import peer_servers
from .processes import START_TIMEOUT, Worker, WorkerFailed, run_window
from .servers import bench_table
from .timing import median, percentile

TABLE = "mutex_lock_bench_peers"
TABLE_0_1_0 = "mutex_lock_bench_peers_010"
HOLD = 0.002
"""How long each contended cycle holds the lock (seconds)."""

SETTLE = 0.02
"""How long a hand-off's waiter has been blocked when the holder releases (seconds)."""

STARTED = time.monotonic()

BLOCK = 5
"""Hand-offs in a row for one peer before the next peer's turn."""


@dataclass(frozen=True)
class Peer:
    key: str
    label: str
    kind: str
    needs: tuple[str, ...]
    """Modules its worker imports (a missing one: pip install postgres-mutex[bench])."""
    gives: tuple[str, str, str, str]
    """What the price buys: liveness, before a reclaim, fencing, a blocked waiter."""


PEERS = (
    Peer(
        "this",
        "**postgres-mutex (this version)**",
        "mutex",
        (),
        (
            "heartbeat thread renews the row",
            "alert hook, then reclaim after the stale threshold",
            "token from a sequence (`mutex.fence`)",
            "woken by LISTEN/NOTIFY",
        ),
    ),
    Peer(
        "fair",
        "postgres-mutex (this version), `fair=True`",
        "mutex",
        (),
        (
            "heartbeat thread renews the row",
            "alert hook, then reclaim after the stale threshold",
            "token from a sequence (`mutex.fence`)",
            "a blocked waiter is handed the lock by the release, in the order waiters came",
        ),
    ),
    Peer(
        "0.1.0",
        "postgres-mutex 0.1.0",
        "mutex",
        (),
        (
            "heartbeat thread renews the row",
            "alert hook, then reclaim after the stale threshold",
            "none",
            "polls every `poll_interval` (0.5 s)",
        ),
    ),
    Peer(
        "pals",
        "PALs (advisory lock)",
        "pals",
        ("pals", "sqlalchemy"),
        (
            "none needed: held while the session lives; each held lock pins a pooled connection",
            "none: the server frees it the moment the session ends",
            "none",
            "blocks in the server (`pg_advisory_lock` under `lock_timeout`)",
        ),
    ),
    Peer(
        "redis-py",
        "redis-py `Lock`",
        "redis-py",
        ("redis",),
        (
            "none: an expiry (30 s here), `extend()` by hand",
            "none: the key expires silently",
            "none",
            "polls every `sleep` (0.1 s)",
        ),
    ),
    Peer(
        "python-redis-lock",
        "python-redis-lock",
        "python-redis-lock",
        ("redis", "redis_lock"),
        (
            "renewal thread (`auto_renewal=True`, 30 s expiry here)",
            "none: the key expires silently",
            "none",
            "waits in BLPOP, woken at release",
        ),
    ),
    Peer(
        "etcd",
        "etcd (aetcd `Lock`)",
        "etcd",
        ("aetcd",),
        (
            "none: a lease (30 s here), `refresh()` by hand",
            "none: the lease expires silently",
            "the key's revision can serve as one",
            "watches for the key's delete",
        ),
    ),
)


@dataclass(frozen=True)
class PeersPlan:
    rounds: int
    per_round: int
    warmup: int
    handoffs: int
    processes: int
    seconds: float


FULL = PeersPlan(rounds=100, per_round=10, warmup=50, handoffs=200, processes=4, seconds=5.0)
QUICK = PeersPlan(rounds=5, per_round=5, warmup=5, handoffs=5, processes=2, seconds=1.0)
"""As CI runs it: seconds per peer, figures rough; two workers each (the hand-off needs two)."""


def progress(text: str) -> None:
    print(f"[bench] {text} ({time.monotonic() - STARTED:.1f} s)", file=sys.stderr, flush=True)


def run(dsn: str, server_version: str, plan: PeersPlan) -> dict[str, Any]:
    """Every peer's figures (or why it has none), and what the run was."""
    rows: dict[str, dict[str, Any]] = {
        peer.key: {"label": peer.label, "gives": list(peer.gives), "version": _version(peer), "errors": {}}
        for peer in PEERS
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(bench_table(dsn, TABLE))
        base: dict[str, Any] = {"dsn": dsn, "hold": HOLD}
        # 0.1.0's venv is built (pip, from PyPI) while the other peers' servers and workers start.
        venv = stack.enter_context(contextlib.ExitStack())
        executor = ThreadPoolExecutor(1, thread_name_prefix="bench-venv-0.1.0")
        stack.callback(executor.shutdown)
        base["building"] = executor.submit(venv.enter_context, peer_servers.release_0_1_0())
        pools: dict[str, list[Worker]] = {}
        for stage in ([peer for peer in PEERS if peer.key != "0.1.0"], [peer for peer in PEERS if peer.key == "0.1.0"]):
            ready: dict[str, tuple[dict[str, Any], str | None]] = {}
            for peer in stage:
                try:
                    ready[peer.key] = _prepare(peer, base, stack, rows[peer.key])
                except peer_servers.Unavailable as exc:
                    rows[peer.key]["skipped"] = str(exc)
            progress(f"peers: starting {plan.processes} workers each for {', '.join(ready) or 'none'}")
            pools.update(_pools(stack, ready, rows, plan.processes))
        for key in ("this", "fair", "0.1.0", "pals"):
            rows[key]["server"] = f"PostgreSQL {server_version}"
        progress(f"peers: acquire + release, {plan.rounds} interleaved rounds of {plan.per_round}")
        _cycles(pools, rows, plan)
        progress(f"peers: {plan.handoffs} hand-offs each, in blocks of {BLOCK}")
        _handoffs(pools, rows, plan)
        for key, pool in pools.items():
            progress(f"peers: contended, {key}, {plan.processes} processes, {plan.seconds:g} s")
            try:
                rows[key]["contended"] = _contended(pool, plan)
            except WorkerFailed as exc:
                rows[key]["errors"]["contended"] = _short(exc)
    _ratios(rows)
    return {
        "hold_ms": HOLD * 1e3,
        "processes": plan.processes,
        "seconds": plan.seconds,
        "settle_s": SETTLE,
        "peers": rows,
    }


def _version(peer: Peer) -> str:
    if peer.key in ("this", "fair"):
        return postgres_mutex.__version__
    if peer.key == "0.1.0":
        return peer_servers.PUBLISHED
    distribution = {"pals": "pals", "redis-py": "redis", "python-redis-lock": "python-redis-lock", "etcd": "aetcd"}
    try:
        return importlib.metadata.version(distribution[peer.key])
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _prepare(
    peer: Peer, base: dict[str, Any], stack: contextlib.ExitStack, row: dict[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """The peer's worker config and interpreter, its server started; `Unavailable` if it cannot run."""
    for module in peer.needs:
        if importlib.util.find_spec(module) is None:
            raise peer_servers.Unavailable(f"Python module `{module}` missing: pip install 'postgres-mutex[bench]'")
    config = {"dsn": base["dsn"], "hold": base["hold"], "kind": peer.kind, "peer": peer.key, "table": TABLE}
    python = None
    if peer.key == "fair":
        config["fair"] = True
    elif peer.key == "0.1.0":
        python = base["building"].result(timeout=600)
        stack.enter_context(_dropped(base["dsn"], TABLE_0_1_0))
        peer_servers.create_table_0_1_0(python, base["dsn"], TABLE_0_1_0)
        config["table"] = TABLE_0_1_0
    elif peer.kind in ("redis-py", "python-redis-lock"):
        if "redis_port" not in base:
            base["redis_port"] = stack.enter_context(peer_servers.redis())
        config["redis_port"] = base["redis_port"]
        row["server"] = f"redis-server {peer_servers.redis_version()}"
    elif peer.kind == "etcd":
        config["etcd_port"] = stack.enter_context(peer_servers.etcd())
        row["server"] = f"etcd {peer_servers.etcd_version()}"
    return config, python


@contextlib.contextmanager
def _dropped(dsn: str, table: str) -> Iterator[None]:
    """0.1.0's table, dropped before (a previous run's) and after."""
    drop = sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(sql.Identifier(table))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(drop)
    try:
        yield
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(drop)


def _short(exc: BaseException) -> str:
    """A worker's failure as a table cell: its last line, not its traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def _pools(
    stack: contextlib.ExitStack, configs: dict[str, Any], rows: dict[str, dict[str, Any]], count: int
) -> dict[str, list[Worker]]:
    """``count`` workers per peer on one lock of its own, all started before any is waited for."""
    started: dict[str, list[Worker]] = {}
    for key, (config, python) in configs.items():
        pool = started[key] = []
        for _ in range(count):
            worker = Worker("peer", {**config, "name": f"bench-peers-{key}"}, python)
            stack.callback(worker.stop)
            pool.append(worker)
    pools = {}
    for key, pool in started.items():
        try:
            for worker in pool:
                worker.receive(START_TIMEOUT)  # {"ready": ...}
        except WorkerFailed as exc:
            rows[key]["skipped"] = _short(exc)
        else:
            pools[key] = pool
    return pools


def _cycles(pools: dict[str, list[Worker]], rows: dict[str, dict[str, Any]], plan: PeersPlan) -> None:
    """Uncontended cycles, one worker per peer (the others idle), in interleaved rounds."""
    samples: dict[str, list[float]] = {key: [] for key in pools}
    cpu = dict.fromkeys(pools, 0.0)

    def round_of(key: str, count: int, record: bool) -> None:
        if "cycle" in rows[key]["errors"]:
            return
        try:
            pools[key][0].send(cmd="cycles", count=count)
            answer = pools[key][0].receive(60)
        except WorkerFailed as exc:
            rows[key]["errors"]["cycle"] = _short(exc)
            return
        if record:
            samples[key].extend(answer["samples"])
            cpu[key] += answer["cpu"]

    keys = list(pools)
    for key in keys:
        round_of(key, plan.warmup, record=False)
    for index in range(plan.rounds):
        shift = index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            round_of(key, plan.per_round, record=True)
    for key, values in samples.items():
        if values and "cycle" not in rows[key]["errors"]:
            rows[key]["cycle"] = {
                "n": len(values),
                "median_ms": round(median(values) * 1e3, 4),
                "p99_ms": round(percentile(values, 0.99) * 1e3, 4),
                "client_cpu_us": round(cpu[key] / len(values) * 1e6, 1),
            }


class _Pair:
    """Two workers of one peer handing its lock back and forth (as `bench.handoff` does)."""

    def __init__(self, first: Worker, second: Worker) -> None:
        first.send(cmd="acquire")
        first.receive(30)  # waiting
        first.receive(30)  # acquired
        self.holder, self.waiter = first, second
        self.latencies: list[float] = []

    def hand_off(self) -> None:
        self.waiter.send(cmd="acquire")
        self.waiter.receive(30)  # waiting
        time.sleep(SETTLE)
        self.holder.send(cmd="release")
        released = self.holder.receive(30)
        acquired = self.waiter.receive(60)
        self.latencies.append(float(acquired["acquired"]) - float(released["released"]))
        self.holder, self.waiter = self.waiter, self.holder

    def finish(self) -> None:
        self.holder.send(cmd="release")
        self.holder.receive(30)

    def figures(self) -> dict[str, Any]:
        values = self.latencies
        return {
            "handoffs": len(values),
            "p50_ms": round(median(values) * 1e3, 3),
            "p99_ms": round(percentile(values, 0.99) * 1e3, 3),
            "max_ms": round(max(values) * 1e3, 3),
            # A waiter that returned before the holder began its release: two holders at once.
            "acquired_before_release": sum(1 for value in values if value < 0),
        }


def _handoffs(pools: dict[str, list[Worker]], rows: dict[str, dict[str, Any]], plan: PeersPlan) -> None:
    """Hand-offs between two workers per peer, blocks of `BLOCK` per peer in turn, until each peer has
    ``plan.handoffs`` (or time is up); the lock is free again at the end."""
    pairs: dict[str, _Pair] = {}
    for key, pool in pools.items():
        try:
            pairs[key] = _Pair(pool[0], pool[1])
        except WorkerFailed as exc:
            rows[key]["errors"]["handoff"] = _short(exc)
    # A polling waiter may take up to its poll interval (0.5 s) per hand-off.
    deadline = time.monotonic() + 60 + plan.handoffs * 0.6
    while time.monotonic() < deadline:
        active = [key for key, pair in pairs.items() if len(pair.latencies) < plan.handoffs]
        active = [key for key in active if "handoff" not in rows[key]["errors"]]
        if not active:
            break
        for key in active:
            try:
                for _ in range(min(BLOCK, plan.handoffs - len(pairs[key].latencies))):
                    pairs[key].hand_off()
            except WorkerFailed as exc:
                rows[key]["errors"]["handoff"] = _short(exc)
    for key, pair in pairs.items():
        if "handoff" in rows[key]["errors"]:
            continue
        try:
            pair.finish()
        except WorkerFailed as exc:
            rows[key]["errors"]["handoff"] = _short(exc)
            continue
        if pair.latencies:
            rows[key]["handoff"] = pair.figures()


def _contended(pool: list[Worker], plan: PeersPlan) -> dict[str, Any]:
    """The peer's workers on its one lock over one window; rate, shares and overlaps."""
    reports = run_window(pool, plan.seconds)
    sections = sorted((float(a), float(b)) for report in reports for a, b in report["sections"])
    overlaps = sum(1 for (_, left), (entered, _) in itertools.pairwise(sections) if entered < left)
    counts = [len(report["sections"]) for report in reports]
    total = sum(counts)
    return {
        "cycles": total,
        "cycles_per_s": round(total / plan.seconds, 1),
        "share_min": round(min(counts) / total, 3) if total else None,
        "share_max": round(max(counts) / total, 3) if total else None,
        "overlaps": overlaps,
    }


def _ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Each peer's figures over this version's, measured in the same run."""
    this = rows["this"]
    for row in rows.values():
        for measure, field in (("cycle", "median_ms"), ("handoff", "p50_ms"), ("contended", "cycles_per_s")):
            if measure in row and measure in this and this[measure][field]:
                row[measure]["to_this"] = round(row[measure][field] / this[measure][field], 3)
