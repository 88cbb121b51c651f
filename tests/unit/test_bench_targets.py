"""The bench's targets table judges one run's results against the issue's bounds, and nothing else.

Fed results dicts by hand (no server, no run): each target is met on its bound and not met just past
it, and a section the run did not measure, or measured at another size than the target names, gives
"not measured in this run" rather than a verdict.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench import report
from bench.report import NOT_MEASURED, TARGETS_TITLE, sections, targets


def verdicts(results: dict[str, Any], **kwargs: Any) -> dict[str, tuple[str, str]]:
    """Each row of the targets table: its target to (measured, verdict)."""
    rows = [line for line in targets(results, **kwargs) if line.startswith("| ") and not line.startswith("| target")]
    cells = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in rows]
    return {target: (measured, verdict) for target, measured, verdict in cells}


def row(results: dict[str, Any], starts: str, **kwargs: Any) -> tuple[str, str]:
    found = [value for target, value in verdicts(results, **kwargs).items() if target.startswith(starts)]
    assert len(found) == 1, f"one row starting {starts!r}, found {len(found)}"
    return found[0]


META = {
    "date": "2026-12-05 23:00 UTC",
    "cpu": "a CPU",
    "cpus": 2,
    "os": "Linux",
    "python": "3.11",
    "psycopg": "3.3",
    "library": "0.2.0",
    "commit": "abcdef0",
    "server_version": "18",
    "server": "throwaway",
    "command": "python -m bench --only-waiters",
    "quick": False,
    "note": "",
    "seconds": 60.0,
}


def latency(floor: float, sync: float, async_: float, async_floor: float | None = None) -> dict[str, Any]:
    return {
        "insert_delete": {"median_ms": floor},
        "insert_delete_async": {"median_ms": floor if async_floor is None else async_floor},
        "mutex_sync": {"median_ms": sync},
        "mutex_async": {"median_ms": async_},
    }


def ceiling_run(processes: int, mutex: float, insert_delete: float) -> dict[str, Any]:
    return {"processes": processes, "mutex": {"per_s": mutex}, "insert_delete": {"per_s": insert_delete}}


def contended(of_ideal: float, share_min: float, share_max: float, processes: int = 4) -> dict[str, Any]:
    return {
        "processes": processes,
        "hold_ms": 2.0,
        "floor_ms": 0.4,
        "cycles_per_s": of_ideal * 400,
        "ideal_per_s": 400.0,
        "of_ideal": of_ideal,
        "share_min": share_min,
        "share_max": share_max,
    }


def many_locks(
    p50: float = 1.0, p999: float = 3.0, top: float = 19.9, cpu: float | None = 1.9, locks: int = 10_000
) -> dict[str, Any]:
    return {
        "locks": locks,
        "heartbeat_interval_s": 1.0,
        "server_cpu_percent": cpu,
        "cycle_while_holding_p50_ms": p50,
        "cycle_while_holding_p999_ms": p999,
        "cycle_while_holding_max_ms": top,
    }


def waiters_run(waiters: int, per: float, p50: float, single_p50: float) -> dict[str, Any]:
    return {
        "waiters": waiters,
        "processes": min(waiters + 1, 8),
        "threads": [1],
        "window_s": 10.0,
        "handoffs": 100,
        "taken_back": 0,
        "statements": int(per * 100),
        "statements_per_handoff": per,
        "contended_per_handoff": 1.0,
        "other_per_handoff": 1.0,
        "heartbeats": 0,
        "p50_ms": p50,
        "p99_ms": p50 * 2,
        "max_ms": p50 * 3,
        "p50_to_single": round(p50 / single_p50, 3),
        "acquired_before_release": 0,
    }


def waiters(*figures: tuple[int, float, float]) -> dict[str, Any]:
    """``(waiters, statements per hand-off, p50 ms)`` per run, the first being the single waiter's."""
    single = figures[0][2]
    return {
        "hold_ms": 2.0,
        "rest_ms": 1.0,
        "heartbeat_interval_s": 5.0,
        "poll_interval_s": 1.0,
        "runs": [waiters_run(n, per, p50, single) for n, per, p50 in figures],
    }


def test_a_run_of_one_section_alone_shows_the_targets_first_and_the_others_not_measured() -> None:
    results = {
        "meta": META,
        "waiters": waiters((1, 4.0, 2.0), (10, 4.2, 2.2), (100, 4.6, 2.5)),
        "peers": {"skipped": "run without --skip-peers to measure them"},
    }
    assert list(sections(results))[:2] == ["meta", "targets"]
    text = report.markdown(results, markers=True)
    assert f"## {TARGETS_TITLE}" in text
    assert "<!-- --8<-- [start:targets] -->" in text
    assert "<!-- --8<-- [end:targets] -->" in text
    assert text.index("[end:meta]") < text.index("[start:targets]") < text.index("[start:waiters]")

    found = verdicts(results)
    for starts in ("Mutex cycle", "server ceiling", "contended", "holding", "under long heartbeat load"):
        assert row(results, starts) == (NOT_MEASURED, "n/a")
    assert row(results, "100 waiters on one lock: a release")[1] == "met"
    assert sum(1 for _, verdict in found.values() if verdict != "n/a") == 2


def test_a_skipped_section_is_not_measured() -> None:
    results = {"meta": META, "pgbouncer": {"skipped": "x"}, "ceiling": []}
    assert row(results, "server ceiling on distinct locks, 1 process")[1] == "n/a"
    assert row(results, "server ceiling on distinct locks, 4 processes")[0].startswith(NOT_MEASURED)


@pytest.mark.parametrize(
    ("sync", "async_", "sync_verdict", "async_verdict"),
    [(1.15, 1.3, "met", "met"), (1.16, 1.31, "**not met**", "**not met**"), (1.1, 1.4, "met", "**not met**")],
)
def test_the_cycles_are_judged_against_the_floor(
    sync: float, async_: float, sync_verdict: str, async_verdict: str
) -> None:
    results = {"latency": latency(1.0, sync, async_)}
    measured, verdict = row(results, "sync Mutex cycle")
    assert verdict == sync_verdict
    assert f"{sync:.2f}x" in measured
    assert row(results, "async Mutex cycle")[1] == async_verdict


def test_the_async_cycle_is_judged_against_its_own_floor_and_shown_beside_the_sync_one() -> None:
    results = {"latency": latency(1.0, 1.1, 1.6, async_floor=1.25)}
    measured, verdict = row(results, "async Mutex cycle")
    assert verdict == "met", "1.6 / 1.25 = 1.28x"
    assert "1.28x" in measured
    assert "1.60x the sync floor" in measured


def test_the_ceiling_is_judged_with_one_and_four_processes_and_only_those() -> None:
    results = {"ceiling": [ceiling_run(1, 800, 1000), ceiling_run(4, 790, 1000)]}
    assert row(results, "server ceiling on distinct locks, 1 process")[1] == "met"
    assert row(results, "server ceiling on distinct locks, 4 processes")[1] == "**not met**"

    quick = {"ceiling": [ceiling_run(2, 900, 1000)]}
    for starts in ("server ceiling on distinct locks, 1 process", "server ceiling on distinct locks, 4 processes"):
        measured, verdict = row(quick, starts)
        assert verdict == "n/a"
        assert measured.startswith(NOT_MEASURED)
        assert "with 2 processes instead" in measured


@pytest.mark.parametrize(
    ("of_ideal", "low", "high", "throughput", "fairness"),
    [
        (0.8, 0.125, 0.5, "met", "met"),
        (0.79, 0.25, 0.25, "**not met**", "met"),
        (0.9, 0.12, 0.3, "met", "**not met**"),
        (0.9, 0.2, 0.51, "met", "**not met**"),
    ],
)
def test_contention_is_judged_on_the_ideal_and_on_each_process_s_share(
    of_ideal: float, low: float, high: float, throughput: str, fairness: str
) -> None:
    results = {"contended": contended(of_ideal, low, high)}
    assert row(results, "contended throughput")[1] == throughput
    assert row(results, "no process starved")[1] == fairness


def test_many_locks_are_judged_on_the_cycle_beside_them_and_the_heartbeat_s_server_time() -> None:
    met = {"many_locks": many_locks(p50=1.0, p999=3.0, top=19.9, cpu=0.49)}
    assert row(met, "holding 10,000 locks: a concurrent cycle's p99.9")[1] == "met"
    assert row(met, "holding 10,000 locks: a concurrent cycle's max")[1] == "met"
    assert row(met, "holding 10,000 locks: their heartbeat")[1] == "met"

    missed = {"many_locks": many_locks(p50=1.0, p999=3.1, top=20.0, cpu=0.5)}
    assert row(missed, "holding 10,000 locks: a concurrent cycle's p99.9")[1] == "**not met**"
    assert row(missed, "holding 10,000 locks: a concurrent cycle's max")[1] == "**not met**"
    measured, verdict = row(missed, "holding 10,000 locks: their heartbeat")
    assert verdict == "**not met**"
    assert "5.000 ms per 1 s" in measured

    remote = {"many_locks": many_locks(cpu=None)}
    assert row(remote, "holding 10,000 locks: their heartbeat")[0].startswith(NOT_MEASURED)

    fewer = {"many_locks": many_locks(p999=30.0, locks=200)}
    for starts in ("holding 10,000 locks: a concurrent", "holding 10,000 locks: their heartbeat"):
        for target, (measured, verdict) in verdicts(fewer).items():
            if target.startswith(starts):
                assert verdict == "n/a"
                assert NOT_MEASURED in measured


def test_many_waiters_are_judged_on_statements_that_do_not_grow_and_on_the_hand_off() -> None:
    met = {"waiters": waiters((1, 4.0, 2.0), (10, 4.4, 2.5), (100, 4.8, 3.0))}
    measured, verdict = row(met, "100 waiters on one lock: a release")
    assert verdict == "met"
    assert "1: 4.00" in measured
    assert "10: 4.40" in measured
    assert "100: 4.80" in measured
    assert row(met, "100 waiters on one lock: hand-off p50")[1] == "met"

    missed = {"waiters": waiters((1, 4.0, 2.0), (10, 4.4, 2.5), (100, 4.9, 3.02))}
    assert row(missed, "100 waiters on one lock: a release")[1] == "**not met**"
    assert row(missed, "100 waiters on one lock: hand-off p50")[1] == "**not met**"

    quick = {"waiters": waiters((1, 4.0, 2.0), (4, 4.0, 2.0))}
    measured, verdict = row(quick, "100 waiters on one lock: a release")
    assert verdict == "n/a"
    assert f"100: {NOT_MEASURED}" in measured
    assert "4: 4.00" in measured
    assert row(quick, "100 waiters on one lock: hand-off p50") == (NOT_MEASURED, "n/a")


def arrival(waiters: int, overtakes: int) -> dict[str, Any]:
    return {"waiters": waiters, "rounds": 2, "hold_ms": 2.0, "pairs": waiters * (waiters - 1), "overtakes": overtakes}


def test_a_fair_mutex_is_judged_on_overtakes_among_ten_waiters_and_only_then() -> None:
    section = waiters((1, 4.0, 2.0), (10, 5.0, 2.5), (100, 8.0, 3.0))
    target = "fair Mutex: waiters acquire in the order they came"
    assert row({"waiters": section}, target) == (NOT_MEASURED, "n/a")
    measured, verdict = row({"waiters": {**section, "arrival": arrival(10, 0)}}, target)
    assert verdict == "met"
    assert "0 overtakes in 90 pairs of waiters (10 waiters, 2 rounds)" in measured
    assert row({"waiters": {**section, "arrival": arrival(10, 1)}}, target)[1] == "**not met**"
    measured, verdict = row({"waiters": {**section, "arrival": arrival(3, 0)}}, target)
    assert verdict == "n/a"
    assert "fewer than 10 waiters" in measured


def table_load(*, hot: float | None = 1.0, table: int = 0, index: int = 0, locks: int = 10_000) -> dict[str, Any]:
    return {
        "locks": locks,
        "window_s": 180.0,
        "hot_share": hot,
        "growth": {
            "table_bytes": {"first_half": 8192, "last_half": table},
            "index_bytes": {"first_half": 0, "last_half": index},
            "total_bytes": {"first_half": 8192, "last_half": table + index},
        },
    }


def test_the_long_heartbeat_load_is_judged_on_hot_updates_and_sizes_that_stop_growing() -> None:
    met = {"table_load": table_load(hot=0.99)}
    assert row(met, "under long heartbeat load (10,000 locks): ≥ 99%")[1] == "met"
    assert row(met, "under long heartbeat load (10,000 locks): the table's")[1] == "met"

    missed = {"table_load": table_load(hot=0.989, index=8192)}
    assert row(missed, "under long heartbeat load (10,000 locks): ≥ 99%")[1] == "**not met**"
    assert row(missed, "under long heartbeat load (10,000 locks): the table's")[1] == "**not met**"

    fewer = {"table_load": table_load(locks=500)}
    for starts in ("under long heartbeat load (10,000 locks): ≥ 99%", "under long heartbeat load (10,000 locks): the"):
        measured, verdict = row(fewer, starts)
        assert verdict == "n/a"
        assert NOT_MEASURED in measured
    assert row({}, "under long heartbeat load") == (NOT_MEASURED, "n/a")
