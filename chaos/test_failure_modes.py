"""Every failure mode the README promises, injected for real between a client and PostgreSQL.

Each scenario records its critical sections (the `chaos` fixture fails it on
any overlap, and on any row left that nobody holds) and its measured figures
(the session's report: chaos/report/chaos-report.{json,md}).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any

import pytest

from chaos.conftest import Chaos
from chaos.harness import ALERT, HEARTBEAT, LEASE, STALE, Events, Report
from postgres_mutex import DatabaseError, LockNotHeldError, Mutex
from tests.fixtures import FAST, read_held, start_worker, wait_until
from tests.postgres_server import PostgresServer

# How late a heartbeat may come on a busy machine: bounds "not before the threshold" checks.
SLACK = 0.3


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


def test_1_a_partition_shorter_than_the_alert_threshold_changes_nothing(chaos: Chaos, report: Report) -> None:
    net = chaos.net("holder")
    holder, contender = chaos.mutex("holder", net.dsn), chaos.mutex("contender")
    chaos.watch()
    with chaos.sections.holding(holder, "holder"):
        wait_until(lambda: beats(chaos.events, "holder") >= 2)
        with net.partitioned():
            won = contend(chaos, contender, ALERT * 0.6)
        healed = time.monotonic()
        wait_until(lambda: beats(chaos.events, "holder", since=healed) >= 2, timeout=10)
        resumed = min(e.at for e in chaos.events.named("heartbeat_latency") if e.at > healed) - healed
        assert holder.held
    assert won == 0
    assert chaos.events.named("alert") == []
    assert chaos.events.named("stale_reclaimed") == []
    report.record("1. partition < alert", partition_s=ALERT * 0.6, heartbeat_resumed_after_heal_s=resumed, overlaps=0)


def test_2_a_partition_past_the_alert_threshold_alerts_once_and_the_holder_keeps_the_lock(
    chaos: Chaos, report: Report
) -> None:
    net = chaos.net("holder")
    holder, contender = chaos.mutex("holder", net.dsn), chaos.mutex("contender")
    chaos.watch()
    with chaos.sections.holding(holder, "holder"):
        wait_until(lambda: beats(chaos.events, "holder") >= 2)
        with net.partitioned():
            silent_from = last_beat(chaos.events, "holder")
            won = contend(chaos, contender, (ALERT + LEASE) / 2)  # past the alert, well inside the lease
        healed = time.monotonic()
        wait_until(lambda: beats(chaos.events, "holder", since=healed) >= 2, timeout=10)
        assert holder.held, "the partition healed before the lease ran out"
        contend(chaos, contender, 0.5)
    alerts = alerts_on(chaos.watcher_events, "holder")
    assert len(alerts) == 1, "the watcher alerts once for the episode"
    assert len(alerts_on(chaos.events, "holder")) == 1, "and so does the contender that saw it"
    assert won == 0
    assert chaos.events.named("stale_reclaimed") == []
    assert chaos.events.named("lost") == []
    report.record(
        "2. partition > alert, < stale",
        last_heartbeat_to_alert_s=alerts[0].at - silent_from,
        alert_threshold_s=ALERT,
        overlaps=0,
    )


def test_3_a_partition_past_the_stale_threshold_the_holder_knows_before_anyone_reclaims(
    chaos: Chaos, report: Report
) -> None:
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
    assert chaos.holder_id() == "reclaimer", "the old holder's release did not delete the new holder's row"
    done.set()
    thread.join(10)
    lost = chaos.events.first("lost")
    reclaim_event = chaos.events.first("stale_reclaimed")
    assert lost is not None
    assert reclaim_event is not None
    assert reclaim_event.fields["previous_holder"] == "holder"
    assert lost.at < reclaim_event.at, "the holder learned of the loss before the reclaim"
    report.record(
        "3. partition > stale",
        last_heartbeat_to_loss_s=lost.at - silent_from,
        last_heartbeat_to_reclaim_s=reclaim_event.at - silent_from,
        knew_before_reclaim_s=reclaim_event.at - lost.at,
        overlaps=0,
    )


def test_4_a_slow_holder_below_the_alert_threshold_is_left_alone(chaos: Chaos, report: Report) -> None:
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
        assert holder.held
    heartbeats = chaos.events.named("heartbeat_latency")
    slow = [e.fields["seconds"] for e in heartbeats if slowed + 0.5 < e.at < cleared]
    assert slow, "heartbeats went on through the latency"
    assert min(slow) >= latency_ms / 1000 * 0.8
    assert won == 0
    assert chaos.events.named("alert") == []
    assert chaos.watcher_events.named("alert") == []
    report.record(
        "4. slow holder < alert",
        latency_s=latency_ms / 1000,
        median_heartbeat_s=sorted(slow)[len(slow) // 2],
        overlaps=0,
    )


def test_5_a_slow_holder_past_the_alert_threshold_is_alerted_on_not_robbed(chaos: Chaos, report: Report) -> None:
    net = chaos.net("holder")
    latency_ms = int(ALERT * 1.3 * 1000)  # each heartbeat lands later than the alert threshold
    holder = chaos.mutex("holder", net.dsn, operation_timeout=ALERT * 3)
    contender = chaos.mutex("contender")
    chaos.watch()
    with chaos.sections.holding(holder, "holder"):
        wait_until(lambda: beats(chaos.events, "holder") >= 1)
        net.toxic("latency", "upstream", latency=latency_ms)
        won = contend(chaos, contender, STALE * 1.4)
        net.clear()
        assert holder.held, "slow, not dead: the holder keeps its lock"
    alerts = alerts_on(chaos.watcher_events, "holder")
    assert alerts, "the slowness was alerted on"
    assert won == 0
    assert chaos.events.named("stale_reclaimed") == []
    worst = max(e.fields["seconds_since_heartbeat"] for e in alerts)
    report.record(
        "5. slow holder > alert", latency_s=latency_ms / 1000, alerts=len(alerts), worst_silence_s=worst, overlaps=0
    )


def test_6_a_crashed_holder_is_alerted_on_then_reclaimed_at_the_stale_threshold(
    chaos: Chaos, report: Report, workers: list[subprocess.Popen[str]]
) -> None:
    proc = start_worker("hold", chaos.pg.dsn(), chaos.lock_name)
    workers.append(proc)
    dead_id = read_held(proc)
    section = chaos.sections.enter(dead_id)
    reclaimer = chaos.mutex("reclaimer")
    chaos.watch()
    time.sleep(FAST["heartbeat_interval"] * 3)  # a few heartbeats before the crash
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    chaos.sections.leave(section)
    proc.wait(10)
    with chaos.sections.holding(reclaimer, "reclaimer", blocking=True, timeout=20):
        reclaimed = time.monotonic()
    alert = chaos.watcher_events.first("alert")
    reclaim_event = chaos.events.first("stale_reclaimed")
    assert alert is not None
    assert alert.fields["holder"] == dead_id
    assert reclaim_event is not None
    assert reclaim_event.fields["previous_holder"] == dead_id
    dead_heartbeat = FAST["heartbeat_interval"]
    # The watcher measured the silence with the server's clock; the kill came at most a
    # heartbeat (plus scheduling delay on a busy machine) after the last heartbeat.
    assert alert.fields["seconds_since_heartbeat"] >= ALERT
    assert ALERT - dead_heartbeat - SLACK <= alert.at - killed < ALERT + 1.0
    assert reclaimed - killed >= STALE - dead_heartbeat - SLACK, "no reclaim before the stale threshold"
    assert reclaimed - killed < STALE + 1.5
    report.record(
        "6. holder crash (SIGKILL)",
        crash_to_alert_s=alert.at - killed,
        crash_to_reclaim_s=reclaimed - killed,
        overlaps=0,
    )


def test_7_a_reset_after_the_acquire_reached_the_server_leaves_no_orphan(chaos: Chaos, report: Report) -> None:
    net = chaos.net("acquirer")
    acquirer, other = chaos.mutex("acquirer", net.dsn, poll_interval=0.05), chaos.mutex("other")
    with chaos.sections.holding(acquirer, "acquirer"):
        pass  # connected
    net.toxic("reset_peer", "downstream", timeout=0)  # the INSERT lands; its reply is a reset
    with pytest.raises(DatabaseError) as caught, chaos.sections.holding(acquirer, "acquirer"):
        pytest.fail("must not run")
    assert caught.value.outcome_unknown or caught.value.transient
    assert chaos.holder_id() == "acquirer", "the unanswered INSERT did land: a row nobody holds"
    net.clear()
    healed = time.monotonic()
    with chaos.sections.holding(other, "other", blocking=True, timeout=STALE * 0.8) as acquired:
        got_it = time.monotonic() - healed
        assert acquired, "nobody waits out the stale threshold"

    # A blocking acquire rides the reset out and takes back what its own attempt inserted.
    net.toxic("reset_peer", "downstream", timeout=0)
    seen: list[tuple[bool, str | None]] = []

    def blocking() -> None:
        with chaos.sections.holding(acquirer, "acquirer", blocking=True, timeout=20) as acquired:
            seen.append((acquired, chaos.holder_id()))

    thread = threading.Thread(target=blocking)
    thread.start()
    time.sleep(0.5)
    net.clear()
    thread.join(25)
    assert seen == [(True, "acquirer")]
    report.record("7. reset while acquiring", heal_to_next_acquisition_s=got_it, stale_threshold_s=STALE, overlaps=0)


def test_8_a_reset_during_release_leaves_no_row_or_says_so(chaos: Chaos, report: Report) -> None:
    net = chaos.net("holder")
    holder = chaos.mutex("holder", net.dsn, poll_interval=0.05)
    told: DatabaseError | None = None
    try:
        with chaos.sections.holding(holder, "holder"):
            net.toxic("reset_peer", "downstream", timeout=0)  # the DELETE lands; its reply is a reset
    except DatabaseError as exc:
        told = exc
    assert told is not None, "the release's reply was reset: the caller must hear of it"
    assert "deleted in the background" in str(told)
    net.clear()
    healed = time.monotonic()
    wait_until(lambda: chaos.holder_id() is None, timeout=STALE)
    report.record(
        "8. reset during release",
        caller_told=told is not None,
        row_gone_after_heal_s=time.monotonic() - healed,
        overlaps=0,
    )


def test_9_the_holder_rides_out_a_postgres_restart(chaos: Chaos, report: Report, own_pg: PostgresServer) -> None:
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
        assert holder.held
    report.record(
        "9. PostgreSQL restart", restart_s=restarted - started, heartbeat_back_after_s=first - restarted, overlaps=0
    )


def test_10_a_waiter_partitioned_during_the_release_acquires_after_the_heal(chaos: Chaos, report: Report) -> None:
    net = chaos.net("waiter")
    holder, waiter = chaos.mutex("holder"), chaos.mutex("waiter", net.dsn, poll_interval=0.2)
    acquired_at: list[float] = []

    def wait() -> None:
        with chaos.sections.holding(waiter, "waiter", blocking=True, timeout=30):
            acquired_at.append(time.monotonic())

    with chaos.sections.holding(holder, "holder"):
        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.5)  # the waiter is waiting (and listening)
        net.partition()
    time.sleep(1.0)  # the release's notification is lost in the partition
    assert not acquired_at
    net.clear()
    healed = time.monotonic()
    thread.join(30)
    assert acquired_at, "no deadlock: the waiter got the lock after the heal"
    report.record("10. waiter partitioned at release", heal_to_acquisition_s=acquired_at[0] - healed, overlaps=0)


def test_11_clients_with_skewed_clocks_get_correct_staleness(
    chaos: Chaos, report: Report, workers: list[subprocess.Popen[str]]
) -> None:
    """A holder whose wall clock is three hours fast, a waiter three hours slow: only the server's clock counts."""

    def skewed(offset: float, *args: str) -> subprocess.Popen[str]:
        return start_worker(*args, env={"WORKER_WALL_CLOCK_OFFSET": str(offset)})

    holder = skewed(3 * 3600, "hold", chaos.pg.dsn(), chaos.lock_name)
    workers.append(holder)
    assert holder.stdout is not None
    line = holder.stdout.readline().split()
    assert line[0] == "held", line
    holder_id, wall = line[1], float(line[3])
    assert wall - time.time() > 3 * 3600 - 60, "the holder's wall clock really is three hours fast"
    holder_section = chaos.sections.enter(holder_id, at=float(line[2]))
    waiter = skewed(-3 * 3600, "wait", chaos.pg.dsn(), chaos.lock_name)
    workers.append(waiter)
    assert waiter.stdout is not None
    assert waiter.stdout.readline() == "waiting\n"
    time.sleep(FAST["stale_threshold"] * 2)  # had any client clock counted, the holder would look stale by now
    assert waiter.poll() is None, waiter.stderr.read() if waiter.stderr else ""
    assert chaos.holder_id() == holder_id, "the waiter did not take a live holder's lock"
    os.kill(holder.pid, signal.SIGKILL)
    killed = time.monotonic()
    chaos.sections.leave(holder_section)
    line = waiter.stdout.readline().split()
    assert line[0] == "held", line
    reclaimed_at = float(line[2])
    waiter_section = chaos.sections.enter(line[1], at=reclaimed_at)
    waiter.kill()
    waiter.wait(10)
    chaos.sections.leave(waiter_section)
    assert FAST["stale_threshold"] - FAST["heartbeat_interval"] - SLACK <= reclaimed_at - killed
    assert reclaimed_at - killed < FAST["stale_threshold"] + 1.5
    chaos.admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (chaos.lock_name,))  # the killed waiter's row
    report.record(
        "11. clock skew (+3h / -3h)",
        crash_to_reclaim_s=reclaimed_at - killed,
        stale_threshold_s=FAST["stale_threshold"],
        overlaps=0,
    )
