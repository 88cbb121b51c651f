"""Heartbeats keep a held lock fresh; when they cannot, the job learns it lost the lock."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import psycopg
import pytest

from postgres_mutex import LockAcquisitionTimeout, LockNotHeldError, Mutex
from postgres_mutex._base.clock import now
from postgres_mutex._state import heartbeat_flows
from tests.support.fixtures import (
    FAST,
    RecordingMetrics,
    await_until,
    freeze,
    role_with_setting,
    row_locked,
    wait_until,
)
from tests.support.postgres_server import PostgresServer

Row = Callable[..., tuple[Any, ...] | None]
Holder = Callable[..., str | None]


def test_heartbeats_keep_the_row_fresh_past_the_stale_threshold(
    make_mutex: Callable[..., Mutex], row: Row, holder_id: Holder, metrics: RecordingMetrics
) -> None:
    holder, contender = make_mutex(metrics=metrics), make_mutex()
    with holder.acquire():
        deadline = time.monotonic() + FAST["stale_threshold"] * 1.5
        while time.monotonic() < deadline:
            found = row()
            assert found is not None
            assert found[1] < FAST["alert_threshold"], "the heartbeat never fell behind"
            with contender.acquire() as acquired:
                assert not acquired
            time.sleep(0.1)
        assert holder.held
        assert holder_id() == holder.instance_id
    latencies = metrics.named("heartbeat_latency")
    assert len(latencies) >= 5
    assert all(0 < call["seconds"] < FAST["operation_timeout"] for call in latencies)


def test_heartbeat_updates_are_hot(dsn: str, admin: psycopg.Connection[Any], lock_name: str) -> None:
    table = f"hot_{uuid.uuid4().hex[:10]}"
    mutex = Mutex(dsn, lock_name, table=table, **FAST)  # type: ignore[arg-type]
    mutex.create_schema()
    with mutex.acquire():
        for _ in range(20):
            mutex.heartbeat()
    mutex.close()  # a backend flushes its statistics when its session ends

    def counts() -> tuple[int, int]:
        found = admin.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = %s", (table,)
        ).fetchone()
        assert found is not None
        return int(found[0]), int(found[1])

    wait_until(lambda: counts()[0] >= 20)
    updates, hot = counts()
    assert hot == updates, f"{updates - hot} of {updates} heartbeat updates were not HOT"
    admin.execute(f'DROP TABLE "{table}"')


def test_manual_heartbeat_renews_and_refuses_when_not_held(make_mutex: Callable[..., Mutex], row: Row) -> None:
    mutex = make_mutex(heartbeat_interval=0.5, alert_threshold=5.0, stale_threshold=10.0)
    with pytest.raises(LockNotHeldError, match="does not hold"):
        mutex.heartbeat()
    with mutex.acquire():
        time.sleep(0.3)
        before = row()
        mutex.heartbeat()
        after = row()
        assert before is not None
        assert after is not None
        assert after[1] < before[1]
    with pytest.raises(LockNotHeldError):
        mutex.heartbeat()


def test_a_waiting_singleton_sibling_never_starves_the_holders_heartbeat(
    make_mutex: Callable[..., Mutex], lock_name: str, metrics: RecordingMetrics
) -> None:
    holder = make_mutex(lock_name=f"{lock_name}-held", poll_interval=45.0, metrics=metrics)
    other = make_mutex(lock_name=f"{lock_name}-busy")
    waiting = threading.Event()

    @holder.singleton(f"{lock_name}-busy", blocking=True, timeout=3.0)
    def job() -> None:
        pytest.fail("the sibling's lock is busy")

    timed_out: list[BaseException] = []

    def run_job() -> None:
        waiting.set()
        try:
            job()
        except LockAcquisitionTimeout as exc:
            timed_out.append(exc)

    with holder.acquire(), other.acquire():
        thread = threading.Thread(target=run_job)
        thread.start()
        waiting.wait(5)
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            assert holder.held
            time.sleep(0.05)
        thread.join(timeout=10)
    assert len(timed_out) == 1, "the sibling waited its whole timeout, on the listener, not on the connection"
    assert metrics.named("alert") == []
    assert metrics.named("lost") == []


@pytest.fixture
def idle_closing_role(pg: PostgresServer, admin: psycopg.Connection[Any], needs_superuser: None) -> Iterator[str]:
    yield from role_with_setting(pg, admin, "idle_session_timeout = '300ms'")


def test_a_server_closing_idle_sessions_between_heartbeats_is_ridden_out_quietly(
    idle_closing_role: str, lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = RecordingMetrics()
    mutex = Mutex(
        idle_closing_role, lock_name, heartbeat_interval=0.5, alert_threshold=2.0, stale_threshold=6.0, metrics=metrics
    )
    with caplog.at_level(logging.WARNING, logger="postgres_mutex"), mutex.acquire():
        wait_until(lambda: len(metrics.named("heartbeat_latency")) >= 6, timeout=15)
        assert mutex.held
    mutex.close()
    assert metrics.named("heartbeat_failed") == [], "a connection closed while idle is no failure"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


class LostRecorder:
    def __init__(self) -> None:
        self.errors: list[LockNotHeldError] = []
        self.called = threading.Event()

    def __call__(self, error: LockNotHeldError) -> None:
        self.errors.append(error)
        self.called.set()


def test_a_deleted_row_is_noticed_by_the_next_heartbeat(
    make_mutex: Callable[..., Mutex],
    admin: psycopg.Connection[Any],
    lock_name: str,
    holder_id: Holder,
    metrics: RecordingMetrics,
) -> None:
    lost = LostRecorder()
    holder = make_mutex(on_lost=lost, metrics=metrics)
    newcomer = make_mutex()
    with ExitStack() as newcomer_holds:
        with pytest.raises(LockNotHeldError, match="deleted or taken over") as exited, holder.acquire():
            admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
            assert lost.called.wait(5), "on_lost fired"
            assert not holder.held
            with pytest.raises(LockNotHeldError):
                holder.ensure_held()
            assert newcomer_holds.enter_context(newcomer.acquire())
        # The old holder leaving its block did not delete the newcomer's row.
        assert holder_id() == newcomer.instance_id
    assert exited.value.lock_name == lock_name
    assert exited.value.instance_id == holder.instance_id
    assert len(lost.errors) == 1
    assert lost.errors[0].reason == exited.value.reason
    assert [call["reason"] for call in metrics.named("lost")] == [lost.errors[0].reason]


def test_the_lease_runs_out_before_anyone_may_reclaim_the_row(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str, row: Row, metrics: RecordingMetrics
) -> None:
    heartbeat_age_at_loss: list[float] = []

    def on_lost(error: LockNotHeldError) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            found = conn.execute(
                "SELECT EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 FROM mutex_lock WHERE lock_name = %s",
                (lock_name,),
            ).fetchone()
        assert found is not None
        heartbeat_age_at_loss.append(found[0])

    holder = make_mutex(on_lost=on_lost, metrics=metrics, operation_timeout=0.3)
    with pytest.raises(LockNotHeldError, match="lease ran out"), holder.acquire():
        with row_locked(dsn, lock_name):
            wait_until(lambda: bool(heartbeat_age_at_loss), timeout=10)
            assert not holder.held
        assert row() is not None, "the row is still there: nobody could reclaim it yet"
    assert heartbeat_age_at_loss[0] < FAST["stale_threshold"], "the holder knew before the row became reclaimable"
    assert len(metrics.named("heartbeat_failed")) >= 2, "failed heartbeats were retried and counted"
    wait_until(lambda: row() is None)  # leaving the block still removes the row, in the background


class SlowHandler(logging.Handler):
    """A log handler that takes ``seconds`` over each loss's line (a remote log service, slow to answer)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(logging.ERROR)
        self.seconds = seconds

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("lost "):
            time.sleep(self.seconds)


def test_on_lost_comes_when_the_lease_runs_out_not_after_the_losses_log_lines(
    make_mutex: Callable[..., Mutex], lock_name: str
) -> None:
    # Two holds renewed by one heartbeat statement run out together (as thousands do in a partition);
    # each loss's line goes through a slow handler. Each holder's notice depends on the clock alone,
    # not on the I/O of its own log line nor of the other loss's.
    told: dict[str, float] = {}

    def recorder(name: str) -> Callable[[LockNotHeldError], object]:
        return lambda error: told.setdefault(name, now())

    holders = [make_mutex(lock_name=f"{lock_name}-{n}", on_lost=recorder(f"{lock_name}-{n}")) for n in range(2)]
    handler = SlowHandler(0.5)
    library_log = logging.getLogger("postgres_mutex")
    with ExitStack() as stack:
        for holder in holders:
            stack.enter_context(pytest.raises(LockNotHeldError))
            assert stack.enter_context(holder.acquire())
        hold_of = [holder._lock.hold for holder in holders]
        wait_until(lambda: len({hold.lease_deadline for hold in hold_of if hold}) == 1)  # one heartbeat renewed both
        for holder in holders:
            freeze(holder)
        deadline = max(hold.lease_deadline for hold in hold_of if hold)
        library_log.addHandler(handler)
        stack.callback(library_log.removeHandler, handler)
        wait_until(lambda: len(told) == 2, timeout=FAST["stale_threshold"] + 5)
    late = {name: round(at - deadline, 3) for name, at in told.items()}
    assert all(seconds < 0.25 for seconds in late.values()), f"on_lost came this late after the lease: {late}"


def test_heartbeats_recover_from_a_stall_shorter_than_the_lease(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str, metrics: RecordingMetrics
) -> None:
    lost = LostRecorder()
    holder = make_mutex(on_lost=lost, metrics=metrics, operation_timeout=0.2)
    with holder.acquire():
        with row_locked(dsn, lock_name):
            wait_until(lambda: len(metrics.named("heartbeat_failed")) >= 1)
        failures = len(metrics.named("heartbeat_failed"))
        latencies = len(metrics.named("heartbeat_latency"))
        wait_until(lambda: len(metrics.named("heartbeat_latency")) > latencies + 2)
        assert holder.held
        holder.ensure_held()
    assert not lost.errors
    assert failures >= 1


def test_a_job_checking_ensure_held_stops_promptly_after_a_loss(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    holder = make_mutex()
    steps = 0
    with pytest.raises(LockNotHeldError), holder.acquire():
        admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            holder.ensure_held()
            steps += 1
            time.sleep(0.01)
        pytest.fail("ensure_held never noticed the loss")
    assert steps < 200


def test_a_broken_on_lost_callback_does_not_hide_the_loss(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    def on_lost(error: LockNotHeldError) -> None:
        raise RuntimeError("callback bug")

    holder = make_mutex(on_lost=on_lost)
    with pytest.raises(LockNotHeldError), holder.acquire():
        admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
        wait_until(lambda: not holder.held)


async def test_async_holder_learns_of_a_deleted_row(
    amake_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    lost = asyncio.Event()
    errors: list[LockNotHeldError] = []

    def on_lost(error: LockNotHeldError) -> None:
        # An async hold's heartbeat task calls this on the event loop's thread.
        errors.append(error)
        lost.set()

    holder = amake_mutex(on_lost=on_lost)
    with pytest.raises(LockNotHeldError):
        async with holder.acquire_async():
            admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
            await asyncio.wait_for(lost.wait(), 10)
            assert not holder.held
            with pytest.raises(LockNotHeldError):
                await holder.heartbeat_async()
    assert len(errors) == 1


class _FailingRounds:
    """Stands for a defect in the heartbeat: its first ``times`` rounds raise what no statement raises."""

    def __init__(self, times: int) -> None:
        self.real = heartbeat_flows.heartbeat
        self.times = times
        self.failed_at: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.failed_at) < self.times:
            self.failed_at.append(time.monotonic())
            raise RuntimeError("a defect in the heartbeat")
        return self.real(*args, **kwargs)

    def kept_fresh(self, holder: Mutex, row: Row) -> bool:
        """Whether the hold is still held and its row fresh, until a lease after the first failure (then True)."""
        found = row()
        assert holder.held, "the hold expired after a failed heartbeat round"
        assert found is not None
        assert found[1] < FAST["stale_threshold"] / 2, f"the heartbeats stopped: the last one {found[1]:.2f}s ago"
        return time.monotonic() > self.failed_at[0] + FAST["stale_threshold"] + 2 * FAST["heartbeat_interval"]


def _said_once(caplog: pytest.LogCaptureFixture) -> None:
    said = [
        record
        for record in caplog.records
        if record.levelno == logging.ERROR and "heartbeat worker" in record.getMessage()
    ]
    assert len(said) == 1, [record.getMessage() for record in said]
    assert said[0].exc_info is not None
    assert "a defect in the heartbeat" in str(said[0].exc_info[1])


def test_a_defect_in_a_heartbeat_round_is_logged_once_and_the_holds_stay_held(
    make_mutex: Callable[..., Mutex], row: Row, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected exception in one round (not the database's answer) ends neither the worker nor the holds."""
    failing = _FailingRounds(3)
    holder, contender = make_mutex(), make_mutex()
    with holder.acquire() as got:
        assert got
        monkeypatch.setattr(heartbeat_flows, "heartbeat", failing)
        wait_until(lambda: failing.failed_at, timeout=5)
        wait_until(lambda: failing.kept_fresh(holder, row), timeout=10, interval=0.05)
        assert len(failing.failed_at) == failing.times
        with contender.acquire() as taken:
            assert not taken
    _said_once(caplog)


async def test_a_defect_in_an_async_heartbeat_round_is_logged_once_and_the_holds_stay_held(
    amake_mutex: Callable[..., Mutex], row: Row, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    failing = _FailingRounds(3)
    holder = amake_mutex()
    async with holder.acquire_async(blocking=False) as got:
        assert got
        monkeypatch.setattr(heartbeat_flows, "heartbeat", failing)
        await await_until(lambda: failing.failed_at, timeout=5)
        await await_until(lambda: failing.kept_fresh(holder, row), timeout=10, interval=0.05)
        assert len(failing.failed_at) == failing.times
    _said_once(caplog)
