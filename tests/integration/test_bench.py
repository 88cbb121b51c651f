"""The bench runner (``python -m bench``) keeps working: a quick run against the suite's server.

Figures are not asserted here (they depend on the machine); behaviour is: the
run finishes, its JSON has every section, no two holders ever overlapped,
many waiters on one lock are counted in statements per hand-off,
one process holding many locks used at most two server connections and one
heartbeat round per interval, of one statement per batch of locks, as the
shared client promises, and the table under heartbeat load is sampled over a
window on a table of its own, dropped at the end. PgBouncer is
measured too where Debian's pgbouncer is installed (in CI it must be).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bench.report import LATENCY_LABELS, SECTIONS, TARGETS_TITLE
from bench.servers import TABLE
from postgres_mutex._state.heartbeat_flows import BATCH
from tests.support.fixtures import ROOT

QUICK_RUN_TIMEOUT = 150.0


@pytest.fixture(scope="module")
def quick_run(dsn: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("bench")
    # The peers have a test of their own (test_bench_peers.py).
    command = [sys.executable, "-m", "bench", "--quick", "--skip-peers", "--dsn", dsn, "--out", str(out)]
    if shutil.which("pgbouncer") is not None or os.environ.get("CI") == "true":
        command.append("--pgbouncer")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=QUICK_RUN_TIMEOUT, check=False)
    assert done.returncode == 0, f"python -m bench failed:\n{done.stderr[-4000:]}"
    return json.loads((out / "bench.json").read_text()), done.stdout, out


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 20)
def test_a_quick_run_reports_every_section(quick_run: tuple[dict[str, Any], str, Path]) -> None:
    results, stdout, out = quick_run
    assert list(results) == list(SECTIONS)
    assert set(results["latency"]) == set(LATENCY_LABELS)
    for figures in results["latency"].values():
        assert figures["n"] > 0
        assert figures["median_ms"] > 0
    assert {"sync", "async"} <= set(results["target"])
    assert results["meta"]["quick"] is True
    assert "skipped" in results["peers"]
    # The table on stdout and the markdown file hold the same sections.
    markdown = (out / "bench.md").read_text()
    for section in SECTIONS:
        assert f"<!-- --8<-- [start:{section}] -->" in markdown
    assert "## Many locks in one process" in stdout
    # The targets table is not a section of the JSON: the report derives it from the others, first after the meta.
    assert markdown.index("[end:meta]") < markdown.index("<!-- --8<-- [start:targets] -->")
    assert markdown.index("[end:targets]") < markdown.index("[start:latency]")
    assert f"## {TARGETS_TITLE}" in stdout
    if shutil.which("pgbouncer") is not None:
        assert "skipped" not in results["pgbouncer"]
        assert results["pgbouncer"]["pgbouncer"]["mutex_sync"]["n"] > 0


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 20)
def test_the_history_is_timed_next_to_the_same_operations_without_it(
    quick_run: tuple[dict[str, Any], str, Path], dsn: str
) -> None:
    results, stdout, _ = quick_run
    kept = results["history"]
    for name in ("cycle", "cycle_history", "cycle_sweep", "heartbeat", "heartbeat_history"):
        assert kept[name]["n"] > 0
        assert kept[name]["median_ms"] > 0
    for ratio, measure, baseline in (
        ("cycle_ratio", "cycle_history", "cycle"),
        ("heartbeat_ratio", "heartbeat_history", "heartbeat"),
        ("sweep_ratio", "cycle_sweep", "cycle_history"),
    ):
        assert kept[ratio] == pytest.approx(kept[measure]["median_ms"] / kept[baseline]["median_ms"], rel=0.01)
    assert kept["expired_left"] == 0, "each acquire removed the expired rows put in its way"
    assert "## The lock history's cost" in stdout
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute(
            "SELECT to_regclass('mutex_lock_bench_hist'), to_regclass('mutex_lock_bench_hist_history')"
        ).fetchone()
    assert left == (None, None), "the bench drops its tables"
    with psycopg.connect(dsn, autocommit=True) as conn:
        queue = conn.execute("SELECT to_regclass(%s)", (f"{TABLE}_queue",)).fetchone()
    assert queue == (None,), "the bench drops its fair locks' queue"


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 20)
def test_no_two_holders_ever_overlapped(quick_run: tuple[dict[str, Any], str, Path]) -> None:
    results = quick_run[0]
    assert results["handoff"]["handoffs"] > 0
    assert results["handoff"]["acquired_before_release"] == 0
    assert results["handoff"]["raw"]["acquired_before_release"] == 0
    assert results["contended"]["cycles"] > 0
    assert results["contended"]["overlaps"] == 0
    assert results["handoff"]["semaphore"]["handoffs"] > 0
    assert results["handoff"]["semaphore"]["acquired_before_release"] == 0
    assert results["contended"]["semaphore"]["cycles"] > 0
    assert results["contended"]["semaphore"]["overlaps"] == 0
    assert results["contended"]["semaphore"]["most_at_once"] <= results["contended"]["semaphore"]["permits"]
    assert results["handoff"]["fair"]["handoffs"] > 0
    assert results["handoff"]["fair"]["acquired_before_release"] == 0
    assert results["contended"]["fair_mutex"]["cycles"] > 0
    assert results["contended"]["fair_mutex"]["overlaps"] == 0
    for run in results["ceiling"]:
        assert all(run[kind]["cycles"] > 0 for kind in ("advisory", "insert_delete", "mutex"))


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 20)
def test_read_write_locks_are_measured_beside_the_mutex_and_a_writer_gets_past_a_stream_of_readers(
    quick_run: tuple[dict[str, Any], str, Path],
) -> None:
    results, stdout, _ = quick_run
    rw = results["rwlocks"]
    for name in ("mutex", "read", "write"):
        assert rw["cycle"][name]["n"] > 0
    assert rw["cycle"]["read"]["median_to_mutex"] == pytest.approx(
        rw["cycle"]["read"]["median_ms"] / rw["cycle"]["mutex"]["median_ms"], rel=0.01
    )
    for name in ("write_to_read", "read_to_write"):
        assert rw["handoff"][name]["handoffs"] > 0, "hand-offs alternate: writer to reader, reader to writer"
        assert rw["handoff"][name]["acquired_before_release"] == 0
    assert rw["contended"]["mutex"]["cycles_per_s"] == results["contended"]["cycles_per_s"], "the same run's Mutex"
    for name in ("writers", "mix"):
        assert rw["contended"][name]["cycles"] > 0
        assert rw["contended"][name]["overlaps"] == 0, "no section beside a writer's"
    assert rw["contended"]["writers"]["most_at_once"] == 1
    starved = rw["starvation"]
    assert starved["rounds"] >= 1
    # The stream was continuous: the writer always asked while readers held, and still got in.
    assert starved["readers_holding_at_ask_min"] >= 1
    assert starved["wait_max_s"] is not None
    assert "## Read/write locks, beside the Mutex" in stdout


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 20)
def test_many_locks_share_two_connections_and_one_heartbeat(quick_run: tuple[dict[str, Any], str, Path]) -> None:
    many = quick_run[0]["many_locks"]
    assert many["still_held"] == many["locks"]
    assert 1 <= many["server_connections"] <= 2, many["connection_names"]
    assert many["connections_opened"] <= 2
    # One round per interval: in a window of k intervals, at most k + 1 (one may fall on each edge),
    # of one statement per batch of locks.
    assert 1 <= many["heartbeat_rounds"] <= many["window_intervals"] + 1
    assert many["heartbeat_statements_per_round"] <= math.ceil(many["locks"] / BATCH)
    # The library's threads do not grow with the locks held.
    assert many["threads"] <= 5, many["thread_names"]


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 20)
def test_many_waiters_on_one_lock_are_counted_in_statements_per_hand_off(
    quick_run: tuple[dict[str, Any], str, Path],
) -> None:
    results, stdout, _ = quick_run
    section = results["waiters"]
    assert section["poll_interval_s"] > 0
    runs = section["runs"]
    assert [run["waiters"] for run in runs] == sorted(run["waiters"] for run in runs)
    assert runs[0]["waiters"] == 1
    for run in runs:
        # One holder and the waiters, each a thread of its own, spread over the processes.
        assert sum(run["threads"]) == run["waiters"] + 1
        assert len(run["threads"]) == run["processes"]
        assert run["handoffs"] > 0
        assert run["acquired_before_release"] == 0
        # Each change of hands costs at least the winning acquire and the release, counted by the proxy.
        assert run["statements_per_handoff"] >= 2
        assert run["contended_per_handoff"] >= 0
        assert run["p50_ms"] > 0
        assert run["p99_ms"] >= run["p50_ms"]
        assert run["p50_to_single"] == pytest.approx(run["p50_ms"] / runs[0]["p50_ms"], rel=0.01)
    assert runs[0]["p50_to_single"] == 1.0
    assert "## Many waiters on one lock" in stdout


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 20)
def test_a_fair_mutexs_waiters_in_many_processes_acquire_in_the_order_they_came(
    quick_run: tuple[dict[str, Any], str, Path],
) -> None:
    order = quick_run[0]["waiters"]["arrival"]
    assert order["waiters"] >= 3
    assert order["pairs"] == order["rounds"] * order["waiters"] * (order["waiters"] - 1) // 2
    assert order["overtakes"] == 0


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 20)
def test_the_table_under_heartbeat_load_is_sampled_on_a_table_of_its_own(
    quick_run: tuple[dict[str, Any], str, Path], dsn: str
) -> None:
    results, stdout, _ = quick_run
    load = results["table_load"]
    assert load["still_held"] == load["locks"], "no lock lost while renewed every 0.1 s"
    assert load["updates"] > 0
    assert 0 <= load["hot_updates"] <= load["updates"]
    assert load["hot_share"] == pytest.approx(load["hot_updates"] / load["updates"], abs=1e-4)
    assert load["rounds_per_s"] == pytest.approx(load["updates_per_s"] / load["locks"], rel=0.01)
    samples = load["samples"]
    assert len(samples) >= 3, "the start, the middle and the end at least"
    assert [sample["t"] for sample in samples] == sorted(sample["t"] for sample in samples)
    # Counters only grow; a sample's sizes are those of a table that exists.
    assert [sample["upd"] for sample in samples] == sorted(sample["upd"] for sample in samples)
    assert all(sample["table_bytes"] > 0 and sample["index_bytes"] > 0 for sample in samples)
    for kind in ("table_bytes", "index_bytes", "total_bytes"):
        grew = load["growth"][kind]
        assert grew["first_half"] + grew["last_half"] == load["sizes"][kind]["end"] - load["sizes"][kind]["start"]
    settings = load["settings"]
    assert {"autovacuum", "autovacuum_naptime", "autovacuum_vacuum_threshold"} <= set(settings)
    assert "fillfactor=50" in settings["reloptions"], "the table is made as LockTable.create makes it"
    assert "## The table under long heartbeat load" in stdout
    assert "Autovacuum in effect:" in stdout
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute("SELECT to_regclass('mutex_lock_bench_load')").fetchone()
    assert left == (None,), "the bench drops its table"


def test_the_fast_paths_cpu_is_timed_with_the_client_and_the_server_apart(dsn: str) -> None:
    # Else a client's CPU per round trip depends on whether its backend landed on its own CPU.
    from bench.fastpath import apart

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        assert os.environ.get("CI") != "true", "CI's machine has two CPUs: the placement must be tried there"
        pytest.skip("one CPU: nothing to place apart")
    with psycopg.connect(dsn, autocommit=True) as conn:
        backend = conn.info.backend_pid
        before = os.sched_getaffinity(0), os.sched_getaffinity(backend)
        with apart(conn, local_server=False) as placement:
            assert placement == "client and server left to the scheduler (a server of your own)"
            assert (os.sched_getaffinity(0), os.sched_getaffinity(backend)) == before
        with apart(conn, local_server=True) as placement:
            if os.geteuid() not in (0, os.stat(f"/proc/{backend}").st_uid):  # another user's server: root's to place
                assert "no permission" in placement
                assert (os.sched_getaffinity(0), os.sched_getaffinity(backend)) == before
            else:
                assert placement == f"client on CPU {cpus[0]} and the server's backends on CPU " + ", ".join(
                    map(str, cpus[1:])
                )
                assert os.sched_getaffinity(0) == {cpus[0]}
                assert os.sched_getaffinity(backend) == set(cpus[1:])
                conn.execute("SELECT 1")
        assert (os.sched_getaffinity(0), os.sched_getaffinity(backend)) == before
