"""Scenarios 17 and 18: a semaphore of 3, eight contending processes, under the nemesis.

The nemesis of chaos/test_nemesis.py (freeze, cut off, reset, restart, kill) against workers that
each take a permit of one `Semaphore` of `PERMITS` (``NEMESIS_PERMITS``: see chaos/nemesis_worker.py)
and work under it, incrementing their permit's row of the ledger under ``fence``. A permit is
held by one holder at a time, so the nemesis's checker judges each permit as it judges a mutex:
no two believing holders of one permit, no lost or doubled ledger update, no late loss. Over the
whole semaphore, the most holders that believed they held a permit at one moment is measured and
reported (``most_believing_at_once``): it must be at most `PERMITS`.

- 17: a bounded run (``NEMESIS_SEMAPHORE_SECONDS``, default 45 s), part of CI.
- 18: a long run on demand (``pytest -m slow``; ``NEMESIS_SEMAPHORE_LONG_SECONDS``, default 600 s).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
import pytest

from chaos.conftest import Chaos
from chaos.harness import STALE, TIMING
from chaos.nemesis import Nemesis, make_schedule, new_seed, sections_of
from chaos.nemesis_worker import LEDGER, PERMITS_ENV, RECLAIM_ENV
from chaos.test_nemesis import RECLAIM_DISCONNECTED_AFTER, Run, logs_dir
from postgres_mutex import MutexClient
from tests.support.exclusion import Section, most_at_once
from tests.support.postgres_server import PostgresServer

PERMITS = 3
WORKERS = 8


class SemaphoreRun(Run):
    """A nemesis run whose one lock is a semaphore of `PERMITS`: the ledger and the table read per permit."""

    def __init__(self, server: PostgresServer, semaphore: str, directory: Any, seed: int) -> None:
        super().__init__(server, [semaphore], directory, seed)
        self.semaphore = semaphore
        self.units = [f"{semaphore}/{permit}" for permit in range(PERMITS)]
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            for unit in self.units:
                conn.execute(
                    f"INSERT INTO {LEDGER} (id, counter) VALUES (%s, 0) "  # noqa: S608
                    "ON CONFLICT (id) DO UPDATE SET counter = 0, token = NULL",
                    (unit,),
                )

    def holders(self) -> dict[str, str]:
        # One holder per semaphore is enough for the nemesis: it aims a fault at "the holder".
        try:
            rows = self.rows_left()
        except psycopg.OperationalError:
            return {}  # restarting: the fault picks a worker by its own draw
        return {self.semaphore: rows[0][1]} if rows else {}

    def rows_left(self) -> list[tuple[str, str]]:
        found = self._query(
            "SELECT semaphore || '/' || permit, instance_id FROM mutex_lock WHERE semaphore = %s", (self.semaphore,)
        )
        return [(str(unit), str(holder)) for unit, holder in found]

    def ledger(self) -> dict[str, int]:
        found = self._query(f"SELECT id, counter FROM {LEDGER} WHERE id = ANY(%s)", (self.units,))  # noqa: S608
        return {str(unit): int(counter) for unit, counter in found}

    def nemesis(self, net: Any, env: dict[str, str] | None = None) -> Nemesis:
        return Nemesis(
            directory=self.directory,
            locks=self.locks,
            workers=WORKERS,
            seed=self.seed,
            net=net,
            holders=self.holders,
            restart=self.server.restart,
            env={**(env or {}), PERMITS_ENV: str(PERMITS)},
        )

    def sweep(self) -> float:
        """Take every permit at once (a killed worker's row is reclaimed): how long it took."""
        started = time.monotonic()
        with MutexClient(self.server.dsn()) as client:
            sweepers = [
                client.semaphore(self.semaphore, permits=PERMITS, instance_id=f"sweeper-{n}", **TIMING)
                for n in range(PERMITS)
            ]
            held = [sweeper.acquire(blocking=True, timeout=STALE * 3) for sweeper in sweepers]
            assert all(acquisition.__enter__() for acquisition in held)
            for acquisition in held:
                acquisition.__exit__(None, None, None)
        return time.monotonic() - started


def most_believing(sections: list[Section], semaphore: str) -> int:
    """The most holders of the semaphore's permits that believed they held one at the same moment."""
    end = max([s.end(0.0) for s in sections] + [0.0])
    believing = [
        Section(s.who, s.enter, max(s.enter, s.belief_end(end)), lock=semaphore)
        for s in sections
        if s.lock.startswith(f"{semaphore}/")
    ]
    return most_at_once(believing, now=end)


def semaphore_nemesis_run(own_pg: PostgresServer, chaos: Chaos, seconds: float, name: str) -> None:
    seed = new_seed()
    print(f"nemesis seed {seed} (replay: NEMESIS_SEED={seed})")
    semaphore = f"{chaos.lock_name}-sem"
    run = SemaphoreRun(own_pg, semaphore, logs_dir(name), seed)
    nemesis = run.nemesis(
        lambda name: chaos.net(name, server=own_pg), env={RECLAIM_ENV: str(RECLAIM_DISCONNECTED_AFTER)}
    )
    schedule = make_schedule(seed, seconds=seconds, locks=1)
    ran = nemesis.run(schedule, seconds=seconds)
    rows_at_stop = run.rows_left()
    verdict = run.verdict(nemesis, rows_left=rows_at_stop)
    swept_in = run.sweep()
    kept = run.keep(nemesis, verdict, "nemesis-verdict")
    sections = sections_of(nemesis.history(), nemesis.applied)
    most = most_believing(sections, semaphore)
    # The chaos fixture counts overlaps per permit again, for the report's column.
    for found in sections:
        chaos.sections.add(found)
    chaos.record(
        ran_s=ran,
        workers=WORKERS,
        permits=PERMITS,
        most_believing_at_once=most,
        **verdict.figures(),
        workers_that_did_not_stop=len(nemesis.did_not_stop()),
        every_permit_taken_again_after_s=swept_in,
    )
    failing = f"seed {seed} (replay: NEMESIS_SEED={seed}); details: {kept}; logs: {run.directory}"
    assert most <= PERMITS, f"{most} holders believed they held one of {PERMITS} permits at once; {failing}"
    assert verdict.overlaps == [], f"two believing holders of one permit: {verdict.overlaps[:3]}; {failing}"
    assert verdict.lost_updates == 0, failing
    assert verdict.doubled_updates == 0, failing
    assert verdict.token_order_violations == 0, failing
    assert verdict.orphaned_rows == [], failing
    assert verdict.late_losses == [], failing
    assert nemesis.did_not_stop() == [], failing
    # The run did what it is for: the semaphore was contended (more holders than one at once),
    # and holds were taken over from frozen, cut-off or killed holders.
    assert most >= 2, f"the permits were never held together: {verdict.summary()}"
    assert verdict.reclaims >= 1, f"no reclaim: nothing was tested; {verdict.summary()}"
    assert verdict.committed >= seconds // 10, verdict.summary()


@pytest.mark.nemesis
@pytest.mark.scenario("17. nemesis, semaphore of 3")
@pytest.mark.timeout(400)
def test_17_a_semaphore_of_3_never_has_more_than_3_believing_holders(own_pg: PostgresServer, chaos: Chaos) -> None:
    semaphore_nemesis_run(own_pg, chaos, float(os.environ.get("NEMESIS_SEMAPHORE_SECONDS") or 45), "nemesis-sem")


@pytest.mark.slow
@pytest.mark.nemesis
@pytest.mark.scenario("18. nemesis, semaphore of 3, long")
@pytest.mark.timeout(7200)
def test_18_a_long_semaphore_nemesis_run(own_pg: PostgresServer, chaos: Chaos) -> None:
    seconds = float(os.environ.get("NEMESIS_SEMAPHORE_LONG_SECONDS") or 600)
    semaphore_nemesis_run(own_pg, chaos, seconds, "nemesis-sem-long")


def test_the_count_of_believing_holders_sees_a_fourth_and_ignores_a_holder_told_of_its_loss() -> None:
    def permit(who: str, k: int, enter: float, leave: float, believed: float | None = None) -> Section:
        return Section(who, enter, leave, lock=f"s/{k}", held_at_exit=believed is None, believed_until=believed)

    three = [permit("a", 0, 0.0, 10.0), permit("b", 1, 1.0, 10.0), permit("c", 2, 2.0, 10.0)]
    assert most_believing(three, "s") == 3
    # A fourth holder while the first still believed: counted (a reclaimed permit's holder that went on).
    assert most_believing([*three, permit("d", 0, 5.0, 9.0)], "s") == 4
    # The first stopped believing (told of its loss) before the fourth began: three at most.
    told = [permit("a", 0, 0.0, 10.0, believed=4.0), *three[1:], permit("d", 0, 5.0, 9.0)]
    assert most_believing(told, "s") == 3
    # Another semaphore's sections are not this one's.
    assert most_believing([*three, permit("e", 0, 3.0, 4.0)], "t") == 0
