"""Scenarios 14 to 16: the nemesis (chaos/nemesis.py), and the tests of its schedule and checker.

Several worker processes contend for a few locks with the chaos suite's short thresholds, each
critical section incrementing a ledger under ``mutex.fence``, while the nemesis freezes holders
across the lease and stale thresholds, cuts and heals their network, resets their connections,
restarts PostgreSQL and kills them. The checker then counts, from what happened: overlaps of
sections whose holder still believed it held the lock, lost or doubled ledger updates, orphaned
rows, losses told late; the run's seed replays its schedule (``NEMESIS_SEED=...``).

- 14: a bounded run (``NEMESIS_SECONDS``, default 100 s), part of CI; it must find nothing.
- 15: the same nemesis against a deliberately broken worker (a lease one heartbeat interval past
  the stale threshold, monkeypatched in the worker process only: see
  ``chaos.nemesis_worker.break_the_lease``); it must find the overlaps, and stops once it has
  (``NEMESIS_BROKEN_SECONDS``, at most 300 s: the schedule is random, and a catch has taken
  from seconds to over a minute).
- 16: a long run on demand (``pytest -m slow``; ``NEMESIS_LONG_SECONDS``, default 600 s).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from toxiproxy import Toxiproxy

from chaos.conftest import Chaos
from chaos.harness import HEARTBEAT, LEASE, STALE, TIMING, Net, Report
from chaos.nemesis import (
    BANDS,
    NOTICE_ALLOWANCE,
    QUIET_END,
    QUIET_START,
    RESTART_SPACING,
    Applied,
    Fault,
    History,
    Nemesis,
    Verdict,
    check,
    make_schedule,
    new_seed,
    sections_of,
)
from chaos.nemesis_worker import LEDGER, RECLAIM_ENV
from postgres_mutex import MutexClient
from tests.support.postgres_server import PostgresServer

WORKERS = 5
LOCKS = 3
RECLAIM_DISCONNECTED_AFTER = 1.5
"""For the workers that opt in: well inside the chaos suite's stale threshold (3 s), three heartbeats at least."""


# -- the run -------------------------------------------------------------------------------------


class Run:
    """One nemesis run against ``server``: the lock table and the ledger, the workers, the verdict."""

    def __init__(self, server: PostgresServer, locks: list[str], directory: Path, seed: int) -> None:
        self.server = server
        self.locks = locks
        self.directory = directory
        self.seed = seed
        with MutexClient(server.dsn()) as client:
            client.table().create()
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE TABLE IF NOT EXISTS {LEDGER} (id text PRIMARY KEY, counter bigint, token bigint)")
            for lock in locks:
                conn.execute(
                    f"INSERT INTO {LEDGER} (id, counter) VALUES (%s, 0) "  # noqa: S608
                    "ON CONFLICT (id) DO UPDATE SET counter = 0, token = NULL",
                    (lock,),
                )

    def _query(self, query: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        # A connection of its own each time: the nemesis restarts the server.
        with psycopg.connect(self.server.dsn(), autocommit=True, connect_timeout=3) as conn:
            return conn.execute(query, params).fetchall()

    def holders(self) -> dict[str, str]:
        try:
            return dict(self.rows_left())
        except psycopg.OperationalError:
            return {}  # restarting: the fault picks a worker by its own draw

    def rows_left(self) -> list[tuple[str, str]]:
        found = self._query("SELECT lock_name, instance_id FROM mutex_lock WHERE lock_name = ANY(%s)", (self.locks,))
        return [(str(lock), str(holder)) for lock, holder in found]

    def ledger(self) -> dict[str, int]:
        found = self._query(f"SELECT id, counter FROM {LEDGER} WHERE id = ANY(%s)", (self.locks,))  # noqa: S608
        return {str(lock): int(counter) for lock, counter in found}

    def nemesis(self, net: Any, env: dict[str, str] | None = None) -> Nemesis:
        return Nemesis(
            directory=self.directory,
            locks=self.locks,
            workers=WORKERS,
            seed=self.seed,
            net=net,
            holders=self.holders,
            restart=self.server.restart,
            env=env,
        )

    def verdict(self, nemesis: Nemesis, *, rows_left: list[tuple[str, str]] | None = None) -> Verdict:
        return check(
            nemesis.history(),
            nemesis.applied,
            seed=self.seed,
            ledger=self.ledger(),
            rows_left=self.rows_left() if rows_left is None else rows_left,
        )

    def sweep(self) -> float:
        """Take and release every lock once (a killed worker's row is reclaimed): how long it took.

        On a client of its own, opened now: a client whose idle connection a restart closed fails
        its first acquire (the library's table inspection is not retried; see the report).
        """
        started = time.monotonic()
        with MutexClient(self.server.dsn()) as client:
            for lock in self.locks:
                sweeper = client.mutex(lock, instance_id="sweeper", **TIMING)
                with sweeper.acquire(blocking=True, timeout=STALE * 3) as acquired:
                    assert acquired
        return time.monotonic() - started

    def keep(self, nemesis: Nemesis, verdict: Verdict, name: str) -> Path:
        """The schedule, what was applied and the verdict, next to the workers' logs (for a failing seed)."""
        path = self.directory / f"{name}.json"
        path.write_text(
            json.dumps(
                {
                    "seed": self.seed,
                    "applied": [asdict(a) for a in nemesis.applied],
                    "verdict": {**verdict.figures(), "overlaps": [str(pair) for pair in verdict.overlaps]},
                    "late_losses": verdict.late_losses,
                    "losses_within_allowance": verdict.losses_within_allowance,
                    "notices": verdict.notices,
                    "orphaned_rows": verdict.orphaned_rows,
                },
                indent=1,
            )
        )
        return path


def report_dir() -> Path:
    return Path(os.environ.get("CHAOS_REPORT_DIR") or Path(__file__).parent / "report")


def logs_dir(name: str) -> Path:
    """Where a run keeps its workers' logs and its verdict: next to the report (kept by CI), the last run's only."""
    directory = report_dir() / name
    shutil.rmtree(directory, ignore_errors=True)
    return directory


def nemesis_run(own_pg: PostgresServer, chaos: Chaos, seconds: float, name: str) -> None:
    seed = new_seed()
    print(f"nemesis seed {seed} (replay: NEMESIS_SEED={seed})")  # shown with -s, and on a failure
    locks = [f"{chaos.lock_name}-{n}" for n in range(LOCKS)]
    run = Run(own_pg, locks, logs_dir(name), seed)
    # Half the workers name their sessions (reclaim_disconnected_after): a killed one is reclaimed
    # early, a frozen or cut-off one is in doubt before that; the checker holds both to the same rules.
    nemesis = run.nemesis(
        lambda name: chaos.net(name, server=own_pg), env={RECLAIM_ENV: str(RECLAIM_DISCONNECTED_AFTER)}
    )
    schedule = make_schedule(seed, seconds=seconds, locks=LOCKS)
    ran = nemesis.run(schedule, seconds=seconds)
    rows_at_stop = run.rows_left()
    verdict = run.verdict(nemesis, rows_left=rows_at_stop)
    swept_in = run.sweep()
    kept = run.keep(nemesis, verdict, "nemesis-verdict")
    # The chaos fixture counts the overlaps again, with the same checker, for the report's column.
    for found in sections_of(nemesis.history(), nemesis.applied):
        chaos.sections.add(found)
    chaos.record(
        ran_s=ran,
        workers=WORKERS,
        locks=LOCKS,
        **verdict.figures(),
        workers_that_did_not_stop=len(nemesis.did_not_stop()),
        every_lock_taken_again_after_s=swept_in,
    )
    failing = f"seed {seed} (replay: NEMESIS_SEED={seed}); details: {kept}; logs: {run.directory}"
    assert verdict.overlaps == [], f"two believing holders at once: {verdict.overlaps[:3]}; {failing}"
    assert verdict.lost_updates == 0, failing
    assert verdict.doubled_updates == 0, failing
    assert verdict.token_order_violations == 0, failing
    assert verdict.orphaned_rows == [], failing
    assert verdict.late_losses == [], failing
    assert nemesis.did_not_stop() == [], failing
    # The run did what it is for: leases expired and were taken over, under every kind of fault
    # the schedule drew more than twice (a rarer one may have found its target busy every time).
    assert verdict.reclaims >= min(3, seconds // 30), f"too few reclaims to have tested anything: {verdict.summary()}"
    assert verdict.committed >= seconds // 10, verdict.summary()
    drawn = Counter(fault.kind for fault in schedule)
    assert set(verdict.faults) >= {kind for kind, n in drawn.items() if n > 2}, verdict.summary()


@pytest.mark.nemesis
@pytest.mark.scenario("14. nemesis")
@pytest.mark.timeout(600)
def test_14_nemesis_finds_no_overlap_and_no_lost_update(own_pg: PostgresServer, chaos: Chaos) -> None:
    # own_pg first: it must outlive the chaos fixture, which looks for rows left on it.
    nemesis_run(own_pg, chaos, float(os.environ.get("NEMESIS_SECONDS") or 100), "nemesis")


@pytest.mark.slow
@pytest.mark.nemesis
@pytest.mark.scenario("16. nemesis, long")
@pytest.mark.timeout(7200)
def test_16_a_long_nemesis_run(own_pg: PostgresServer, chaos: Chaos) -> None:
    nemesis_run(own_pg, chaos, float(os.environ.get("NEMESIS_LONG_SECONDS") or 600), "nemesis-long")


@pytest.fixture
def nets(toxiproxy: Toxiproxy, own_pg: PostgresServer) -> Any:
    """Proxies to ``own_pg`` for a run outside the chaos fixture (whose verdict must not fail the test)."""

    def make(name: str) -> Net:
        upstream = os.environ.get("CHAOS_UPSTREAM") if own_pg.restart_command else None
        base = {"user": own_pg.user, "dbname": own_pg.dbname, "password": own_pg.password}
        return Net(toxiproxy, upstream or f"{own_pg.host}:{own_pg.port}", base, name)

    return make


@pytest.mark.nemesis
@pytest.mark.timeout(600)
def test_15_the_nemesis_catches_a_holder_that_trusts_its_lease_too_long(
    own_pg: PostgresServer, nets: Any, report: Report, lock_name: str
) -> None:
    """The same nemesis, against workers whose lease runs one heartbeat interval past the stale threshold.

    The library has no switch for this (and must not): each worker process, told so by
    ``NEMESIS_BROKEN=lease``, monkeypatches the private ``Timing.lease`` in itself only.
    The run stops as soon as the checker finds what it must.
    """
    seed = new_seed()
    locks = [f"{lock_name}-{n}" for n in range(LOCKS)]
    run = Run(own_pg, locks, logs_dir("nemesis-broken"), seed)
    nemesis = run.nemesis(nets, env={"NEMESIS_BROKEN": "lease"})
    seconds = float(os.environ.get("NEMESIS_BROKEN_SECONDS") or 300)

    def caught() -> bool:
        try:
            return bool(run.verdict(nemesis, rows_left=[]).overlaps)
        except psycopg.OperationalError:
            return False  # the nemesis is restarting the server: ask again at the next check

    ran = nemesis.run(make_schedule(seed, seconds=seconds, locks=LOCKS), seconds=seconds, stop_early=caught)
    verdict = run.verdict(nemesis, rows_left=[])  # a broken worker's rows are beside the point here
    run.sweep()
    kept = run.keep(nemesis, verdict, "broken-verdict")
    history = nemesis.history()
    broken = {event["broken"] for event in history.named("start")}
    report.record(
        "15. nemesis, broken lease (caught)",
        overlaps=len(verdict.overlaps),
        rows_left=len(run.rows_left()),
        caught_after_s=ran,
        seed=seed,
        believed_overlaps=len(verdict.overlaps),
        losses_detected_late=len(verdict.late_losses),
        lost_updates=verdict.lost_updates,
        ledger_fenced_out=verdict.fenced,
        reclaims=verdict.reclaims,
    )
    assert broken == {"lease"}, "every worker ran broken"
    assert verdict.overlaps, f"the nemesis missed a lease past the stale threshold: {verdict.summary()}; {kept}"
    # The fence still kept the ledger right: the broken holders' writes were refused.
    assert verdict.lost_updates == 0, verdict.summary()


# -- the schedule and the checker, fed known histories (no server) ------------------------------


def test_the_schedule_is_drawn_from_its_seed() -> None:
    assert make_schedule(7, seconds=60, locks=3) == make_schedule(7, seconds=60, locks=3)
    assert make_schedule(7, seconds=60, locks=3) != make_schedule(8, seconds=60, locks=3)


def test_the_schedule_freezes_and_cuts_across_the_thresholds_inside_the_run() -> None:
    faults = [fault for seed in range(20) for fault in make_schedule(seed, seconds=100, locks=3)]
    assert {f.kind for f in faults} == {"freeze", "partition", "disable", "reset", "latency", "kill", "restart"}
    every = [[f for f in make_schedule(seed, seconds=100, locks=3) if f.kind == "restart"] for seed in range(20)]
    assert all(every), "every run of 100 s restarts PostgreSQL"
    for band, (low, high) in BANDS.items():
        drawn = [f for f in faults if f.band == band]
        assert drawn, f"no fault in the band {band}"
        assert all(low <= f.duration <= high for f in drawn)
    across = [f for f in faults if f.band == "across lease"]
    assert all(LEASE - HEARTBEAT <= f.duration <= STALE for f in across)
    assert all(f.at >= QUIET_START and f.at + f.duration <= 100 - QUIET_END for f in faults)
    for seed in range(20):
        restarts = [f.at for f in make_schedule(seed, seconds=100, locks=3) if f.kind == "restart"]
        assert all(RESTART_SPACING <= b - a <= 2 * RESTART_SPACING for a, b in itertools.pairwise(restarts))


def test_a_fault_whose_holder_is_busy_hits_another_worker_not_nobody(tmp_path: Path) -> None:
    nemesis = Nemesis(
        directory=tmp_path,
        locks=["x", "y", "z"],
        workers=3,
        seed=1,
        net=lambda name: None,  # type: ignore[arg-type,return-value]
        holders=dict,
        restart=lambda: None,
    )
    nemesis.current = ["w0g1", "w1g1", "w2g1"]
    nemesis.slot_of = {"w0g1": 0, "w1g1": 1, "w2g1": 2}
    holders = {"x": "w0g1", "y": "w2g1"}
    fault = Fault(3.0, "disable", target=0, duration=1.0, pick=0.0)
    assert nemesis._target(fault, holders, busy=set()) == (0, True), "the holder of its lock, when free"
    assert nemesis._target(fault, holders, busy={0}) == (2, True), "else another holder"
    assert nemesis._target(fault, holders, busy={0, 2}) == (1, False), "else any worker"
    assert nemesis._target(fault, holders, busy={0, 1, 2}) is None, "every worker busy: wait"


def history(*events: dict[str, Any]) -> History:
    return History(list(events))


def section(who: str, lock: str, enter: float, leave: float, held: bool = True, believed: float | None = None) -> Any:
    return {
        "ev": "section",
        "who": who,
        "lock": lock,
        "enter": enter,
        "exit": leave,
        "held": held,
        "believed_until": leave if believed is None else believed,
    }


def verdict_of(
    *events: dict[str, Any],
    applied: list[Applied] | None = None,
    ledger: dict[str, int] | None = None,
    rows: list[tuple[str, str]] | None = None,
) -> Verdict:
    return check(history(*events), applied or [], seed=1, ledger=ledger or {}, rows_left=rows or [])


def test_the_checker_counts_a_section_begun_while_another_holder_believed() -> None:
    found = verdict_of(section("a", "x", 0.0, 5.0), section("b", "x", 4.0, 6.0), section("c", "y", 1.0, 2.0))
    assert len(found.overlaps) == 1
    assert not found.sound
    assert verdict_of(section("a", "x", 0.0, 5.0), section("b", "x", 5.0, 6.0)).overlaps == [], "touching"


def test_the_checker_lets_a_former_holder_finish_after_it_learned_of_the_loss() -> None:
    found = verdict_of(section("a", "x", 0.0, 5.0, held=False, believed=3.0), section("b", "x", 4.0, 6.0))
    assert found.overlaps == []
    assert found.overlaps_after_loss_known == 1
    assert found.sound


def test_the_checker_ends_a_killed_workers_section_when_it_could_last_act() -> None:
    kill = Applied(Fault(1.0, "kill", 0, 1.0), "a", start=5.0, end=6.0)
    freeze = Applied(Fault(1.0, "freeze", 0, 2.0), "a", start=2.0, end=7.0)
    entered = {"ev": "enter", "who": "a", "lock": "x", "at": 0.0}
    believed = {"ev": "believed", "who": "a", "lock": "x", "enter": 0.0, "at": 1.9}
    later = section("b", "x", 4.0, 6.0)
    # It last said it believed at 1.9, and could act until the freeze at 2: b at 4 is fine.
    assert verdict_of(entered, believed, later, applied=[kill, freeze]).overlaps == []
    # It said it believed until 4.5: b entering at 4 ran alongside a believing holder.
    still = {**believed, "at": 4.5}
    assert len(verdict_of(entered, still, later, applied=[kill]).overlaps) == 1


def test_the_checker_counts_lost_and_doubled_ledger_updates() -> None:
    def inc(name: str, wrote: int, outcome: str, token: int = 1) -> list[dict[str, Any]]:
        start = {"ev": "inc-start", "inc": name, "lock": "x", "read": wrote - 1, "wrote": wrote, "token": token}
        return [start, {"ev": "inc", "inc": name, "lock": "x", "outcome": outcome}]

    clean = [*inc("1", 1, "committed"), *inc("2", 2, "committed"), *inc("3", 3, "unknown")]
    assert verdict_of(*clean, ledger={"x": 2}).sound, "the unknown one did not land"
    assert verdict_of(*clean, ledger={"x": 3}).sound, "the unknown one landed"
    # Two committed increments both wrote 2: one overwrote the other.
    lost = [*inc("1", 1, "committed"), *inc("2", 2, "committed"), *inc("3", 2, "committed")]
    assert verdict_of(*lost, ledger={"x": 2}).lost_updates == 1
    assert verdict_of(*clean, ledger={"x": 1}).lost_updates == 1, "the counter is behind what committed"
    assert verdict_of(*clean, ledger={"x": 5}).doubled_updates == 2
    # Killed between the start of its commit and its outcome: unknown, not lost nor doubled.
    killed = [*clean, inc("4", 4, "x")[0]]
    assert verdict_of(*killed, ledger={"x": 4}).sound
    # Fencing tokens must grow along the counter.
    order = [*inc("1", 1, "committed", token=5), *inc("2", 2, "committed", token=4)]
    assert verdict_of(*order, ledger={"x": 2}).token_order_violations == 1


def test_the_checker_finds_a_loss_told_after_the_takeover_unless_the_holder_was_frozen() -> None:
    held = section("a", "x", 0.0, 3.5, held=False, believed=2.0)
    taken = section("b", "x", 3.0, 4.0)
    reclaim = {"ev": "reclaimed", "who": "b", "lock": "x", "at": 2.99, "previous": "a"}
    late = {"ev": "lost", "who": "a", "lock": "x", "at": 3.4, "reason": "lease"}
    on_time = {**late, "at": 2.8}
    assert verdict_of(held, taken, reclaim, on_time).late_losses == []
    assert verdict_of(held, taken, reclaim, on_time).min_notice_s == pytest.approx(0.2)
    assert verdict_of(held, taken, on_time).min_notice_s is None, "no reclaim: a is what freed the lock"
    assert len(verdict_of(held, taken, late).late_losses) == 1
    frozen = Applied(Fault(1.0, "freeze", 0, 2.0), "a", start=1.0, end=3.3)
    assert verdict_of(held, taken, late, applied=[frozen]).late_losses == [], "told as it resumed"


def test_the_checker_holds_no_notice_bound_over_a_holder_that_was_releasing() -> None:
    # Its section ended (the block left, the release slow on a bad network) before the takeover;
    # the release then found the row taken over and told the loss: no running job relied on it.
    releasing = section("a", "x", 0.0, 1.5, believed=1.5)
    taken = section("b", "x", 3.0, 4.0)
    reclaim = {"ev": "reclaimed", "who": "b", "lock": "x", "at": 2.99, "previous": "a"}
    told_by_release = {"ev": "lost", "who": "a", "lock": "x", "at": 3.4, "reason": "taken over"}
    assert verdict_of(releasing, taken, reclaim, told_by_release).late_losses == []
    still_running = section("a", "x", 0.0, 3.5, held=False, believed=2.0)
    assert len(verdict_of(still_running, taken, reclaim, told_by_release).late_losses) == 1


def test_the_checker_allows_a_loss_told_just_after_the_takeover_and_says_so() -> None:
    # A starved machine may run the holder's notice a moment late; the verdict states the bound it holds.
    held = section("a", "x", 0.0, 2.95, held=False, believed=2.7)
    taken = section("b", "x", 3.0, 4.0)
    reclaim = {"ev": "reclaimed", "who": "b", "lock": "x", "at": 2.99, "previous": "a"}
    just_after = {"ev": "lost", "who": "a", "lock": "x", "at": 3.0 + NOTICE_ALLOWANCE * 0.5, "reason": "lease"}
    allowed = verdict_of(held, taken, reclaim, just_after)
    assert allowed.late_losses == []
    assert len(allowed.losses_within_allowance) == 1
    assert "section ended -0.050s from the takeover" in allowed.losses_within_allowance[0]
    assert allowed.figures()["notice_bound"] == f"on_lost at most {NOTICE_ALLOWANCE:g}s after the takeover"
    assert allowed.figures()["losses_told_after_takeover_within_bound"] == 1
    past = {**just_after, "at": 3.0 + NOTICE_ALLOWANCE * 1.5}
    assert len(verdict_of(held, taken, reclaim, past).late_losses) == 1


def test_the_checker_takes_a_doubt_no_heartbeat_confirmed_as_the_holders_notice() -> None:
    held = section("a", "x", 0.0, 2.0, held=False, believed=2.0)
    taken = section("b", "x", 3.0, 4.0)
    reclaim = {"ev": "reclaimed", "who": "b", "lock": "x", "at": 2.99, "previous": "a"}
    lost = {"ev": "lost", "who": "a", "lock": "x", "at": 3.4, "reason": "row gone"}
    doubt = {"ev": "doubt", "who": "a", "lock": "x", "at": 2.0}
    confirmed = {"ev": "confirmed", "who": "a", "lock": "x", "at": 2.5}
    assert len(verdict_of(held, taken, reclaim, lost).late_losses) == 1, "told of the loss after the takeover"
    told = verdict_of(held, taken, reclaim, lost, doubt)
    assert told.late_losses == []
    assert told.min_notice_s == pytest.approx(1.0), "in doubt a second before the takeover"
    assert len(verdict_of(held, taken, reclaim, lost, doubt, confirmed).late_losses) == 1, "a confirmed doubt"


def test_the_checker_calls_a_row_left_by_a_live_worker_an_orphan_not_one_of_a_killed_one() -> None:
    kill = Applied(Fault(1.0, "kill", 0, 1.0), "a", start=5.0, end=6.0)
    found = verdict_of(applied=[kill], rows=[("x", "a"), ("y", "b")])
    assert found.orphaned_rows == ["y held by b"]


def test_the_report_shows_every_figure_and_the_seed() -> None:
    figures = verdict_of(section("a", "x", 0.0, 1.0)).figures()
    assert figures["seed"] == 1
    assert figures["believed_overlaps"] == 0
    assert {"lost_updates", "doubled_updates", "orphaned_rows", "losses_detected_late"} <= set(figures)


def test_a_history_reads_back_what_workers_logged_even_a_line_cut_short(tmp_path: Path) -> None:
    log = tmp_path / "worker-w0g1.log"
    log.write_text(json.dumps(section("a", "x", 0.0, 1.0)) + '\n{"ev": "sect')
    assert History.read([log]).named("section")[0]["who"] == "a"
