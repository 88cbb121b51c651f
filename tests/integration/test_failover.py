"""The lock on a real replicated cluster: Patroni switchovers and failovers under held locks.

One cluster for the module (tests/support/patroni.py: etcd and two Patroni nodes of
PostgreSQL 15 on loopback), switched between synchronous and asynchronous
replication by Patroni's own configuration API. Clients use a multi-host DSN
with ``target_session_attrs=read-write``, as the docs tell users to.

What is shown, each time with the figures written to
``chaos/report/failover-report.{json,md}`` (docs/how-to/high-availability.md
quotes them):

- a switchover and a failover under a held lock: the holder reconnects to the
  new primary and keeps its lock (its row was replicated), heartbeats resume,
  a waiter proceeds, the watcher and ``postgres-mutex status`` keep working,
  nothing waits past its deadline;
- a statement that lands on a read-only node is a transient failure, never a
  release and never a loss by itself;
- synchronous replication: repeated failovers and switchovers under
  cross-process contention produce no two holders;
- asynchronous replication: a just-acquired row can vanish with the old
  primary; the time two processes both believe they hold the lock is
  measured, and the old holder learns of the loss at its next heartbeat.

Timings: heartbeat 0.5 s, alert 15 s, stale 45 s: a lease (44.5 s) longer than
any failover here, an alert threshold above it. With the defaults (10 s, 30 s,
600 s) the same holds for failovers up to the alert threshold.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from chaos.harness import Event, Events
from postgres_mutex import DatabaseError, LockNotHeldError, Mutex, MutexError
from postgres_mutex.watcher import StaleWatcher
from tests.integration.test_cli import cli
from tests.support.exclusion import Sections
from tests.support.figures import Figures, ran_whole
from tests.support.fixtures import ROOT, wait_until
from tests.support.patroni import LOOP_WAIT, RETRY_TIMEOUT, TTL, Node, PatroniCluster

pytestmark = pytest.mark.failover

HEARTBEAT, ALERT, STALE = 0.5, 15.0, 45.0
LEASE = STALE - HEARTBEAT
HEARTBEAT_RETRY = min(HEARTBEAT, 1.0)  # the library retries a failed heartbeat this often
POLL = 0.2
OPERATION_TIMEOUT = 1.0
CONNECT_TIMEOUT = 2.0  # what the library sets: operation_timeout rounded up, at least 2 s
# Any: unpacked into Mutex(...) next to other keyword arguments.
TIMING: dict[str, Any] = {
    "heartbeat_interval": HEARTBEAT,
    "alert_threshold": ALERT,
    "stale_threshold": STALE,
    "poll_interval": POLL,
    "operation_timeout": OPERATION_TIMEOUT,
}
# How late a thread may run on a busy two-core machine.
SLACK = 1.0
# A failover must be over well within this: Patroni's ttl, a loop, the promotion.
FAILOVER_DEADLINE = TTL * 4
READ_ONLY = "25006"


@pytest.fixture(scope="module")
def figures(request: pytest.FixtureRequest) -> Iterator[Figures]:
    collected = Figures(
        "failover-report",
        "postgres-mutex on a Patroni cluster (measured by tests/integration/test_failover.py)",
        {
            **TIMING,
            "cluster": "2 nodes, PostgreSQL 15, Patroni 3.0.2, etcd 3.4 (Debian 12)",
            "patroni ttl": TTL,
            "loop_wait": LOOP_WAIT,
            "retry_timeout": RETRY_TIMEOUT,
        },
    )
    yield collected
    if collected.scenarios:
        collected.write(docs_copy=ran_whole(request.path))


@pytest.fixture(scope="module")
def cluster(figures: Figures) -> Iterator[PatroniCluster]:
    with PatroniCluster(nodes=2, synchronous=True) as started:
        bootstrap = Mutex(started.dsn(), "schema-bootstrap", **TIMING)
        bootstrap.create_schema()
        bootstrap.close()
        assert started.started_in is not None
        figures.record("cluster start", leader_and_sync_standby_after_s=started.started_in)
        yield started


@pytest.fixture
def sync_cluster(cluster: PatroniCluster) -> PatroniCluster:
    """The cluster, healthy, with synchronous replication (Patroni's synchronous_mode)."""
    cluster.heal()
    cluster.set_synchronous(True)
    return cluster


@pytest.fixture
def async_cluster(cluster: PatroniCluster) -> PatroniCluster:
    """The cluster, healthy, with asynchronous replication."""
    cluster.heal()
    cluster.set_synchronous(False)
    return cluster


class HA:
    """One scenario on the cluster: Mutexes on the multi-host DSN, their events, the overlap checker, a watcher."""

    def __init__(self, cluster: PatroniCluster, lock_name: str) -> None:
        self.cluster = cluster
        self.lock_name = lock_name
        self.events = Events()
        self.watcher_events = Events()
        self.sections = Sections()
        self._mutexes: list[Mutex] = []
        self._watchers: list[StaleWatcher] = []

    def mutex(self, who: str, dsn: str | None = None, **options: Any) -> Mutex:
        settings: dict[str, Any] = {**TIMING, "instance_id": who, "metrics": self.events}
        settings["on_lost"] = self.sections.on_lost(who)
        settings.update(options)
        mutex = Mutex(dsn or self.cluster.dsn(), self.lock_name, **settings)
        self._mutexes.append(mutex)
        return mutex

    def watch(self) -> StaleWatcher:
        watcher = StaleWatcher(
            self.cluster.dsn(),
            lock_names=[self.lock_name],
            alert_threshold=ALERT,
            stale_threshold=STALE,
            interval=0.2,
            operation_timeout=OPERATION_TIMEOUT,
            metrics=self.watcher_events,
        )
        watcher.start()
        self._watchers.append(watcher)
        return watcher

    def waiting(
        self, waiter: Mutex, timeout: float = 90, hold: threading.Event | None = None
    ) -> tuple[threading.Thread, list[float]]:
        """A thread (not started) in which ``waiter`` waits for the lock as section "waiter", and when it got it.

        It holds the lock until ``hold`` is set (not at all without one).
        """
        got: list[float] = []

        def wait() -> None:
            with self.sections.holding(waiter, "waiter", blocking=True, timeout=timeout) as acquired:
                got.append(time.monotonic())
                assert acquired
                if hold is not None:
                    hold.wait(60)

        return threading.Thread(target=wait), got

    def named(self, event: str, who: str, since: float = 0.0) -> list[Event]:
        return [e for e in self.events.named(event) if e.fields.get("instance_id") == who and e.at > since]

    def beats(self, who: str, since: float = 0.0) -> list[float]:
        return [e.at for e in self.named("heartbeat_latency", who, since)]

    def observed_holder(self, who: str, since: float) -> float | None:
        """When the watcher first saw ``who`` hold the lock after ``since``."""
        for event in self.watcher_events.named("observed"):
            if event.at > since and any(seen.holder == who for seen in event.fields["observations"]):
                return event.at
        return None

    def holder_id(self, node: Node | None = None) -> str | None:
        """The holder per the primary (or per ``node``, a standby's replicated copy)."""
        dsn = node.dsn(connect_timeout=5) if node is not None else self.cluster.dsn(connect_timeout=5)
        with psycopg.connect(dsn, autocommit=True) as conn:
            found = conn.execute(
                "SELECT instance_id FROM mutex_lock WHERE lock_name = %s", (self.lock_name,)
            ).fetchone()
        return None if found is None else str(found[0])

    def close(self) -> None:
        for watcher in self._watchers:
            watcher.close()
        for mutex in self._mutexes:
            with contextlib.suppress(Exception):
                mutex.close()


@pytest.fixture
def ha(cluster: PatroniCluster, lock_name: str) -> Iterator[HA]:
    world = HA(cluster, lock_name)
    try:
        yield world
    finally:
        world.close()
    assert world.sections.overlaps() == [], "two holders at once"


def longest_silence(times: list[float], start: float, end: float) -> float:
    """The longest gap between consecutive ``times`` around [start, end]."""
    inside = sorted(t for t in times if t <= end)
    before = [t for t in inside if t < start]
    window = ([before[-1]] if before else []) + [t for t in inside if t >= start]
    return max((b - a for a, b in itertools.pairwise(window)), default=0.0)


def attempts(ha: HA, who: str) -> list[float]:
    """Every heartbeat attempt of ``who``, successful or not."""
    return sorted(
        e.at
        for e in ha.events.events
        if e.name in ("heartbeat_latency", "heartbeat_failed") and e.fields.get("instance_id") == who
    )


def status(dsn: str, lock_name: str) -> tuple[int, str | None, float]:
    """``postgres-mutex status --json`` for one lock: (exit code, holder shown, seconds it took)."""
    started = time.monotonic()
    result = cli("status", "--dsn", dsn, "--json", "--lock", lock_name, timeout=60)
    took = time.monotonic() - started
    if result.returncode != 0:
        return result.returncode, None, took
    locks = json.loads(result.stdout)["locks"]
    return 0, (str(locks[0]["holder"]) if locks else None), took


# -- a switchover and a failover under a held lock ------------------------------------------------


def test_a_switchover_under_a_held_lock(sync_cluster: PatroniCluster, ha: HA, figures: Figures) -> None:
    cluster = sync_cluster
    holder, waiter = ha.mutex("holder"), ha.mutex("waiter")
    ha.watch()
    thread, got = ha.waiting(waiter, timeout=60)
    with ha.sections.holding(holder, "holder"):
        wait_until(lambda: len(ha.beats("holder")) >= 2)
        thread.start()
        wait_until(lambda: len(ha.named("contended", "waiter")) >= 1)
        old = cluster.leader()
        started = time.monotonic()
        new = cluster.switchover()
        switched = time.monotonic()
        assert new.name != old.name
        wait_until(lambda: ha.beats("holder", since=switched), timeout=LEASE)
        resumed = min(ha.beats("holder", since=switched))
        assert holder.held, "the holder kept its lock"
        assert ha.holder_id() == "holder", "its row is on the new primary"
        assert not got, "the waiter still waits"
        wait_until(lambda: ha.observed_holder("holder", since=switched), timeout=10)
        watcher_back = ha.observed_holder("holder", since=switched)
        code, shown, _ = status(cluster.dsn(), ha.lock_name)
        assert (code, shown) == (0, "holder"), "postgres-mutex status shows the holder on the new primary"
    released = time.monotonic()
    thread.join(60)
    assert got, "the waiter got the lock"
    assert ha.events.named("lost") == []
    assert ha.events.named("stale_reclaimed") == []
    assert ha.watcher_events.named("alert") == [], "a switchover is shorter than the alert threshold"
    silence = longest_silence(ha.beats("holder"), started, resumed)
    figures.record(
        "switchover, synchronous replication",
        switchover_s=switched - started,
        holder_heartbeat_silence_s=silence,
        heartbeats_failed=len(ha.named("heartbeat_failed", "holder")),
        lock_kept=True,
        watcher_saw_holder_on_new_primary_after_s=(watcher_back or switched) - switched,
        waiter_acquired_after_release_s=got[0] - released,
        alerts=0,
    )


@pytest.mark.parametrize("replication", ["synchronous", "asynchronous"])
def test_a_failover_under_a_held_lock(cluster: PatroniCluster, replication: str, ha: HA, figures: Figures) -> None:
    """The leader's machine dies (Patroni and PostgreSQL killed) while a lock is held; its row was replicated."""
    cluster.heal()
    leader = cluster.set_synchronous(replication == "synchronous")
    standby = next(node for node in cluster.nodes if node.name != leader.name)
    holder, waiter = ha.mutex("holder"), ha.mutex("waiter")
    ha.watch()
    thread, got = ha.waiting(waiter)
    with ha.sections.holding(holder, "holder"):
        wait_until(lambda: len(ha.beats("holder")) >= 2)
        thread.start()
        wait_until(lambda: len(ha.named("contended", "waiter")) >= 1)
        # The holder's row is on the standby before the crash (asynchronous replication: a moment later).
        wait_until(lambda: ha.holder_id(standby) == "holder", timeout=10)
        killed = time.monotonic()
        cluster.kill_node(leader)
        # Meanwhile status still answers from the standby's copy, when asked to read from any node.
        during = status(cluster.dsn(target_session_attrs="any"), ha.lock_name)
        new = cluster.wait_leader(other_than=leader, timeout=FAILOVER_DEADLINE)
        promoted = time.monotonic()
        assert new.name == standby.name
        wait_until(lambda: ha.beats("holder", since=promoted), timeout=LEASE)
        resumed = min(ha.beats("holder", since=killed))
        assert holder.held, "the holder kept its lock"
        assert ha.holder_id() == "holder"
        assert not got, "the waiter still waits"
        wait_until(lambda: ha.observed_holder("holder", since=promoted), timeout=10)
        watcher_back = ha.observed_holder("holder", since=killed)
        code, shown, _ = status(cluster.dsn(), ha.lock_name)
        assert (code, shown) == (0, "holder"), "postgres-mutex status shows the holder on the new primary"
    released = time.monotonic()
    thread.join(60)
    assert got, "the waiter got the lock"
    assert ha.events.named("lost") == []
    assert ha.events.named("stale_reclaimed") == []
    assert ha.watcher_events.named("alert") == [], "the failover was shorter than the alert threshold"
    assert during[:2] == (0, "holder"), "status read the standby during the failover"
    # Nothing waited past its deadline: each failed heartbeat was retried on time.
    tries = [t for t in attempts(ha, "holder") if killed <= t <= resumed]
    worst_gap = max((b - a for a, b in itertools.pairwise(tries)), default=0.0)
    assert worst_gap < HEARTBEAT_RETRY + CONNECT_TIMEOUT + OPERATION_TIMEOUT + SLACK
    assert watcher_back is not None
    figures.record(
        f"failover (leader killed), {replication} replication",
        kill_to_new_primary_s=promoted - killed,
        holder_heartbeat_silence_s=longest_silence(ha.beats("holder"), killed, resumed),
        heartbeats_failed=len(ha.named("heartbeat_failed", "holder")),
        worst_gap_between_heartbeat_attempts_s=worst_gap,
        lock_kept=True,
        watcher_blind_s=watcher_back - killed,
        status_during_failover_from_standby=f"exit {during[0]}, holder {during[1]}, {during[2]:.1f}s",
        waiter_acquired_after_release_s=got[0] - released,
        alerts=0,
    )


# -- reclaim_disconnected_after across a failover ----------------------------------------------------
# A failover ends every session the holder had: on the new primary nobody holds its session's
# marker. Shorter than the option, the holder reconnects and names its new session before its row
# is old enough to reclaim; longer, it is in doubt before anyone may take the lock over.

RECLAIM_LONGER = 15.0
"""Longer than a failover here (about 6 s, docs/figures/failover-report.md) plus a heartbeat."""
RECLAIM_SHORTER = 2 * HEARTBEAT + OPERATION_TIMEOUT
"""The shortest the option may be with these timings: a failover outlasts it."""


def test_a_failover_shorter_than_reclaim_disconnected_after_costs_no_lock(
    cluster: PatroniCluster, ha: HA, figures: Figures
) -> None:
    cluster.heal()
    leader = cluster.set_synchronous(True)
    holder = ha.mutex("holder", reclaim_disconnected_after=RECLAIM_LONGER)
    waiter = ha.mutex("waiter", reclaim_disconnected_after=RECLAIM_LONGER)
    thread, got = ha.waiting(waiter)
    with ha.sections.holding(holder, "holder"):
        wait_until(lambda: len(ha.beats("holder")) >= 2)
        thread.start()
        wait_until(lambda: len(ha.named("contended", "waiter")) >= 1)
        killed = time.monotonic()
        cluster.kill_node(leader)
        cluster.wait_leader(other_than=leader, timeout=FAILOVER_DEADLINE)
        promoted = time.monotonic()
        wait_until(lambda: ha.beats("holder", since=promoted), timeout=LEASE)
        resumed = min(ha.beats("holder", since=killed))
        # The waiter keeps trying on the new primary until the row, had the holder not come
        # back, would have been old enough to reclaim: the row names the holder's new session.
        wait_until(lambda: time.monotonic() > killed + RECLAIM_LONGER + SLACK, timeout=RECLAIM_LONGER + 2 * SLACK)
        assert holder.held, "the holder kept its lock"
        assert not got, "the waiter still waits"
        assert ha.holder_id() == "holder"
    thread.join(60)
    assert got, "the waiter got the lock once it was released"
    assert ha.named("hold_in_doubt", "holder") == [], "never in doubt: its silence was shorter than the option"
    assert ha.events.named("lost") == []
    assert ha.events.named("stale_reclaimed") == []
    figures.record(
        "failover (leader killed) shorter than reclaim_disconnected_after",
        reclaim_disconnected_after_s=RECLAIM_LONGER,
        kill_to_new_primary_s=promoted - killed,
        holder_heartbeat_silence_s=resumed - killed,
        lock_kept=True,
        in_doubt=False,
        reclaimed=False,
    )


def test_a_failover_longer_than_reclaim_disconnected_after_tells_the_holder_first(
    cluster: PatroniCluster, ha: HA, figures: Figures
) -> None:
    """The holder is in doubt before its lock may be reclaimed; then confirmed, or lost, whichever comes first.

    On the new primary the holder's heartbeat and the waiter's attempt race: a heartbeat that
    lands first finds the row still the holder's (confirmed: the waiter waits on); an attempt
    that lands first reclaims the row (the holder's next heartbeat finds it gone: lost). Either
    way the holder stopped believing it held before the waiter started to.
    """
    cluster.heal()
    leader = cluster.set_synchronous(True)
    holder = ha.mutex("holder", reclaim_disconnected_after=RECLAIM_SHORTER)
    waiter = ha.mutex("waiter", reclaim_disconnected_after=RECLAIM_SHORTER)
    thread, got = ha.waiting(waiter)
    with contextlib.ExitStack() as stack:
        assert stack.enter_context(holder.acquire())
        wait_until(lambda: len(ha.beats("holder")) >= 2)
        thread.start()
        wait_until(lambda: len(ha.named("contended", "waiter")) >= 1)
        killed = time.monotonic()
        cluster.kill_node(leader)
        wait_until(lambda: ha.named("hold_in_doubt", "holder"), timeout=RECLAIM_SHORTER + SLACK)
        doubted = ha.named("hold_in_doubt", "holder")[0].at
        believes = holder.held
        assert not believes, "in doubt, the holder does not believe it holds"
        cluster.wait_leader(other_than=leader, timeout=FAILOVER_DEADLINE)
        promoted = time.monotonic()

        def settled() -> bool:
            return bool(ha.named("hold_confirmed", "holder") or ha.named("lost", "holder"))

        wait_until(settled, timeout=LEASE)
        confirmed = bool(ha.named("hold_confirmed", "holder"))
        if confirmed:
            assert holder.held, "confirmed: it holds again"
            assert not got, "the waiter waits on"
            stack.close()
        else:
            wait_until(lambda: got, timeout=10)
            assert ha.named("lost", "holder")[0].at >= doubted
            with contextlib.suppress(LockNotHeldError):
                stack.close()
    thread.join(60)
    assert got, "the waiter got the lock"
    reclaims = ha.events.named("stale_reclaimed")
    if confirmed:
        assert reclaims == [], "a holder that came back in time was not robbed"
    else:
        assert [r.fields["reason"] for r in reclaims] == ["disconnected"]
        assert got[0] >= doubted, "the holder was in doubt before the waiter held"
    figures.record(
        "failover (leader killed) longer than reclaim_disconnected_after",
        reclaim_disconnected_after_s=RECLAIM_SHORTER,
        kill_to_new_primary_s=promoted - killed,
        kill_to_holder_in_doubt_s=doubted - killed,
        outcome="holder confirmed, waiter waited" if confirmed else "reclaimed (disconnected), holder lost",
        # <= 0: the holder had stopped believing before the waiter began to.
        split_brain_window_s=None if confirmed else doubted - got[0],
    )


# -- read-only nodes -------------------------------------------------------------------------------


def test_a_holder_whose_statements_land_on_a_read_only_node_neither_loses_nor_releases(
    sync_cluster: PatroniCluster, ha: HA, figures: Figures
) -> None:
    """A holder pinned to one node (no target_session_attrs) sees that node demoted by a switchover.

    Its heartbeats are refused as read-only: transient failures, retried,
    the lock still held on its lease. Its release is refused too: the caller
    is told the row may remain, and the Mutex deletes it once the node is a
    primary again.
    """
    cluster = sync_cluster
    pinned_node = cluster.leader()
    pinned = ha.mutex("pinned", dsn=pinned_node.dsn())
    with contextlib.ExitStack() as stack:
        assert stack.enter_context(pinned.acquire())
        section = ha.sections.enter("pinned")
        wait_until(lambda: len(ha.beats("pinned")) >= 2)
        cluster.switchover()
        demoted = time.monotonic()

        def read_only_failures() -> list[DatabaseError]:
            failed = [e.fields["error"] for e in ha.named("heartbeat_failed", "pinned", since=demoted)]
            return [error for error in failed if error.sqlstate == READ_ONLY]

        # Its node restarts as a standby: the heartbeats now reach it and are refused.
        wait_until(lambda: len(read_only_failures()) >= 3, timeout=60)
        first_refused = read_only_failures()[0]
        assert first_refused.transient, "read-only is a transient failure"
        assert pinned.held, "a refused heartbeat is not a loss"
        assert ha.events.named("lost") == []
        with pytest.raises(DatabaseError) as refused:
            pinned.heartbeat()
        assert refused.value.transient
        assert refused.value.sqlstate == READ_ONLY
        assert pinned.held
        assert ha.holder_id() == "pinned", "the row is intact on the new primary"
        ha.sections.leave(section)
        with pytest.raises(DatabaseError) as release_refused:
            stack.close()  # leaves the `with acquire()`: the release lands on the standby
    assert not isinstance(release_refused.value, LockNotHeldError), "refused, not lost"
    assert release_refused.value.transient
    assert "deleted in the background" in str(release_refused.value), "the caller is told the row stays for now"
    assert ha.named("released", "pinned") == [], "a refused release is not a release"
    assert ha.events.named("lost") == []
    assert ha.holder_id() == "pinned"
    # Its node becomes the primary again: the Mutex deletes the row it could not delete before.
    cluster.switchover(candidate=pinned_node)
    back = time.monotonic()
    wait_until(lambda: ha.holder_id() is None, timeout=30)
    figures.record(
        "holder pinned to a node that a switchover demotes",
        read_only_heartbeats_refused=len(read_only_failures()),
        sqlstate=READ_ONLY,
        transient=True,
        lost=False,
        released=False,
        row_deleted_after_node_was_primary_again_s=time.monotonic() - back,
    )


def test_an_acquire_on_a_standby_is_refused_as_a_transient_failure(sync_cluster: PatroniCluster, ha: HA) -> None:
    standby = sync_cluster.sync_standby()
    on_standby = ha.mutex("on-standby", dsn=standby.dsn())
    with pytest.raises(DatabaseError) as refused, on_standby.acquire():
        pytest.fail("must not run")
    assert refused.value.transient
    assert refused.value.sqlstate == READ_ONLY
    started = time.monotonic()
    with pytest.raises(MutexError), on_standby.acquire(blocking=True, timeout=1.0):
        pytest.fail("must not run")
    assert time.monotonic() - started < 1.0 + CONNECT_TIMEOUT + OPERATION_TIMEOUT + SLACK, "it gave up on time"
    assert ha.named("acquired", "on-standby") == []
    assert ha.named("contended", "on-standby") == [], "not mistaken for a held lock either"
    assert ha.holder_id() is None


def test_an_acquire_refused_by_a_standby_has_a_known_outcome(
    sync_cluster: PatroniCluster, ha: HA, caplog: pytest.LogCaptureFixture
) -> None:
    on_standby = ha.mutex("on-standby", dsn=sync_cluster.sync_standby().dsn())
    with pytest.raises(DatabaseError) as refused, on_standby.acquire():
        pytest.fail("must not run")
    assert refused.value.sqlstate == READ_ONLY
    assert refused.value.outcome_unknown is False, "the server answered: nothing was written"
    errors = [r.getMessage() for r in caplog.records if r.name == "postgres_mutex" and r.levelno >= logging.ERROR]
    assert errors == [], "nothing to warn about: no row can remain"


# -- synchronous replication: no two holders over repeated failovers ----------------------------------


def contend_through_faults(
    cluster: PatroniCluster, lock_name: str, tmp_path: Path, faults: list[str], *, workers: int = 3
) -> dict[str, Any]:
    """Worker processes contend for one lock while the cluster goes through ``faults`` (kill, switchover).

    Returns the figures; the critical sections are checked for overlaps by the caller.
    """
    stop = tmp_path / "stop"
    logs = [tmp_path / f"worker-{n}.log" for n in range(workers)]
    env = {
        **os.environ,
        "POSTGRES_MUTEX_DSN": cluster.dsn(),
        "CHAOS_LOCK": lock_name,
        "CHAOS_TIMING": json.dumps(TIMING),
        "CHAOS_STOP_FILE": str(stop),
    }
    # Their warnings (one per failed attempt during a fault) go to files: a pipe nobody
    # reads until the end would fill up and block them.
    stderr = [tmp_path / f"worker-{n}.stderr" for n in range(workers)]
    procs = []
    for n in range(workers):
        with open(stderr[n], "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "chaos.soak_worker", f"worker-{n}", "600", str(logs[n])],
                    cwd=ROOT,
                    env=env,
                    stderr=err,
                )
            )

    def sections_logged() -> int:
        return sum(len(log.read_text().splitlines()) for log in logs if log.exists())

    failovers: list[float] = []
    switchovers: list[float] = []
    try:
        for fault in faults:
            cluster.heal()
            # Contention is under way before each fault.
            logged = sections_logged()
            wait_until(lambda: sections_logged() >= logged + 3, timeout=60)  # noqa: B023
            started = time.monotonic()
            if fault == "kill":
                killed = cluster.kill_leader()
                cluster.wait_leader(other_than=killed, timeout=FAILOVER_DEADLINE)
                failovers.append(time.monotonic() - started)
            else:
                cluster.switchover()
                switchovers.append(time.monotonic() - started)
        faults_over = time.monotonic()
        logged = sections_logged()
        # Every fault over, the workers go on taking turns.
        wait_until(lambda: sections_logged() >= logged + 3, timeout=90)
        back_after = time.monotonic() - faults_over
    finally:
        stop.touch()
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=60))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait(10))
    errors = [path.read_text(errors="replace")[-2000:] for path in stderr]
    assert codes == [0] * workers, f"every worker finished: {errors}"
    sections = Sections()
    for log in logs:
        sections.add_log(log)
    overlaps = sections.overlaps()
    return {
        "sections": sections,
        "overlaps": overlaps,
        "figures": {
            "processes": workers,
            "failovers": len(failovers),
            "switchovers": len(switchovers),
            "failover_s": [round(f, 2) for f in failovers],
            "switchover_s": [round(s, 2) for s in switchovers],
            "critical_sections": len(sections.all()),
            "turns_resumed_after_last_fault_s": round(back_after, 2),
            "overlaps": len(overlaps),
        },
    }


@pytest.mark.parametrize(
    "faults",
    [
        pytest.param(["kill", "switchover"], id="failover-and-switchover"),
        pytest.param(
            ["kill", "switchover"] * 4,
            id="4-failovers-4-switchovers",
            marks=[pytest.mark.slow, pytest.mark.timeout(600)],
        ),
    ],
)
def test_synchronous_replication_failovers_under_contention_never_make_two_holders(
    sync_cluster: PatroniCluster, lock_name: str, tmp_path: Path, faults: list[str], figures: Figures
) -> None:
    outcome = contend_through_faults(sync_cluster, lock_name, tmp_path, faults)
    assert outcome["overlaps"] == [], "two holders at once"
    assert outcome["figures"]["critical_sections"] >= 6
    figures.record(f"synchronous replication, contention through {len(faults)} faults", **outcome["figures"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_asynchronous_replication_failovers_under_contention(
    async_cluster: PatroniCluster, lock_name: str, tmp_path: Path, figures: Figures
) -> None:
    """The same contention with asynchronous replication: overlaps are possible, and each is short."""
    outcome = contend_through_faults(async_cluster, lock_name, tmp_path, ["kill", "switchover"] * 4)
    longest = max((a.exit - b.enter for a, b in outcome["overlaps"] if a.exit is not None), default=0.0)
    assert longest < HEARTBEAT + CONNECT_TIMEOUT + OPERATION_TIMEOUT + SLACK
    figures.record(
        "asynchronous replication, contention through 8 faults",
        **outcome["figures"],
        longest_overlap_s=round(longest, 3),
    )


# -- asynchronous replication: a just-acquired row vanishes with the old primary ------------------------


@pytest.mark.parametrize(
    "rounds",
    [pytest.param(1, id="once"), pytest.param(5, id="5-times", marks=[pytest.mark.slow, pytest.mark.timeout(600)])],
)
def test_asynchronous_replication_a_just_acquired_row_can_vanish_with_the_old_primary(
    cluster: PatroniCluster, lock_name: str, rounds: int, figures: Figures
) -> None:
    """The leader dies before the holder's row reached the standby: the standby is promoted without it.

    A waiter then acquires on the new primary: for a moment two processes
    believe they hold the lock. The old holder's next heartbeat finds the row
    gone and declares the lock lost. The window is measured, and bounded by
    the holder's next heartbeat: one heartbeat interval plus one statement's deadline.
    """
    windows: list[float] = []
    told_after_promotion: list[float] = []
    for round_ in range(rounds):
        cluster.heal()
        leader = cluster.set_synchronous(False)
        ha = HA(cluster, f"{lock_name}-{round_}")
        try:
            holder, waiter = ha.mutex("holder"), ha.mutex("waiter")
            done = threading.Event()
            thread, got = ha.waiting(waiter, hold=done)
            with contextlib.ExitStack() as stack:
                with cluster.replication_paused(leader):
                    assert stack.enter_context(holder.acquire()), "acquired on the leader alone"
                    ha.sections.enter("holder")  # ends when on_lost fires
                    thread.start()
                    wait_until(lambda: len(ha.named("contended", "waiter")) >= 1)  # noqa: B023
                    killed = time.monotonic()
                    cluster.kill_node(leader)
                cluster.wait_leader(other_than=leader, timeout=FAILOVER_DEADLINE)
                promoted = time.monotonic()
                wait_until(lambda: got and ha.events.first("lost") is not None, timeout=LEASE)  # noqa: B023
                lost = ha.events.first("lost")
                assert lost is not None
                assert "deleted or taken over" in lost.fields["reason"], "told by its heartbeat, not by its lease"
                assert ha.beats("holder", since=killed) == [], "no heartbeat renewed a row that is gone"
                assert not holder.held
                with pytest.raises(LockNotHeldError):
                    stack.close()  # leaving the block: the lock was lost
            assert ha.holder_id() == "waiter", "the old holder's release did not touch the waiter's row"
            assert ha.named("stale_reclaimed", "waiter") == [], "the waiter found no row at all: no reclaim"
            done.set()
            thread.join(30)
            overlaps = ha.sections.overlaps()
            window = max((a.exit - b.enter for a, b in overlaps if a.exit is not None), default=0.0)
            windows.append(window)
            told_after_promotion.append(lost.at - promoted)
            # The holder's next heartbeat comes within one interval (failed ones are retried at most that far
            # apart) and takes at most a connect and a statement: the row's absence is news by then.
            assert window < HEARTBEAT + CONNECT_TIMEOUT + OPERATION_TIMEOUT + SLACK
        finally:
            ha.close()
    figures.record(
        f"asynchronous replication, row lost with the old primary ({rounds} rounds)",
        double_belief_window_s=[round(w, 3) for w in windows],
        holder_told_after_promotion_s=[round(t, 3) for t in told_after_promotion],
        told_by="its next heartbeat (row gone)",
        bound="heartbeat_interval + connect_timeout + operation_timeout (the holder's next heartbeat)",
    )


def test_asynchronous_replication_the_fence_rejects_the_old_holders_writes_while_it_still_believes(
    async_cluster: PatroniCluster, lock_name: str, figures: Figures
) -> None:
    """The row vanished with the old primary and another process holds the lock on the new one.

    The old holder still believes it holds the lock (here its heartbeats are
    held back, as a paused process's would be, so the belief lasts until its
    lease runs out). Every write it fences is refused on the new primary: the
    lock's row there is the new holder's. The new holder's token is greater
    than every token the new primary had seen; it need not be greater than
    the lost hold's, which the new primary never saw.
    """
    cluster = async_cluster
    leader = cluster.leader()
    ledger = f"ledger_{lock_name.replace('-', '_')}"
    with psycopg.connect(cluster.dsn(connect_timeout=5), autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {ledger} (id int PRIMARY KEY, writer text, token bigint)")
        admin.execute(f"INSERT INTO {ledger} VALUES (1, 'nobody', 0)")  # noqa: S608
    ha = HA(cluster, lock_name)
    try:
        old, new = ha.mutex("old-holder"), ha.mutex("new-holder")
        with old.acquire():  # replicated: the new primary has seen this token
            seen_token = old.token
        caught_up(leader, cluster.node(other_name(cluster, leader)))
        with contextlib.ExitStack() as stack:
            with cluster.replication_paused(leader):
                assert stack.enter_context(old.acquire()), "acquired on the leader alone"
                lost_token = old.token
                hold = old._lock.hold
                assert hold is not None
                hold.paused = True  # no heartbeat: it goes on believing, as a paused process would
                cluster.kill_node(leader)
            cluster.wait_leader(other_than=leader, timeout=FAILOVER_DEADLINE)
            assert stack.enter_context(new.acquire(blocking=True, timeout=FAILOVER_DEADLINE))
            assert old.held, "the old holder still believes it holds the lock"
            with psycopg.connect(cluster.dsn(connect_timeout=5)) as conn:
                with pytest.raises(LockNotHeldError, match="changed hands"), old.fenced(conn):
                    conn.execute(
                        f"UPDATE {ledger} SET writer = 'old-holder', token = %s WHERE id = 1",  # noqa: S608
                        (lost_token,),
                    )
                with new.fenced(conn) as token:
                    conn.execute(
                        f"UPDATE {ledger} SET writer = 'new-holder', token = %s WHERE id = 1",  # noqa: S608
                        (token,),
                    )
            new_token = new.token
            with psycopg.connect(cluster.dsn(connect_timeout=5), autocommit=True) as admin:
                assert admin.execute(f"SELECT writer, token FROM {ledger}").fetchone() == (  # noqa: S608
                    "new-holder",
                    new_token,
                ), "only the current holder's fenced write landed"
            assert seen_token is not None
            assert lost_token is not None
            assert new_token is not None
            assert new_token > seen_token, "greater than every token the new primary had seen"
            hold.paused = False
            with contextlib.suppress(LockNotHeldError):
                stack.close()
        figures.record(
            "asynchronous replication, fenced writes of the old holder",
            old_holder_fenced_write="refused (LockNotHeldError), rolled back",
            new_holder_fenced_write="landed",
            token_replicated_before=seen_token,
            token_lost_with_old_primary=lost_token,
            token_of_new_holder=new_token,
            new_token_greater_than_lost_one=new_token > lost_token,
        )
    finally:
        ha.close()
        cluster.heal()
        with psycopg.connect(cluster.dsn(connect_timeout=5), autocommit=True) as admin:
            admin.execute(f"DROP TABLE IF EXISTS {ledger}")


def caught_up(leader: Node, standby: Node) -> None:
    """Wait until ``standby`` has replayed everything ``leader`` has written so far."""
    with psycopg.connect(leader.dsn(connect_timeout=5), autocommit=True) as conn:
        found = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert found is not None
    target = found[0]

    def replayed() -> bool:
        with psycopg.connect(standby.dsn(connect_timeout=5), autocommit=True) as conn:
            row = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)).fetchone()
        return bool(row and row[0])

    wait_until(replayed, timeout=30, interval=0.1)


def other_name(cluster: PatroniCluster, leader: Node) -> str:
    """The name of the node that is not ``leader`` (the cluster has two)."""
    [name] = [node.name for node in cluster.nodes if node.name != leader.name]
    return name
