"""Every failure mode the docs promise, injected for real between a client and PostgreSQL.

Each scenario records its critical sections and its figures, as measured, in
its row of the session's report (chaos/report/chaos-report.{json,md}); it
records them before asserting on them, so a failing scenario's row says what
happened. When it ends, the `chaos` fixture counts overlaps with the one
checker (tests/support/exclusion.py) and the rows left that nobody holds, records
both in the same row, and fails the scenario unless both are zero.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any

import psycopg
import pytest

from chaos.conftest import Chaos
from chaos.harness import ALERT, HEARTBEAT, LEASE, STALE, Events
from postgres_mutex import DatabaseError, LockNotHeldError, Mutex
from tests.support.fixtures import (
    FAST,
    LISTENER_LOST,
    listens,
    read_held,
    release_channels,
    start_worker,
    wait_until,
)
from tests.support.postgres_server import PostgresServer

# How late a heartbeat may come on a busy machine: bounds "not before the threshold" checks.
SLACK = 0.3


def failed_attempt(record: logging.LogRecord, who: str) -> bool:
    """The library's log line for an acquire attempt of ``who`` that failed and is retried."""
    message = record.getMessage()
    return "retrying in" in message and f"instance_id {who!r}" in message


def beats(events: Events, who: str, since: float = 0.0) -> int:
    """Successful heartbeats of ``who`` after ``since``."""
    return sum(1 for e in events.named("heartbeat_latency") if e.fields["instance_id"] == who and e.at > since)


def last_beat(events: Events, who: str) -> float:
    times = [e.at for e in events.named("heartbeat_latency") if e.fields["instance_id"] == who]
    return max(times) if times else 0.0


def alerts_on(events: Events, who: str) -> list[Any]:
    return [e for e in events.named("alert") if e.fields["holder"] == who]


def contend(chaos: Chaos, contender: Mutex, seconds: float) -> int:
    """Try to take the lock now and then for ``seconds``; return how often it worked (it must not)."""
    won = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with chaos.sections.holding(contender, "contender") as acquired:
            won += acquired
        time.sleep(0.1)
    return won


@pytest.mark.scenario("1. partition < alert")
def test_1_a_partition_shorter_than_the_alert_threshold_changes_nothing(chaos: Chaos) -> None:
    net = chaos.net("holder")
    holder, contender = chaos.mutex("holder", net.dsn), chaos.mutex("contender")
    chaos.watch()
    with chaos.sections.holding(holder, "holder"):
        wait_until(lambda: beats(chaos.events, "holder") >= 2)
        cut = time.monotonic()
        with net.partitioned():
            won = contend(chaos, contender, ALERT * 0.6)
        healed = time.monotonic()
        wait_until(lambda: beats(chaos.events, "holder", since=healed) >= 2, timeout=10)
        resumed = min(e.at for e in chaos.events.named("heartbeat_latency") if e.at > healed) - healed
        kept = holder.held
    alerts = len(chaos.events.named("alert")) + len(chaos.watcher_events.named("alert"))
    reclaims = len(chaos.events.named("stale_reclaimed"))
    chaos.record(
        partition_s=healed - cut,
        heartbeat_resumed_after_heal_s=resumed,
        holder_kept_lock=kept,
        contender_acquired=won,
        alerts=alerts,
        reclaims=reclaims,
    )
    assert kept
    assert won == 0
    assert alerts == 0
    assert reclaims == 0


@pytest.mark.scenario("2. partition > alert, < stale")
def test_2_a_partition_past_the_alert_threshold_alerts_once_and_the_holder_keeps_the_lock(chaos: Chaos) -> None:
    net = chaos.net("holder")
    holder, contender = chaos.mutex("holder", net.dsn), chaos.mutex("contender")
    chaos.watch()
    with chaos.sections.holding(holder, "holder"):
        wait_until(lambda: beats(chaos.events, "holder") >= 2)
        cut = time.monotonic()
        with net.partitioned():
            silent_from = last_beat(chaos.events, "holder")
            won = contend(chaos, contender, (ALERT + LEASE) / 2)  # past the alert, well inside the lease
        healed = time.monotonic()
        wait_until(lambda: beats(chaos.events, "holder", since=healed) >= 2, timeout=10)
        kept = holder.held
        won += contend(chaos, contender, 0.5)
    alerts = alerts_on(chaos.watcher_events, "holder")
    contender_alerts = alerts_on(chaos.events, "holder")
    reclaims, losses = chaos.events.named("stale_reclaimed"), chaos.events.named("lost")
    chaos.record(
        partition_s=healed - cut,
        last_heartbeat_to_alert_s=alerts[0].at - silent_from if alerts else "no alert",
        watcher_alerts=len(alerts),
        contender_alerts=len(contender_alerts),
        holder_kept_lock=kept,
        contender_acquired=won,
        reclaims=len(reclaims),
        losses=len(losses),
    )
    assert kept, "the partition healed before the lease ran out"
    assert len(alerts) == 1, "the watcher alerts once for the episode"
    assert len(contender_alerts) == 1, "and so does the contender that saw it"
    assert won == 0
    assert reclaims == []
    assert losses == []


@pytest.mark.scenario("3. partition > stale")
def test_3_a_partition_past_the_stale_threshold_the_holder_knows_before_anyone_reclaims(chaos: Chaos) -> None:
    net = chaos.net("holder")
    holder, reclaimer = chaos.mutex("holder", net.dsn), chaos.mutex("reclaimer")
    chaos.watch()
    reclaimed = threading.Event()
    done = threading.Event()

    def reclaim() -> None:
        with chaos.sections.holding(reclaimer, "reclaimer", blocking=True, timeout=20):
            reclaimed.set()
            done.wait(20)

    with pytest.raises(LockNotHeldError), chaos.sections.holding(holder, "holder"):
        wait_until(lambda: beats(chaos.events, "holder") >= 2)
        thread = threading.Thread(target=reclaim)
        with net.partitioned():
            silent_from = last_beat(chaos.events, "holder")
            thread.start()
            assert reclaimed.wait(20), "the reclaimer got the lock"
        assert not holder.held
        with pytest.raises(LockNotHeldError):
            holder.heartbeat()  # after the heal: the lock is gone, and the holder is told
    holder_after = chaos.holder_id()
    done.set()
    thread.join(10)
    lost = chaos.events.first("lost")
    reclaim_event = chaos.events.first("stale_reclaimed")
    assert lost is not None
    assert reclaim_event is not None
    chaos.record(
        last_heartbeat_to_loss_s=lost.at - silent_from,
        last_heartbeat_to_reclaim_s=reclaim_event.at - silent_from,
        knew_before_reclaim_s=reclaim_event.at - lost.at,
        row_after_old_holders_release=holder_after,
    )
    assert holder_after == "reclaimer", "the old holder's release did not delete the new holder's row"
    assert reclaim_event.fields["previous_holder"] == "holder"
    assert lost.at < reclaim_event.at, "the holder learned of the loss before the reclaim"


@pytest.mark.scenario("4. slow holder < alert")
def test_4_a_slow_holder_below_the_alert_threshold_is_left_alone(chaos: Chaos) -> None:
    net = chaos.net("holder")
    latency_ms = int(HEARTBEAT * 1.5 * 1000)  # slower than the heartbeat interval
    holder, contender = chaos.mutex("holder", net.dsn), chaos.mutex("contender")
    chaos.watch()
    with chaos.sections.holding(holder, "holder"):
        wait_until(lambda: beats(chaos.events, "holder") >= 1)
        net.toxic("latency", "upstream", latency=latency_ms)
        slowed = time.monotonic()
        won = contend(chaos, contender, STALE * 1.2)
        cleared = time.monotonic()
        net.clear()
        kept = holder.held
    heartbeats = chaos.events.named("heartbeat_latency")
    slow = sorted(e.fields["seconds"] for e in heartbeats if slowed + 0.5 < e.at < cleared)
    alerts = len(chaos.events.named("alert")) + len(chaos.watcher_events.named("alert"))
    chaos.record(
        slowed_for_s=cleared - slowed,
        heartbeats_while_slow=len(slow),
        median_heartbeat_s=slow[len(slow) // 2] if slow else "none",
        holder_kept_lock=kept,
        contender_acquired=won,
        alerts=alerts,
    )
    assert slow, "heartbeats went on through the latency"
    assert min(slow) >= latency_ms / 1000 * 0.8, "the latency was there"
    assert kept
    assert won == 0
    assert alerts == 0


@pytest.mark.scenario("5. slow holder > alert")
def test_5_a_slow_holder_past_the_alert_threshold_is_alerted_on_not_robbed(chaos: Chaos) -> None:
    net = chaos.net("holder")
    latency_ms = int(ALERT * 1.3 * 1000)  # each heartbeat lands later than the alert threshold
    holder = chaos.mutex("holder", net.dsn, operation_timeout=ALERT * 3)
    contender = chaos.mutex("contender")
    chaos.watch()
    with chaos.sections.holding(holder, "holder"):
        wait_until(lambda: beats(chaos.events, "holder") >= 1)
        net.toxic("latency", "upstream", latency=latency_ms)
        slowed = time.monotonic()
        won = contend(chaos, contender, STALE * 1.4)
        cleared = time.monotonic()
        net.clear()
        kept = holder.held
    alerts = alerts_on(chaos.watcher_events, "holder")
    slow = sorted(e.fields["seconds"] for e in chaos.events.named("heartbeat_latency") if slowed < e.at < cleared)
    reclaims = len(chaos.events.named("stale_reclaimed"))
    chaos.record(
        slowed_for_s=cleared - slowed,
        slowest_heartbeat_s=slow[-1] if slow else "none",
        alerts=len(alerts),
        worst_silence_s=max(e.fields["seconds_since_heartbeat"] for e in alerts) if alerts else "none",
        holder_kept_lock=kept,
        contender_acquired=won,
        reclaims=reclaims,
    )
    assert kept, "slow, not dead: the holder keeps its lock"
    assert alerts, "the slowness was alerted on"
    assert won == 0
    assert reclaims == 0


@pytest.mark.scenario("6. holder crash (SIGKILL)")
def test_6_a_crashed_holder_is_alerted_on_then_reclaimed_at_the_stale_threshold(
    chaos: Chaos, workers: list[subprocess.Popen[str]]
) -> None:
    proc = start_worker("hold", chaos.pg.dsn(), chaos.lock_name)
    workers.append(proc)
    dead_id = read_held(proc)
    section = chaos.sections.enter(dead_id)
    reclaimer = chaos.mutex("reclaimer")
    chaos.watch()
    wait_until(chaos.renewed)  # it heartbeats: a live holder, then the crash
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    chaos.sections.leave(section)
    proc.wait(10)
    with chaos.sections.holding(reclaimer, "reclaimer", blocking=True, timeout=20):
        reclaimed = time.monotonic()
    alert = chaos.watcher_events.first("alert")
    reclaim_event = chaos.events.first("stale_reclaimed")
    assert alert is not None
    assert reclaim_event is not None
    chaos.record(
        crash_to_alert_s=alert.at - killed,
        crash_to_reclaim_s=reclaimed - killed,
        alert_named_the_dead_holder=alert.fields["holder"] == dead_id,
        reclaim_named_the_dead_holder=reclaim_event.fields["previous_holder"] == dead_id,
    )
    assert alert.fields["holder"] == dead_id
    assert reclaim_event.fields["previous_holder"] == dead_id
    dead_heartbeat = FAST["heartbeat_interval"]
    # The watcher measured the silence with the server's clock; the kill came at most a
    # heartbeat (plus scheduling delay on a busy machine) after the last heartbeat.
    assert alert.fields["seconds_since_heartbeat"] >= ALERT
    assert ALERT - dead_heartbeat - SLACK <= alert.at - killed < ALERT + 1.0
    assert reclaimed - killed >= STALE - dead_heartbeat - SLACK, "no reclaim before the stale threshold"
    assert reclaimed - killed < STALE + 1.5


@pytest.mark.scenario("7. reset while acquiring")
def test_7_a_reset_after_the_acquire_reached_the_server_leaves_no_orphan(
    chaos: Chaos, caplog: pytest.LogCaptureFixture
) -> None:
    net = chaos.net("acquirer")
    acquirer, other = chaos.mutex("acquirer", net.dsn, poll_interval=0.05), chaos.mutex("other")
    for _ in range(2):  # connected, and the acquire prepared: the next one is a single message
        with chaos.sections.holding(acquirer, "acquirer"):
            pass
    net.toxic("reset_peer", "downstream", timeout=0)  # the INSERT lands; its reply is a reset
    with pytest.raises(DatabaseError) as caught, chaos.sections.holding(acquirer, "acquirer"):
        pytest.fail("must not run")
    told_unknown = caught.value.outcome_unknown or caught.value.transient
    landed = chaos.holder_id()
    net.clear()
    healed = time.monotonic()
    with chaos.sections.holding(other, "other", blocking=True, timeout=STALE * 0.8) as acquired:
        got_it = time.monotonic() - healed
        assert acquired, "nobody waits out the stale threshold"
    assert told_unknown
    assert landed == "acquirer", "the unanswered INSERT did land: a row nobody holds"

    # A blocking acquire rides the reset out and takes back what its own attempt inserted.
    net.toxic("reset_peer", "downstream", timeout=0)
    seen: list[tuple[bool, str | None]] = []

    def blocking() -> None:
        with chaos.sections.holding(acquirer, "acquirer", blocking=True, timeout=20) as acquired:
            seen.append((acquired, chaos.holder_id()))

    logged = len(caplog.records)
    thread = threading.Thread(target=blocking)
    thread.start()
    # Its first attempt was reset (the log says it retries): heal then, not after a guessed delay.
    wait_until(lambda: any(failed_attempt(r, "acquirer") for r in caplog.records[logged:]), timeout=10)
    net.clear()
    thread.join(25)
    chaos.record(
        row_left_by_the_unanswered_insert=landed == "acquirer",
        caller_told_outcome_unknown=told_unknown,
        heal_to_next_acquisition_s=got_it,
        blocking_acquire_rode_out_a_reset=seen == [(True, "acquirer")],
    )
    assert seen == [(True, "acquirer")]


@pytest.mark.scenario("8. reset during release")
def test_8_a_reset_during_release_leaves_no_row_or_says_so(chaos: Chaos) -> None:
    net = chaos.net("holder")
    holder = chaos.mutex("holder", net.dsn, poll_interval=0.05)
    with chaos.sections.holding(holder, "holder"):
        pass  # connected, and the release prepared: the next one is a single message
    told: DatabaseError | None = None
    try:
        with chaos.sections.holding(holder, "holder"):
            net.toxic("reset_peer", "downstream", timeout=0)  # the DELETE lands; its reply is a reset
    except DatabaseError as exc:
        told = exc
    net.clear()
    healed = time.monotonic()
    wait_until(lambda: chaos.holder_id() is None, timeout=STALE)
    chaos.record(
        caller_told=told is not None,
        told_the_row_is_deleted_in_the_background="deleted in the background" in str(told),
        row_gone_after_heal_s=time.monotonic() - healed,
    )
    assert told is not None, "the release's reply was reset: the caller must hear of it"
    assert "deleted in the background" in str(told)


@pytest.mark.scenario("9. PostgreSQL restart")
def test_9_the_holder_rides_out_a_postgres_restart(own_pg: PostgresServer, chaos: Chaos) -> None:
    # own_pg first: it must outlive the chaos fixture, which looks for rows left on it.
    net = chaos.net("holder", server=own_pg)
    holder = chaos.mutex("holder", net.dsn)
    holder.create_schema()
    with chaos.sections.holding(holder, "holder"):
        wait_until(lambda: beats(chaos.events, "holder") >= 2)
        started = time.monotonic()
        own_pg.restart()
        restarted = time.monotonic()
        wait_until(lambda: beats(chaos.events, "holder", since=restarted) >= 3, timeout=20)
        first = min(e.at for e in chaos.events.named("heartbeat_latency") if e.at > restarted)
        kept = holder.held
    chaos.record(
        restart_s=restarted - started,
        heartbeat_back_after_s=first - restarted,
        holder_kept_lock=kept,
        losses=len(chaos.events.named("lost")),
    )
    assert kept
    assert chaos.events.named("lost") == []


@pytest.mark.scenario("10. waiter partitioned at release")
def test_10_a_waiter_partitioned_during_the_release_acquires_after_the_heal(
    chaos: Chaos, caplog: pytest.LogCaptureFixture
) -> None:
    net = chaos.net("waiter")
    holder, waiter = chaos.mutex("holder"), chaos.mutex("waiter", net.dsn, poll_interval=0.2)
    acquired_at: list[float] = []

    def wait() -> None:
        with chaos.sections.holding(waiter, "waiter", blocking=True, timeout=30):
            acquired_at.append(time.monotonic())

    def contended(who: str) -> int:
        return sum(1 for e in chaos.events.named("contended") if e.fields["instance_id"] == who)

    # The test hears the release's notification on a direct connection of its own, on whichever
    # channel the release chooses (the waiter's slot's, as it registered there).
    with psycopg.connect(chaos.pg.dsn(), autocommit=True) as ears:
        for channel in release_channels(chaos.lock_name):
            ears.execute(f'LISTEN "{channel}"')
        with chaos.sections.holding(holder, "holder"):
            thread = threading.Thread(target=wait)
            thread.start()
            # Observed, not slept on: the waiter LISTENs and has tried again since, so only a
            # wake-up (the notification) or its poll can hand it the lock now.
            wait_until(lambda: listens(waiter) and contended("waiter") >= 2, timeout=10)
            was_listening = listens(waiter)
            net.partition()
            cut = time.monotonic()
            logged = len(caplog.records)
        heard = list(ears.notifies(timeout=10, stop_after=1))
    # The release was announced; the waiter, cut off, did not hear it. Its next poll runs
    # into the partition and fails at its deadline (it logs the retry): heal only then.
    wait_until(lambda: any(failed_attempt(r, "waiter") for r in caplog.records[logged:]), timeout=10)
    during_partition = list(acquired_at)
    reconnections = len([r for r in caplog.records if LISTENER_LOST in r.getMessage()])
    net.clear()
    healed = time.monotonic()
    thread.join(30)
    reconnected = len([r for r in caplog.records if LISTENER_LOST in r.getMessage()]) > reconnections
    chaos.record(
        waiter_was_listening=was_listening,
        notification_sent=len(heard) == 1,
        acquired_during_partition=len(during_partition),
        partition_s=healed - cut,
        heal_to_acquisition_s=acquired_at[0] - healed if acquired_at else "never",
        listener_reconnected_after_heal=reconnected,
    )
    assert was_listening
    assert len(heard) == 1, "the release did send its notification"
    assert during_partition == [], "the notification was lost in the partition"
    assert acquired_at, "no deadlock: the waiter got the lock after the heal"


@pytest.mark.scenario("11. clock skew (+3h / -3h)")
def test_11_clients_with_skewed_clocks_get_correct_staleness(
    chaos: Chaos, workers: list[subprocess.Popen[str]]
) -> None:
    """A holder whose wall clock is three hours fast, a waiter three hours slow: only the server's clock counts.

    What is skewed: every wall-clock reading of ``time`` in the worker processes
    (``time.time``, ``time.time_ns``, ``time.clock_gettime(_ns)(CLOCK_REALTIME)``),
    not the monotonic or boot-time clocks, nor the kernel's or libpq's. That
    suffices because the library reads no wall clock for any decision:
    tests/integration/test_wall_clock.py fails if any of its code does.
    """

    def skewed(offset: float, *args: str) -> subprocess.Popen[str]:
        return start_worker(*args, env={"WORKER_WALL_CLOCK_OFFSET": str(offset)})

    holder = skewed(3 * 3600, "hold", chaos.pg.dsn(), chaos.lock_name)
    workers.append(holder)
    assert holder.stdout is not None
    line = holder.stdout.readline().split()
    assert line[0] == "held", line
    holder_id, holder_offset = line[1], float(line[3]) - time.time()
    holder_section = chaos.sections.enter(holder_id, at=float(line[2]))
    waiter = skewed(-3 * 3600, "wait", chaos.pg.dsn(), chaos.lock_name)
    workers.append(waiter)
    assert waiter.stdout is not None
    assert waiter.stdout.readline() == "waiting\n"
    # Had any client clock counted, the holder would look stale within this window: watch it,
    # all along, keep its lock.
    watched_from = time.monotonic()
    while time.monotonic() - watched_from < FAST["stale_threshold"] * 2:
        assert waiter.poll() is None, waiter.stderr.read() if waiter.stderr else ""
        assert chaos.holder_id() == holder_id, "the waiter did not take a live holder's lock"
        time.sleep(0.05)
    kept_for = time.monotonic() - watched_from
    os.kill(holder.pid, signal.SIGKILL)
    killed = time.monotonic()
    chaos.sections.leave(holder_section)
    line = waiter.stdout.readline().split()
    assert line[0] == "held", line
    reclaimed_at, waiter_offset = float(line[2]), float(line[3]) - time.time()
    waiter_section = chaos.sections.enter(line[1], at=reclaimed_at)
    waiter.kill()
    waiter.wait(10)
    chaos.sections.leave(waiter_section)
    chaos.admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (chaos.lock_name,))  # the killed waiter's row
    chaos.record(
        holder_wall_clock_offset_h=holder_offset / 3600,
        waiter_wall_clock_offset_h=waiter_offset / 3600,
        live_holder_kept_lock_for_s=kept_for,
        crash_to_reclaim_s=reclaimed_at - killed,
    )
    assert holder_offset > 3 * 3600 - 60, "the holder's wall clock really is three hours fast"
    assert waiter_offset < -3 * 3600 + 60, "the waiter's really is three hours slow"
    assert FAST["stale_threshold"] - FAST["heartbeat_interval"] - SLACK <= reclaimed_at - killed
    assert reclaimed_at - killed < FAST["stale_threshold"] + 1.5
