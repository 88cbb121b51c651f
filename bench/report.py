"""The bench's results as JSON, and as tables: plain on stdout, with section markers for the docs.

The markdown file has one section per measure, between
``<!-- --8<-- [start:NAME] -->`` and ``<!-- --8<-- [end:NAME] -->``, so the
performance page can put each table under its explanation
(``--8<-- "docs/figures/bench.md:NAME"``). Every figure printed comes from
the results of the run being reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import peers_report

SECTIONS = (
    "meta",
    "latency",
    "target",
    "fastpath",
    "history",
    "handoff",
    "waiters",
    "contended",
    "rwlocks",
    "ceiling",
    "many_locks",
    "table_load",
    "pgbouncer",
    "peers",
)
"""Every section the JSON has, in order (a skipped one says why)."""

PEERS_TITLE = "The peers: other locks, measured beside this one"

RWLOCKS_TITLE = "Read/write locks, beside the Mutex"

WAITERS_TITLE = "Many waiters on one lock"

TABLE_LOAD_TITLE = "The table under long heartbeat load"

WAITERS_TARGET = 1.5
"""The issue's target: a hand-off's p50 with many waiters at most this many times the single waiter's."""

TARGET = 1.3
"""The issue's target: a Mutex cycle at most this many times its two statements sent bare."""

LATENCY_LABELS = {
    "select_1": "`SELECT 1`",
    "advisory": "`pg_try_advisory_lock` + `pg_advisory_unlock`",
    "insert_delete": "plain INSERT + DELETE of a lock row (the floor)",
    "raw_bare": "library's acquire + release, bare, psycopg defaults (prepared after 5 runs): "
    "as the library sends them on a direct connection",
    "raw_bare_unprepared": "library's acquire + release, bare, never prepared",
    "raw_prefixed": "library's acquire + release as it sends them behind a pooler (`SET LOCAL` prefix, `ClientCursor`)",
    "mutex_sync": "**Mutex cycle, sync**: `with mutex.acquire()`",
    "semaphore_sync": "**Semaphore cycle, sync**: `with semaphore.acquire()` (3 permits, none held)",
    "mutex_sync_reclaim": "Mutex cycle, sync, with `reclaim_disconnected_after` (its row names its session)",
    "fair_sync": "fair Mutex cycle, sync: `with mutex.acquire()` on a Mutex with `fair=True` (nobody in line)",
    "insert_delete_async": "async: plain INSERT + DELETE of a lock row (the async cycle's floor)",
    "raw_bare_async": "async: acquire + release, bare, psycopg defaults",
    "raw_bare_unprepared_async": "async: acquire + release, bare, never prepared",
    "raw_prefixed_async": "async: acquire + release as the library sends them behind a pooler",
    "mutex_async": "**Mutex cycle, async**: `async with mutex.acquire_async(blocking=False)`",
}


def _ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f} ms" if value < 10 else f"{value:.1f} ms"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def target(latency: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The Mutex cycle over its statements sent raw, sync and async; ``met`` against the bare baseline."""
    out: dict[str, Any] = {"target": TARGET}
    for flavour, suffix in (("sync", ""), ("async", "_async")):
        mutex = latency[f"mutex_{flavour}"]["median_ms"]
        ratios = {
            "bare_prepared": mutex / latency[f"raw_bare{suffix}"]["median_ms"],
            "bare_unprepared": mutex / latency[f"raw_bare_unprepared{suffix}"]["median_ms"],
            "prefixed": mutex / latency[f"raw_prefixed{suffix}"]["median_ms"],
        }
        out[flavour] = {
            "mutex_ms": mutex,
            **{f"to_{key}": round(value, 3) for key, value in ratios.items()},
            "met": ratios["bare_prepared"] <= TARGET,
            "met_unprepared": ratios["bare_unprepared"] <= TARGET,
        }
    out["reclaim_to_plain"] = round(latency["mutex_sync_reclaim"]["median_ms"] / latency["mutex_sync"]["median_ms"], 3)
    return out


TARGETS_TITLE = "Targets: where the library stands against its own floor"

NOT_MEASURED = "not measured in this run"
"""What a target's row says when the run's results have no section to judge it by."""

CYCLE_TO_FLOOR = {"sync": 1.15, "async": 1.3}
"""The issue's targets: a Mutex cycle at most this many times its floor, a plain INSERT + DELETE of a lock row sent
the same way (on a `psycopg.Connection` for the sync cycle, an `AsyncConnection` for the async one)."""

FLOORS = {"sync": "insert_delete", "async": "insert_delete_async"}
"""Each cycle's floor in the latency section."""

FASTPATH_TARGETS = {"frames": 5, "calls": 150, "sync_cpu_ratio": 1.4, "async_wall_ratio": 1.5}
"""What an uncontended cycle's own Python may cost at most (`bench.fastpath`)."""

CEILING_PROCESSES = (1, 4)
"""The ceiling's target is judged with each of these counts of processes, and only with a count measured."""

CEILING_TO_INSERT_DELETE = 0.8
"""The issue's target: Mutex cycles per second on distinct locks at least this share of plain INSERT + DELETE's."""

CONTENDED_OF_IDEAL = 0.8
"""The issue's target: one contended lock changes hands at least this share of the ideal 1 / (hold + floor)."""

FAIR_SHARE_SPREAD = 2.0
"""No process starved: each one's share of the cycles within this factor of the fair share, either way."""

MANY_LOCKS = 10_000
"""The many-locks targets hold for this many locks held: a run holding fewer does not judge them."""

MANY_LOCKS_P999_TO_P50 = 3.0
"""The issue's target: a cycle's p99.9 while the locks are held at most this many times its p50."""

MANY_LOCKS_MAX_MS = 20.0
"""The issue's target: a cycle's max while the locks are held under this."""

MANY_LOCKS_HEARTBEAT_MS = 5.0
"""The issue's target: the locks' heartbeat costs the server under this much CPU time per heartbeat interval."""

WAITERS = (1, 10, 100)
"""The waiters' targets are shown for these counts and judged on the largest one measured against the first."""

ARRIVAL_WAITERS = 10
"""The arrival-order target holds for this many waiters, each in a process of its own: a run with fewer does not
judge it."""

WAITERS_STATEMENTS_GROWTH = 1.2
"""The issue's target ("statements per hand-off no more than with 1 waiter x 1.2"): statements per hand-off with
the most waiters at most this many times the single waiter's (one statement per waiter would be a hundred times)."""


@dataclass(frozen=True)
class TargetRow:
    """One row of the targets' table: ``met`` is None when this run did not measure it."""

    target: str
    measured: str
    met: bool | None


@dataclass(frozen=True)
class Target:
    """A target judged from one section of the results: ``rows`` is only called when ``key`` is in them.

    Without the section (a run of another section alone, ``--skip-...``, or a section not written yet:
    ``key`` None), the table has one row, ``target`` and "not measured in this run", so that no row ever
    shows a figure from another run.
    """

    key: str | None
    target: str
    rows: Callable[[Any, dict[str, Any]], list[TargetRow]]
    """(the section's results, a dict or a list, and the whole run's) to this target's rows."""


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else "met" if met else "**not met**"


def _cycle_rows(latency: dict[str, Any], results: dict[str, Any]) -> list[TargetRow]:
    rows = []
    for flavour, limit in CYCLE_TO_FLOOR.items():
        target = f"{flavour} Mutex cycle (median) ≤ {limit}x its floor, a plain INSERT + DELETE of a lock row"
        if flavour == "async":
            target += " on an AsyncConnection"
        cycle = latency[f"mutex_{flavour}"]["median_ms"]
        floor = latency.get(FLOORS[flavour], {}).get("median_ms")
        if floor is None:
            rows.append(TargetRow(target, NOT_MEASURED, None))
            continue
        ratio = cycle / floor
        measured = f"{_ms(cycle)} / {_ms(floor)} = {_x(ratio)}"
        if flavour == "async":
            # Beside the sync floor too: what the async cycle costs over the same statements sent sync.
            measured += f" ({_x(cycle / latency['insert_delete']['median_ms'])} the sync floor)"
        rows.append(TargetRow(target, measured, ratio <= limit))
    return rows


def _ceiling_rows(ceiling: list[dict[str, Any]], results: dict[str, Any]) -> list[TargetRow]:
    runs = {run["processes"]: run for run in ceiling}
    rows = []
    for processes in CEILING_PROCESSES:
        target = (
            f"server ceiling on distinct locks, {_processes(processes)}: Mutex cycles/s ≥ "
            f"{CEILING_TO_INSERT_DELETE:.0%} of plain INSERT + DELETE's"
        )
        run = runs.get(processes)
        if run is None:
            # Another count's figures are shown for what they are, and judge nothing.
            instead = "; ".join(f"with {_processes(n)} instead: {_ceiling_share(runs[n])}" for n in sorted(runs))
            rows.append(TargetRow(target, NOT_MEASURED + (f" ({instead})" if instead else ""), None))
            continue
        mutex, floor = run["mutex"]["per_s"], run["insert_delete"]["per_s"]
        rows.append(TargetRow(target, _ceiling_share(run), floor > 0 and mutex / floor >= CEILING_TO_INSERT_DELETE))
    return rows


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _ceiling_share(run: dict[str, Any]) -> str:
    mutex, floor = run["mutex"]["per_s"], run["insert_delete"]["per_s"]
    return f"{_number(mutex)} / {_number(floor)} /s = " + (f"{mutex / floor:.0%}" if floor else "n/a")


def _contended_rows(contended: dict[str, Any], results: dict[str, Any]) -> list[TargetRow]:
    processes = contended["processes"]
    fair = 1 / processes
    low, high = contended["share_min"], contended["share_max"]
    fed = low is not None and high is not None and low >= fair / FAIR_SHARE_SPREAD and high <= fair * FAIR_SHARE_SPREAD
    shares = "no cycles" if low is None or high is None else f"{low:.0%} to {high:.0%}"
    return [
        TargetRow(
            f"contended throughput, one lock, {_processes(processes)}: ≥ {CONTENDED_OF_IDEAL:.0%} of the ideal "
            "1 / (hold + floor)",
            f"{_number(contended['cycles_per_s'])} / {_number(contended['ideal_per_s'])} cycles/s = "
            f"{contended['of_ideal']:.0%} (hold {contended['hold_ms']:g} ms, floor {_ms(contended['floor_ms'])})",
            contended["of_ideal"] >= CONTENDED_OF_IDEAL,
        ),
        TargetRow(
            f"no process starved: each one's share within {FAIR_SHARE_SPREAD:g}x of the fair share",
            f"shares {shares}, fair {fair:.0%} (within {fair / FAIR_SHARE_SPREAD:.0%} to "
            f"{min(fair * FAIR_SHARE_SPREAD, 1):.0%})",
            fed,
        ),
    ]


def _many_locks_rows(many: dict[str, Any], results: dict[str, Any]) -> list[TargetRow]:
    p50, p999, top = (
        many["cycle_while_holding_p50_ms"],
        many["cycle_while_holding_p999_ms"],
        many["cycle_while_holding_max_ms"],
    )
    # The same cycles in the same process before it took the locks (absent from runs before it was measured).
    alone_p50, alone_p999 = many.get("cycle_holding_none_p50_ms"), many.get("cycle_holding_none_p999_ms")
    alone = (
        ""
        if alone_p50 is None or alone_p999 is None
        else f"; holding none, before: {_ms(alone_p999)} / {_ms(alone_p50)} = {_x(alone_p999 / alone_p50)}"
    )
    cpu = many["server_cpu_percent"]
    # The process does nothing but hold its locks in the window, so its backends' CPU is the heartbeat's.
    server_ms = None if cpu is None else cpu / 100 * many["heartbeat_interval_s"] * 1e3
    # Fewer locks than the target's (a quick run) would judge the target on a lighter load than it names.
    judged = many["locks"] >= MANY_LOCKS
    held = f"{many['locks']:,} locks held" + ("" if judged else f", not {MANY_LOCKS:,}: {NOT_MEASURED}")
    return [
        TargetRow(
            f"holding {MANY_LOCKS:,} locks: a concurrent cycle's p99.9 ≤ {MANY_LOCKS_P999_TO_P50:g}x its p50",
            f"{_ms(p999)} / {_ms(p50)} = {_x(p999 / p50)} ({held}{alone})",
            p999 / p50 <= MANY_LOCKS_P999_TO_P50 if judged else None,
        ),
        TargetRow(
            f"holding {MANY_LOCKS:,} locks: a concurrent cycle's max < {MANY_LOCKS_MAX_MS:g} ms",
            f"{_ms(top)} ({held})",
            top < MANY_LOCKS_MAX_MS if judged else None,
        ),
        TargetRow(
            f"holding {MANY_LOCKS:,} locks: their heartbeat < {MANY_LOCKS_HEARTBEAT_MS:g} ms of server time per "
            "interval (server CPU of the process's backends per heartbeat interval)",
            f"{NOT_MEASURED} (server not local)"
            if server_ms is None
            else f"{_ms(server_ms)} per {many['heartbeat_interval_s']:g} s ({cpu:.2f} % of one core; {held})",
            None if server_ms is None or not judged else server_ms < MANY_LOCKS_HEARTBEAT_MS,
        ),
    ]


def _statements(run: dict[str, Any] | None) -> str:
    if run is None:
        return NOT_MEASURED
    per = run["statements_per_handoff"]
    return "n/a" if per is None else f"{per:.2f}"


def _waiters_rows(waiters: dict[str, Any], results: dict[str, Any]) -> list[TargetRow]:
    runs = {run["waiters"]: run for run in waiters["runs"]}
    single, most = runs.get(WAITERS[0]), runs.get(WAITERS[-1])
    per = ", ".join(f"{n}: {_statements(runs.get(n))}" for n in sorted(set(WAITERS) | set(runs)))
    rows = []
    first = (single or {}).get("statements_per_handoff")
    last = (most or {}).get("statements_per_handoff")
    growth = None if first is None or last is None or not first else last / first
    rows.append(
        TargetRow(
            f"{WAITERS[-1]} waiters on one lock: a release costs a few statements, not one per waiter (statements per "
            f"hand-off with {WAITERS[-1]} waiters ≤ {WAITERS_STATEMENTS_GROWTH:g}x with {WAITERS[0]})",
            f"by waiters, {per}" + ("" if growth is None else f"; {WAITERS[-1]} to {WAITERS[0]}: {_x(growth)}"),
            None if growth is None else growth <= WAITERS_STATEMENTS_GROWTH,
        )
    )
    ratio = (most or {}).get("p50_to_single")
    rows.append(
        TargetRow(
            f"{WAITERS[-1]} waiters on one lock: hand-off p50 ≤ {WAITERS_TARGET}x the single waiter's",
            NOT_MEASURED
            if most is None or single is None or ratio is None
            else f"{_ms(most['p50_ms'])} / {_ms(single['p50_ms'])} = {_x(ratio)}",
            None if ratio is None or single is None else ratio <= WAITERS_TARGET,
        )
    )
    order = waiters.get("arrival")
    target = (
        "fair Mutex: waiters acquire in the order they came "
        f"(overtakes with {ARRIVAL_WAITERS} waiters in as many processes: 0)"
    )
    if order is None:
        rows.append(TargetRow(target, NOT_MEASURED, None))
    else:
        judged = order["waiters"] >= ARRIVAL_WAITERS
        rows.append(
            TargetRow(
                target,
                f"{_arrival(order)}" + ("" if judged else f" (fewer than {ARRIVAL_WAITERS} waiters: not judged)"),
                order["overtakes"] == 0 if judged else None,
            )
        )
    return rows


def _arrival(order: dict[str, Any]) -> str:
    return (
        f"{order['overtakes']} overtakes in {order['pairs']:,} pairs of waiters "
        f"({order['waiters']} waiters, {order['rounds']} rounds)"
    )


HOT_SHARE = 0.99
"""Under long heartbeat load, at least this share of the heartbeat's updates are HOT (write no index)."""


def _table_load_rows(load: dict[str, Any], results: dict[str, Any]) -> list[TargetRow]:
    # Fewer locks than the target's (a quick run) would judge it on a lighter load than it names.
    judged = load["locks"] >= MANY_LOCKS
    held = f"{load['locks']:,} locks renewed for {load['window_s']:g} s" + (
        "" if judged else f", not {MANY_LOCKS:,}: {NOT_MEASURED}"
    )
    hot = load["hot_share"]
    last_half = {kind: grew["last_half"] for kind, grew in load["growth"].items()}
    return [
        TargetRow(
            f"under long heartbeat load ({MANY_LOCKS:,} locks): ≥ {HOT_SHARE:.0%} of the heartbeat's updates HOT",
            ("n/a" if hot is None else f"{hot:.2%}") + f" ({held})",
            None if hot is None or not judged else hot >= HOT_SHARE,
        ),
        TargetRow(
            f"under long heartbeat load ({MANY_LOCKS:,} locks): the table's and its indexes' sizes stop growing "
            "(no growth over the window's last half)",
            f"table {_bytes(last_half['table_bytes'])}, indexes {_bytes(last_half['index_bytes'])} over the last "
            f"half ({held})",
            max(last_half["table_bytes"], last_half["index_bytes"]) <= 0 if judged else None,
        ),
    ]


LONG_HEARTBEAT_LOAD = Target(
    key="table_load",
    target="under long heartbeat load: the heartbeat's updates are HOT and the table's sizes stop growing",
    rows=_table_load_rows,
)
"""The long heartbeat load's rows, from its section (`bench.table_load`)."""


def _fastpath_rows(figures: dict[str, Any], results: dict[str, Any]) -> list[TargetRow]:
    limits = FASTPATH_TARGETS
    return [
        TargetRow(
            f"library frames on the stack when a sync cycle enters psycopg ≤ {limits['frames']}",
            str(figures["frames_at_psycopg"]),
            figures["frames_at_psycopg"] <= limits["frames"],
        ),
        TargetRow(
            f"Python calls per sync Mutex cycle ≤ {limits['calls']}",
            f"{figures['calls_per_cycle']:.0f} (its two statements sent raw: {figures['raw_calls_per_cycle']:.0f})",
            figures["calls_per_cycle"] <= limits["calls"],
        ),
        TargetRow(
            f"sync Mutex cycle's client CPU ≤ {limits['sync_cpu_ratio']}x its floor's "
            "(INSERT ... ON CONFLICT DO NOTHING + DELETE)",
            f"{figures['sync_cpu_us']:.0f} / {figures['floor_cpu_us']:.0f} µs = {_x(figures['sync_cpu_ratio'])}",
            figures["sync_cpu_ratio"] <= limits["sync_cpu_ratio"],
        ),
        TargetRow(
            f"async Mutex cycle (median) ≤ {limits['async_wall_ratio']}x its two statements on an AsyncConnection",
            f"{_ms(figures['async_ms'])} / {_ms(figures['raw_async_ms'])} = {_x(figures['async_wall_ratio'])}",
            figures["async_wall_ratio"] <= limits["async_wall_ratio"],
        ),
    ]


TARGETS = (
    Target("latency", "Mutex cycle, sync and async, against the floor", _cycle_rows),
    Target("fastpath", "an uncontended cycle's own Python: frames, calls, CPU and wall time", _fastpath_rows),
    Target("ceiling", "server ceiling on distinct locks against plain INSERT + DELETE", _ceiling_rows),
    Target("contended", "contended throughput on one lock, and no process starved", _contended_rows),
    Target("many_locks", f"holding {MANY_LOCKS:,} locks: cycles beside them, and their heartbeat", _many_locks_rows),
    Target("waiters", f"{WAITERS[-1]} waiters on one lock: statements and hand-off", _waiters_rows),
)
"""The issue's targets, in the table's order; the long heartbeat load's comes last."""


def targets(results: dict[str, Any]) -> list[str]:
    """The targets' table: every figure from ``results`` alone, a row per target met, not met, or not measured.

    A section of results that is absent, or says it was skipped, gives its target's row
    "not measured in this run": a run of one section alone judges only that one.
    """
    rows: list[TargetRow] = []
    for goal in (*TARGETS, LONG_HEARTBEAT_LOAD):
        section = results.get(goal.key) if goal.key is not None else None
        if section is None or (isinstance(section, dict) and "skipped" in section):
            rows.append(TargetRow(goal.target, NOT_MEASURED, None))
        else:
            rows += goal.rows(section, results)
    met = sum(1 for row in rows if row.met)
    judged = sum(1 for row in rows if row.met is not None)
    return [
        f"Each target is a ratio or a bound the library set itself, judged on the figures of the run above alone: "
        f"{met} of {judged} met, {len(rows) - judged} not measured in this run.",
        "",
        *_table(
            ["target", "measured in this run", "met / **not met**"],
            [[row.target, row.measured, _verdict(row.met)] for row in rows],
        ),
    ]


def _meta(meta: dict[str, Any]) -> list[str]:
    return [
        f"Measured {meta['date']} on {meta['cpu']} ({meta['cpus']} CPUs), {meta['os']}; Python {meta['python']}, "
        f"psycopg {meta['psycopg']}, postgres-mutex {meta['library']} ({meta['commit']}); PostgreSQL "
        f"{meta['server_version']} ({meta['server']}). `{meta['command']}`, {meta['seconds']:.0f} s"
        f"{' (quick: small sizes, figures are rough)' if meta['quick'] else ''}."
        + (f" {meta['note']}" if meta.get("note") else "")
    ]


def _peers(peers: dict[str, Any]) -> list[str]:
    if "skipped" in peers:
        return [f"Not measured: {peers['skipped']}."]
    return peers_report.lines(peers)


def sections(results: dict[str, Any]) -> dict[str, list[str]]:
    """Markdown lines per section name (after a run of one section alone: the meta, that section and the peers)."""
    # The targets come first: they are what a reader asks of the run before any detail.
    out: dict[str, list[str]] = {"meta": _meta(results["meta"]), "targets": targets(results)}
    if "latency" not in results:
        if "waiters" in results:
            out["waiters"] = _waiters(results["waiters"])
        if "rwlocks" in results:
            out["rwlocks"] = _rwlocks(results["rwlocks"])
        if "table_load" in results:
            out["table_load"] = _table_load(results["table_load"])
        out["peers"] = _peers(results["peers"])
        return out

    latency = results["latency"]
    rows = []
    for name, label in LATENCY_LABELS.items():
        figures = latency[name]
        rows.append(
            [
                label,
                _ms(figures["median_ms"]),
                _ms(figures["p99_ms"]),
                _x(figures["ratio_to_select_1"]),
                f"{figures['client_cpu_us']:.0f} µs",
            ]
        )
    n = latency["select_1"]["n"]
    out["latency"] = [
        f"One connection each, {n} operations per row, interleaved rounds after a warm-up.",
        "",
        *_table(["operation", "median", "p99", "ratio to `SELECT 1`", "client CPU / op"], rows),
    ]

    goal = results["target"]
    rows = []
    for flavour in ("sync", "async"):
        figures = goal[flavour]
        verdict = "met" if figures["met"] else "**not met**"
        rows.append(
            [
                flavour,
                _ms(figures["mutex_ms"]),
                f"{_x(figures['to_bare_prepared'])}: {verdict}",
                _x(figures["to_bare_unprepared"]),
                _x(figures["to_prefixed"]),
            ]
        )
    header = [
        "Mutex cycle",
        "median",
        f"ratio to bare, psycopg defaults (target ≤ {goal['target']}x)",
        "ratio to bare, never prepared",
        "ratio to as sent behind a pooler",
    ]
    out["target"] = [
        *_table(header, rows),
        "",
        f"With `reclaim_disconnected_after` the sync cycle costs {_x(goal['reclaim_to_plain'])} the cycle without "
        "it, measured in the same rounds: the row names the holder's session in the same statements.",
    ]

    out["fastpath"] = _fastpath(results["fastpath"])

    kept = results["history"]
    rows = []
    for label, name, baseline, ratio in (
        ("**Mutex cycle, sync**: `with mutex.acquire()`, table without a history", "cycle", None, None),
        ("the same, table with a history", "cycle_history", "the cycle without", kept["cycle_ratio"]),
        (
            f"the same with a history, its acquire removing {kept['sweep_rows']} expired history rows",
            "cycle_sweep",
            "the cycle with a history, nothing to remove",
            kept["sweep_ratio"],
        ),
        ("`mutex.heartbeat()` of a held lock, table without a history", "heartbeat", None, None),
        ("the same, table with a history", "heartbeat_history", "the heartbeat without", kept["heartbeat_ratio"]),
    ):
        figures = kept[name]
        rows.append(
            [
                label,
                _ms(figures["median_ms"]),
                _ms(figures["p99_ms"]),
                "1 (baseline)" if ratio is None else f"{_x(ratio)} {baseline}",
                f"{figures['client_cpu_us']:.0f} µs",
            ]
        )
    out["history"] = [
        f"One process, one connection per table, {kept['cycle']['n']} operations per row, interleaved rounds "
        "after a warm-up.",
        "",
        *_table(["operation", "median", "p99", "ratio", "client CPU / op"], rows),
    ]

    handoff = results["handoff"]
    select_1 = latency["select_1"]["median_ms"]
    rows = []
    for label, figures, ratio in (
        ("Mutex: `acquire(blocking=True)`, woken by the library's listener", handoff, handoff),
        ("Semaphore of 1 permit: the same, a permit row for the lock's", handoff["semaphore"], handoff["semaphore"]),
        ("fair Mutex (`fair=True`): the release hands the row to the waiter", handoff["fair"], handoff["fair"]),
        ("baseline: the same statements on plain psycopg, woken by its own LISTEN", handoff["raw"], None),
    ):
        rows.append(
            [
                label,
                str(figures["handoffs"]),
                _ms(figures["p50_ms"]),
                _ms(figures["p99_ms"]),
                _ms(figures["max_ms"]),
                "1 (baseline)" if ratio is None else f"{_x(ratio['p50_to_raw'])} / {_x(ratio['p99_to_raw'])}",
                _x(figures["p50_ms"] / select_1),
                str(figures["acquired_before_release"]),
            ]
        )
    out["handoff"] = _table(
        [
            "hand-off",
            "count",
            "p50",
            "p99",
            "max",
            "ratio to baseline (p50 / p99)",
            "p50, ratio to `SELECT 1`",
            "acquired before the release began",
        ],
        rows,
    )

    out["waiters"] = _waiters(results["waiters"])

    out["contended"] = _table(
        [
            "lock",
            "processes",
            "hold",
            "cycles/s",
            "ideal N / (hold + floor)",
            "of ideal",
            "share per process",
            "most at once (overlaps)",
        ],
        [
            [
                f"Semaphore of {contended['permits']}"
                if contended.get("permits") is not None
                else "fair Mutex"
                if contended.get("fair")
                else "Mutex",
                str(contended["processes"]),
                f"{contended['hold_ms']:g} ms (measured {contended['hold_measured_ms']} ms)",
                _number(contended["cycles_per_s"]),
                f"{_number(contended['ideal_per_s'])} (floor {_ms(contended['floor_ms'])})",
                f"{contended['of_ideal'] * 100:.0f} %",
                f"{contended['share_min'] * 100:.0f} to {contended['share_max'] * 100:.0f} %",
                f"{contended.get('most_at_once', 1)} ({contended['overlaps']})",
            ]
            for contended in (
                results["contended"],
                results["contended"]["fair_mutex"],
                results["contended"]["semaphore"],
            )
        ],
    )

    out["rwlocks"] = _rwlocks(results["rwlocks"])

    rows = []
    for run in results["ceiling"]:
        rows.append(
            [
                str(run["processes"]),
                _number(run["advisory"]["per_s"]),
                _number(run["insert_delete"]["per_s"]),
                _number(run["mutex"]["per_s"]),
                _x(run["mutex_to_advisory"]),
                " / ".join(
                    f"{run[kind]['client_cpu_us_per_cycle']:.0f}" for kind in ("advisory", "insert_delete", "mutex")
                )
                + " µs",
            ]
        )
    out["ceiling"] = _table(
        [
            "processes",
            "advisory lock + unlock /s",
            "INSERT + DELETE /s",
            "Mutex acquire + release /s",
            "Mutex, ratio to advisory",
            "client CPU per cycle (advisory / INSERT+DELETE / Mutex)",
        ],
        rows,
    )

    many = results["many_locks"]
    server_cpu = many["server_cpu_percent"]
    names = ", ".join(f"`{name}`" for name in many["thread_names"])
    out["many_locks"] = _table(
        ["one process holding", f"{many['locks']:,} locks, heartbeat {many['heartbeat_interval_s']:g} s"],
        [
            ["server connections (`pg_stat_activity`)", str(many["server_connections"])],
            ["connections opened over the process's life", str(many["connections_opened"])],
            ["threads (`threading.active_count()`)", f"{many['threads']}: {names}"],
            [
                "heartbeat statements per interval (round trips counted by a proxy)",
                f"{many['heartbeat_statements_per_interval']:.2f} ({many['heartbeat_statements']} in "
                f"{many['window_intervals']:g} intervals)",
            ],
            [
                "heartbeat period (median time from one round's first statement to the next's)",
                "n/a" if many["heartbeat_period_s"] is None else f"{many['heartbeat_period_s']:.3f} s",
            ],
            [
                "one heartbeat round (every lock renewed once): statements, first sent to last answered",
                "n/a"
                if many["heartbeat_round_ms"] is None
                else f"{many['heartbeat_statements_per_round']:g}, {_ms(many['heartbeat_round_ms'])}",
            ],
            [
                "one heartbeat statement: round trip (median / max), size sent",
                f"{_ms(many['heartbeat_statement_ms'])} / {_ms(many['heartbeat_statement_max_ms'])}, "
                f"{many['heartbeat_statement_bytes'] / 1024:,.1f} KiB",
            ],
            [
                "rows renewed per lock per interval (`n_tup_upd`, approximate: flushed about once a second)",
                f"{many['rows_updated_per_lock_per_interval']:.2f}",
            ],
            ["idle CPU of the process (CPU time / wall time)", f"{many['idle_cpu_percent']:.2f} % of one core"],
            [
                "idle CPU of its server backends",
                "n/a (server not local)" if server_cpu is None else f"{server_cpu:.2f} % of one core",
            ],
            [
                "memory per held lock (RSS delta / locks)",
                f"{many['memory_per_lock_bytes'] / 1024:.1f} KiB "
                f"(RSS {many['rss_before_mib']} MiB before, {many['rss_after_mib']} MiB after)",
            ],
            ["time to take them all, one by one (through the proxy)", f"{many['acquire_all_s']:.2f} s"],
            ["time to release them all", f"{many['release_all_s']:.2f} s"],
            ["still held at the end of the window", f"{many['still_held']:,}"],
            [
                "then a Mutex cycle of one more lock in that process (through the proxy): p50 / p99 / p99.9 / max",
                f"{_ms(many['cycle_while_holding_p50_ms'])} / {_ms(many['cycle_while_holding_p99_ms'])} / "
                f"{_ms(many['cycle_while_holding_p999_ms'])} / {_ms(many['cycle_while_holding_max_ms'])} "
                f"({many['cycles_while_holding']:,} cycles; p99.9 "
                f"{_x(many['cycle_while_holding_p999_ms'] / many['cycle_while_holding_p50_ms'])} its p50, p50 "
                f"{_x(many['cycle_while_holding_p50_ms'] / latency['mutex_sync']['median_ms'])} the Mutex cycle "
                "above)",
            ],
            *(
                [
                    [
                        "the same cycles in that process before it took the locks, holding none: p50 / p99.9 / max",
                        f"{_ms(many['cycle_holding_none_p50_ms'])} / {_ms(many['cycle_holding_none_p999_ms'])} / "
                        f"{_ms(many['cycle_holding_none_max_ms'])} ({many['cycles_holding_none']:,} cycles; p99.9 "
                        f"{_x(many['cycle_holding_none_p999_ms'] / many['cycle_holding_none_p50_ms'])} its p50)",
                    ]
                ]
                if "cycle_holding_none_p50_ms" in many
                else []
            ),
        ],
    )

    out["table_load"] = _table_load(results["table_load"])

    bouncer = results["pgbouncer"]
    if "skipped" in bouncer:
        out["pgbouncer"] = [f"Not measured: {bouncer['skipped']}."]
    else:
        rows = []
        labels = {
            "select_1": "`SELECT 1`",
            "raw_prefixed": "library's acquire + release as it sends them through a pooler (`SET LOCAL` prefix)",
            "mutex_sync": "**Mutex cycle, sync** (dsn mode; prepared on the direct route only)",
        }
        for name, label in labels.items():
            direct, through = bouncer["direct"][name], bouncer["pgbouncer"][name]
            rows.append(
                [
                    label,
                    _ms(direct["median_ms"]),
                    _ms(through["median_ms"]),
                    _x(through["median_ms"] / direct["median_ms"]),
                    _x(through["median_ms"] / bouncer["direct"]["select_1"]["median_ms"]),
                ]
            )
        out["pgbouncer"] = [
            f"PgBouncer {bouncer['version']}, `pool_mode = transaction`, `default_pool_size = "
            f"{bouncer['pool_size']}`; nothing prepared through it; {bouncer['direct']['select_1']['n']} "
            "operations per row.",
            "",
            *_table(
                ["operation", "direct", "through PgBouncer", "ratio to direct", "ratio to `SELECT 1` direct"], rows
            ),
        ]
    out["peers"] = _peers(results["peers"])
    return out


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _bytes(value: int) -> str:
    return f"{value / 2**20:.2f} MiB" if abs(value) >= 2**20 else f"{value / 1024:,.0f} KiB"


def _table_load(load: dict[str, Any]) -> list[str]:
    """Renewals achieved against asked, their HOT share, and the table's and indexes' sizes over the window."""
    sizes, growth = load["sizes"], load["growth"]
    hot = load["hot_share"]
    rows = [
        [
            "renewals asked (locks / interval)",
            f"{load['asked_updates_per_s']:,} rows/s: every lock every {load['heartbeat_interval_s']:g} s",
        ],
        [
            "renewals achieved (`n_tup_upd` over the window)",
            f"**{load['updates_per_s']:,.0f} rows/s**: {load['rounds_per_s']:.2f} rounds/s, every lock every "
            + ("n/a" if not load["rounds_per_s"] else f"{1 / load['rounds_per_s']:.2f} s")
            + f" ({load['updates']:,} updates in {load['window_s']:g} s)",
        ],
        [
            "HOT share of those updates (`n_tup_hot_upd` / `n_tup_upd`)",
            "n/a" if hot is None else f"**{hot * 100:.2f} %** ({load['hot_updates']:,} HOT)",
        ],
    ]
    for kind, label in (
        ("table_bytes", "table (`pg_relation_size`)"),
        ("index_bytes", "indexes (`pg_indexes_size`)"),
        ("total_bytes", "total (`pg_total_relation_size`)"),
    ):
        size, grew = sizes[kind], growth[kind]
        rows.append(
            [
                f"{label}: at the start / after {load['early_s']:g} s / at the end; growth over the first half "
                "/ the last half",
                f"{_bytes(size['start'])} / {_bytes(size['early'])} / {_bytes(size['end'])}; "
                f"{_bytes(grew['first_half'])} / {_bytes(grew['last_half'])}"
                + (": **stopped growing**" if grew["last_half"] <= 0 else ": **still growing**"),
            ]
        )
    dead = load["dead_tuples"]
    server_cpu = load["server_cpu_percent"]
    rows += [
        [
            "dead row versions (`n_dead_tup`): at the start / least / most / at the end of the samples",
            f"{dead['start']:,} / {dead['least']:,} / {dead['most']:,} / {dead['end']:,}",
        ],
        [
            "autovacuum runs in the window (`autovacuum_count`)",
            f"{load['autovacuum_runs']} (last: {load['last_autovacuum'] or 'never'})",
        ],
        ["still held at the end of the window", f"{load['still_held']:,}"],
        [
            "CPU of the process / of its server backends",
            f"{load['client_cpu_percent']:.1f} % / "
            + ("n/a (server not local)" if server_cpu is None else f"{server_cpu:.1f} %")
            + " of one core",
        ],
        ["time to take them all, one by one", f"{load['acquire_all_s']:.1f} s"],
    ]
    settings = load["settings"]
    options = ", ".join(f"`{option}`" for option in settings["reloptions"]) or "none"
    return [
        *_table(
            [
                "one process holding",
                f"{load['locks']:,} locks, heartbeat {load['heartbeat_interval_s']:g} s, for {load['window_s']:g} s",
            ],
            rows,
        ),
        "",
        "Autovacuum in effect: "
        + ", ".join(f"`{name} = {settings[name]}`" for name in settings if name != "reloptions")
        + f"; the table's reloptions: {options}.",
    ]


def _waiters(waiters: dict[str, Any]) -> list[str]:
    """Per count of waiters: what a change of hands cost in statements, and how long it took."""
    rows = []
    for run in waiters["runs"]:
        threads = run["threads"]
        spread = f"{min(threads)}" if min(threads) == max(threads) else f"{min(threads)} to {max(threads)}"
        per = run["statements_per_handoff"]
        ratio = run["p50_to_single"]
        rows.append(
            [
                str(run["waiters"]),
                f"{run['processes']}, {spread}",
                f"{run['handoffs']} ({run['taken_back']})",
                "n/a" if per is None else f"**{per:.2f}**",
                "n/a" if per is None else f"{run['contended_per_handoff']:.2f} / {run['other_per_handoff']:.2f}",
                str(run["heartbeats"]),
                _ms(run["p50_ms"]),
                _ms(run["p99_ms"]),
                _ms(run["max_ms"]),
                "n/a" if ratio is None else f"{_x(ratio)}{'' if ratio <= WAITERS_TARGET else ': **not met**'}",
                str(run["acquired_before_release"]),
            ]
        )
    window = waiters["runs"][0]["window_s"]
    return [
        f"W waiters and one holder take one lock in turn (hold {waiters['hold_ms']:g} ms, release, rest "
        f"{waiters['rest_ms']:g} ms, acquire again), {window:g} s per row after a warm-up; `poll_interval` "
        f"{waiters['poll_interval_s']:g} s (the default), `heartbeat_interval` {waiters['heartbeat_interval_s']:g} s. "
        "Statements are the round trips a proxy counted on every connection of every process.",
        "",
        *_table(
            [
                "waiters",
                "processes, threads each",
                "hand-offs (taken back by the releaser)",
                "statements per hand-off",
                "of which: attempts that found it held / listeners' own",
                "heartbeats",
                "p50",
                "p99",
                "max",
                f"p50, ratio to one waiter (target ≤ {WAITERS_TARGET}x)",
                "acquired before the release began",
            ],
            rows,
        ),
        *_arrival_lines(waiters.get("arrival")),
    ]


def _arrival_lines(order: dict[str, Any] | None) -> list[str]:
    """The fair Mutex's order of arrival, under the waiters' table (`bench.arrival`)."""
    if order is None:
        return []
    return [
        "",
        f"A fair Mutex (`fair=True`), {order['waiters']} waiters each in a process of its own, all blocked in "
        "`acquire()` behind one holder, the queue's order (the tickets their first attempts drew) against the "
        f"order their acquires returned, each holding {order['hold_ms']:g} ms: **{_arrival(order)}**.",
    ]


def _rwlocks(rw: dict[str, Any]) -> list[str]:
    """The read/write locks' tables: each figure beside the Mutex's of the same run."""
    cycle = rw["cycle"]
    cycles = _table(
        ["cycle (uncontended, non-blocking)", "median", "p99", "ratio to the Mutex cycle (median / p99)"],
        [
            [
                label,
                _ms(cycle[name]["median_ms"]),
                _ms(cycle[name]["p99_ms"]),
                "1 (baseline)"
                if name == "mutex"
                else f"{_x(cycle[name]['median_to_mutex'])} / {_x(cycle[name]['p99_to_mutex'])}",
            ]
            for name, label in (
                ("mutex", "Mutex: `with mutex.acquire()`"),
                ("read", "**read**: `with rw.read()`"),
                ("write", "**write**: `with rw.write()`"),
            )
        ],
    )
    handoff = rw["handoff"]
    handoffs = _table(
        ["hand-off (release to the blocked waiter's acquire)", "count", "p50", "p99", "max", "ratio to the Mutex's"],
        [
            [
                label,
                str(handoff[name]["handoffs"]),
                _ms(handoff[name]["p50_ms"]),
                _ms(handoff[name]["p99_ms"]),
                _ms(handoff[name]["max_ms"]),
                "1 (baseline)"
                if name == "mutex"
                else f"{_x(handoff[name]['p50_to_mutex'])} / {_x(handoff[name]['p99_to_mutex'])}",
            ]
            for name, label in (
                ("mutex", "Mutex to a blocked Mutex"),
                ("write_to_read", "**writer** releases, a blocked **reader** gets it"),
                ("read_to_write", "**reader** releases, a blocked **writer** gets it"),
            )
        ],
    )
    contended = rw["contended"]
    rows = []
    for name, label in (("mutex", "Mutex"), ("writers", "RWLock, writers only"), ("mix", "RWLock, a mix")):
        figures = contended[name]
        modes = figures.get("modes") or []
        counts = [
            _count(modes.count(mode), noun) for mode, noun in (("write", "writer"), ("read", "reader")) if mode in modes
        ]
        who = ", ".join(counts) or str(figures["processes"])
        rows.append(
            [
                label,
                who,
                _number(figures["cycles_per_s"]),
                "1 (baseline)" if name == "mutex" else _x(figures["to_mutex"]),
                f"{figures['of_ideal'] * 100:.0f} %",
                f"{figures['share_min'] * 100:.0f} to {figures['share_max'] * 100:.0f} %",
                f"{figures['most_at_once']} ({figures['overlaps']})",
            ]
        )
    hold = contended["mutex"]["hold_ms"]
    contention = _table(
        [
            f"contended, {hold:g} ms holds",
            "processes",
            "cycles/s",
            "ratio to the Mutex",
            "of ideal 1 / (hold + floor)",
            "share per process",
            "most at once (overlaps)",
        ],
        rows,
    )
    starved = rw["starvation"]
    starvation = [
        f"A writer behind a stream of readers: {starved['readers']} reader processes hold the lock on beats "
        f"{starved['hold_s']:g} s apart, staggered, each re-acquiring at once, so the lock is never free of "
        f"readers (at least {starved['readers_holding_at_ask_min']} held whenever the writer asked); a writer "
        f"asked for it {starved['rounds']} times. Its wait over one reader's hold: p50 "
        f"{_x(starved['wait_p50_to_hold'])} ({starved['wait_p50_s']:.3f} s), max {_x(starved['wait_max_to_hold'])} "
        f"({starved['wait_max_s']:.3f} s). Writers are preferred: the bound is one hold plus a hand-off.",
    ]
    return [
        f"One process for the cycles ({cycle['mutex']['n']} operations per row, interleaved rounds after a warm-up), "
        "two for the hand-offs (a writer and a reader, so they alternate), the same window for each contended row.",
        "",
        *cycles,
        "",
        *handoffs,
        "",
        *contention,
        "",
        *starvation,
    ]


def _fastpath(figures: dict[str, Any]) -> list[str]:
    header = ["target", "measured", "verdict"]
    rows = [[row.target, row.measured, _verdict(row.met)] for row in _fastpath_rows(figures, {})]
    return [
        "One process, one lock nobody else takes (`python -m bench.fastpath` measures this section alone): the "
        "library's frames on the stack as a sync cycle enters psycopg's `execute` and its Python-level calls "
        "(`sys.setprofile`), its client CPU against its floor's and the async cycle's wall time against its two "
        "statements', in interleaved rounds; timed with the "
        f"{figures.get('placement', 'client and server left to the scheduler')}.",
        "",
        *_table(header, rows),
    ]


def markdown(results: dict[str, Any], *, markers: bool) -> str:
    titles = {
        "meta": None,
        "targets": TARGETS_TITLE,
        "latency": "Latency, one client",
        "target": "Target: the Mutex cycle against its own statements sent raw",
        "fastpath": "An uncontended cycle's own Python",
        "history": "The lock history's cost",
        "handoff": "Hand-off latency (release to the blocked waiter's acquire)",
        "waiters": WAITERS_TITLE,
        "contended": "Contended throughput (one lock, one semaphore)",
        "rwlocks": RWLOCKS_TITLE,
        "ceiling": "Server ceiling (distinct locks)",
        "many_locks": "Many locks in one process",
        "table_load": TABLE_LOAD_TITLE,
        "pgbouncer": "Through PgBouncer",
        "peers": PEERS_TITLE,
    }
    lines: list[str] = []
    for name, body in sections(results).items():
        if titles[name]:
            lines += [f"## {titles[name]}", ""]
        if markers:
            lines.append(f"<!-- --8<-- [start:{name}] -->")
        lines += body
        if markers:
            lines.append(f"<!-- --8<-- [end:{name}] -->")
        lines.append("")
    return "\n".join(lines)
