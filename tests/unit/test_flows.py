"""The flows' bookkeeping, driven step by step without a database (unit tests: no server involved).

These pin down what must hold whatever the I/O does: an acquire or a release
cut short by cancellation, Ctrl-C or a job runner's exception leaves the Mutex
idle and hands any row it may have left to the background; a heartbeat
statement's rows decide, hold by hold, which locks carry on and which are lost.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from postgres_mutex import LockNotHeldError
from postgres_mutex._base.clock import now
from postgres_mutex._observe.hooks import guard
from postgres_mutex._observe.tracing import Tracing
from postgres_mutex._sql import CURRENT, Names, Statements
from postgres_mutex._state import heartbeat_flows
from postgres_mutex._state.events import LockEvents
from postgres_mutex._state.flows import FirstAttempt, clean_up
from postgres_mutex._state.flows import acquire as acquire_flow
from postgres_mutex._state.flows import release as release_flow
from postgres_mutex._state.heartbeat_flows import heartbeat
from postgres_mutex._state.locks import LEASE_EXPIRED, ROW_GONE, HeartbeatGroup, Hold, HoldStatus, LockState, Phase
from postgres_mutex._state.settings import Timing
from postgres_mutex._state.steps import (
    Cleanup,
    Execute,
    Flow,
    Forget,
    Keep,
    Listen,
    Pause,
    Releasing,
    Result,
    Schedule,
    Shape,
    StopListening,
    Tell,
    WaitForRelease,
)
from postgres_mutex.errors import DatabaseError, LockAcquisitionTimeout, OperationTimeout, SchemaError
from tests.support.fixtures import wait_until

TIMING = Timing.validate(
    heartbeat_interval=0.1, alert_threshold=0.6, stale_threshold=1.5, poll_interval=0.05, operation_timeout=2.0
)
STAMP = datetime(2026, 12, 2, tzinfo=UTC)
NAMES = Names("mutex_lock")
STATEMENTS = Statements(NAMES, CURRENT)
TRACING = Tracing(None, {})
ME = object()
ACQUIRER = object()
"""Names the acquire under test to the lock's state."""


def lock(name: str = "job", instance_id: str = "me", timing: Timing = TIMING) -> LockState:
    events = LockEvents(
        lock_name=name,
        instance_id=instance_id,
        hook=guard(None),
        on_lost=None,
        alert_threshold=TIMING.alert_threshold,
        stale_threshold=TIMING.stale_threshold,
    )
    return LockState(
        names=NAMES,
        lock_name=name,
        instance_id=instance_id,
        timing=timing,
        events=events,
        tracing=TRACING,
        state_lock=threading.Lock(),
    )


def step(flow: Flow[Any], reply: Any = None) -> Any:
    return flow.send(reply)


def until_execute(flow: Flow[Any], first: Any = None) -> Execute:
    """Answer the preliminary steps (Shape) the way an engine would, up to the first statement."""
    op = step(flow, first)
    while not isinstance(op, Execute):
        op = step(flow, STATEMENTS if isinstance(op, Shape) else None)
    return op


def acquired_row(token: int = 7) -> Result:
    return Result(1, ((True, None, None, STAMP, token),), now())


def contended_row(holder: str = "other") -> Result:
    return Result(1, ((None, holder, 0.1, None, None),))


def held(state: LockState, token: int = 7) -> Hold:
    state.begin_acquire(ACQUIRER)
    return state.won(acquired_at=STAMP, token=token, sent_at=now(), owner=ME, span_context=None)


@pytest.mark.parametrize(
    "interruption",
    [asyncio.CancelledError(), KeyboardInterrupt(), type("JobTimeout", (BaseException,), {})()],
    ids=["cancelled", "ctrl-c", "job-runner-exception"],
)
def test_an_acquire_interrupted_mid_statement_hands_its_possible_row_to_the_background(
    interruption: BaseException,
) -> None:
    state = lock()
    flow = acquire_flow(state, TRACING, blocking=False, timeout=None, owner=ME, acquirer=ACQUIRER)
    attempt = until_execute(flow)
    assert attempt.statement is STATEMENTS.acquire_plain
    scheduled = flow.throw(interruption)
    assert isinstance(scheduled, Schedule), "the statement may have inserted our row: remove it, later"
    assert scheduled.cleanup.acquired_at is None, "its stamp is unknown: any row of ours"
    assert scheduled.cleanup.conclusive_from > now(), "and once more after it can no longer land"
    with pytest.raises(type(interruption)):
        step(flow)
    assert state.phase is Phase.IDLE, "not stuck acquiring"
    assert state.stray_row_possible


def test_an_unanswered_acquire_hands_its_possible_row_to_the_background() -> None:
    state = lock()
    flow = acquire_flow(state, TRACING, blocking=False, timeout=None, owner=ME, acquirer=ACQUIRER)
    until_execute(flow)
    unanswered = OperationTimeout("no reply", transient=True, outcome_unknown=True)
    assert isinstance(flow.throw(unanswered), Schedule)
    with pytest.raises(OperationTimeout):
        step(flow)
    assert state.phase is Phase.IDLE


@pytest.mark.parametrize(
    ("then", "busy"),
    [(contended_row(), "held elsewhere"), (SchemaError("canceling statement", sqlstate="57014"), "row locked")],
    ids=["contended", "row-locked"],
)
def test_a_non_blocking_acquire_that_ends_busy_after_an_unanswered_try_leaves_nothing(
    then: Result | SchemaError, busy: str
) -> None:
    state = lock()
    flow = acquire_flow(state, TRACING, blocking=False, timeout=None, owner=ME, acquirer=ACQUIRER)
    until_execute(flow)
    # The first try finds its connection dead after sending (it may have landed), the prompt retry
    # finds the lock busy: the first try's row, if it lands, must still be deleted.
    died = DatabaseError("server closed the connection unexpectedly", transient=True, outcome_unknown=True)
    retry = flow.throw(died)
    assert isinstance(retry, Execute), "one prompt retry"
    ended = flow.throw(then) if isinstance(then, SchemaError) else step(flow, then)
    assert isinstance(ended, Schedule), f"{busy}: the unanswered try's row is handed to the background"
    assert ended.cleanup.acquired_at is None
    with pytest.raises(StopIteration) as done:
        step(flow)
    assert done.value.value is None
    assert state.phase is Phase.IDLE


def test_a_refused_acquire_leaves_nothing_to_clean() -> None:
    state = lock()
    flow = acquire_flow(state, TRACING, blocking=False, timeout=None, owner=ME, acquirer=ACQUIRER)
    until_execute(flow)

    with pytest.raises(SchemaError):
        flow.throw(SchemaError("permission denied for table mutex", sqlstate="42501"))
    assert not state.stray_row_possible, "the server answered: the statement did nothing"


def test_an_acquire_the_table_changed_under_inspects_it_again_once_then_reports() -> None:
    state = lock()
    flow = acquire_flow(state, TRACING, blocking=False, timeout=None, owner=ME, acquirer=ACQUIRER)
    until_execute(flow)
    again = flow.throw(SchemaError("no table", sqlstate="42P01"))
    assert isinstance(again, Shape)
    assert again.fresh, "the table is inspected as it is now"
    assert isinstance(step(flow, STATEMENTS), Execute)

    with pytest.raises(SchemaError):
        flow.throw(SchemaError("no table", sqlstate="42P01"))
    assert not state.stray_row_possible, "the server answered: the statement did nothing"


def test_a_blocking_acquire_listens_tries_again_at_once_then_stops_listening() -> None:
    state = lock()
    flow = acquire_flow(state, TRACING, blocking=True, timeout=10, owner=ME, acquirer=ACQUIRER)
    until_execute(flow)
    listen = step(flow, contended_row())
    assert isinstance(listen, Listen)
    retry = step(flow, True)
    assert isinstance(retry, Execute), "listening now: one more attempt, so no release is missed"
    wait = step(flow, contended_row())
    assert isinstance(wait, WaitForRelease)
    again = step(flow)
    assert isinstance(again, Execute)
    keep = step(flow, acquired_row())
    assert isinstance(keep, Keep)
    stop = step(flow)
    assert isinstance(stop, StopListening)
    with pytest.raises(StopIteration) as done:
        step(flow)
    assert done.value.value is keep.hold
    assert state.held
    assert state.hold is not None
    assert state.hold.token == 7


@pytest.mark.parametrize("asks", ["nothing more", "reclaim_disconnected_after", "hold_at_least"])
def test_a_waiters_attempts_win_by_the_insert_alone_unless_it_asks_for_more(asks: str) -> None:
    # The plain acquire (the table's function) tries the INSERT first, and runs the rest only when a
    # row is in the way: the attempt after a release wins with less of the server's time. It names no
    # session and keeps no minimum hold: an acquire that asks for either sends the whole statement.
    timing = TIMING
    if asks == "reclaim_disconnected_after":
        timing = dataclasses.replace(TIMING, reclaim_disconnected_after=1.0)
    state = lock(timing=timing)
    flow = acquire_flow(
        state,
        TRACING,
        blocking=True,
        timeout=10,
        owner=ME,
        acquirer=ACQUIRER,
        hold_at_least=1.0 if asks == "hold_at_least" else None,
    )
    first = until_execute(flow)
    assert isinstance(step(flow, contended_row()), Listen)
    retry = step(flow, True)
    assert isinstance(retry, Execute)
    assert isinstance(step(flow, contended_row()), WaitForRelease)
    after_release = step(flow)
    assert isinstance(after_release, Execute)
    expected = STATEMENTS.acquire_plain if asks == "nothing more" else STATEMENTS.acquire
    assert expected is not None
    assert [first.statement, retry.statement, after_release.statement] == [expected] * 3
    if asks == "nothing more":
        assert after_release.params == state.plain_acquire_params, "it binds only what the statement reads"
    flow.close()


def test_an_acquire_waits_for_a_clean_up_on_the_wire_before_sending() -> None:
    state = lock()
    assert state.take_cleanup_turn(state.generation, "a clean-up", 0.2)
    flow = acquire_flow(state, TRACING, blocking=False, timeout=None, owner=ME, acquirer=ACQUIRER)
    assert isinstance(step(flow), Pause), "a clean-up of rows carrying our id must not cross the acquire"
    state.give_back_cleanup_turn("a clean-up")
    assert isinstance(step(flow), Shape), "once it was answered, the acquire goes on"


def test_a_clean_up_whose_sender_vanished_holds_an_acquire_up_only_until_it_can_no_longer_land() -> None:
    state = lock()
    assert state.take_cleanup_turn(state.generation, "a clean-up never answered", 0.05)
    assert state.cleanup_on_the_wire_until() is not None
    wait_until(lambda: state.cleanup_on_the_wire_until() is None, timeout=2.0)
    flow = acquire_flow(state, TRACING, blocking=False, timeout=None, owner=ME, acquirer=ACQUIRER)
    assert isinstance(step(flow), Shape), "twice its deadline after it was sent, it can no longer land"


def test_an_acquire_waits_for_a_clean_up_on_the_wire_no_longer_than_its_own_timeout() -> None:
    state = lock()
    assert state.take_cleanup_turn(state.generation, "a clean-up never answered", 60.0)
    flow = acquire_flow(state, TRACING, blocking=True, timeout=0.05, owner=ME, acquirer=ACQUIRER)
    with pytest.raises(LockAcquisitionTimeout, match="clean-up"):
        for _ in range(1000):
            pause = step(flow)
            assert isinstance(pause, Pause)
            time.sleep(pause.seconds)  # as the engine performs the step
    assert state.phase is Phase.IDLE


def test_a_clean_up_is_refused_its_turn_once_an_acquire_began() -> None:
    state = lock()
    generation = state.generation
    state.begin_acquire(ACQUIRER)
    assert not state.take_cleanup_turn(generation, "a clean-up begun before the acquire", 1.0)
    assert state.cleanup_on_the_wire_until() is None


def test_a_release_interrupted_mid_statement_leaves_the_mutex_idle_and_the_row_to_the_background() -> None:
    state = lock()
    held(state)
    flow = release_flow(state, TRACING, caller=ME)
    assert isinstance(step(flow), Forget), "heartbeats stop first"
    delete = until_execute(flow)
    assert delete.params["acquired_at"] == STAMP, "the DELETE is scoped to this hold"
    scheduled = flow.throw(KeyboardInterrupt())
    if isinstance(scheduled, Forget):
        scheduled = step(flow)  # heartbeats stopped, once more: harmless
    assert isinstance(scheduled, Schedule)
    assert scheduled.cleanup.acquired_at == STAMP
    with pytest.raises(KeyboardInterrupt):
        step(flow)
    assert state.phase is Phase.IDLE, "not stuck looking held"
    assert not state.held


def test_releasing_what_is_not_held_raises_without_a_statement() -> None:
    flow = release_flow(lock(), TRACING, caller=ME)
    with pytest.raises(LockNotHeldError, match="does not hold"):
        step(flow)


def test_releasing_a_lost_lock_sends_nothing_in_the_callers_time() -> None:
    state = lock()
    hold = held(state)
    hold.lease_deadline = now() - 0.01  # its lease ran out while nobody looked
    flow = release_flow(state, TRACING, caller=ME)
    assert isinstance(step(flow), Forget)
    tell = step(flow)
    assert isinstance(tell, Tell), "the loss is reported, once"
    assert tell.error.reason == LEASE_EXPIRED
    scheduled = step(flow)
    assert isinstance(scheduled, Schedule), "the row may still be ours: delete it in the background"
    with pytest.raises(LockNotHeldError, match="lease ran out"):
        step(flow)


def test_a_release_the_flow_sends_wakes_another_process_not_its_own_registration() -> None:
    # Whatever sends it (a semaphore's and a read/write lock's always, a Mutex's when a span records):
    # the slot this process registered while it waited is the one a release must not choose.
    state = lock()
    held(state)
    flow = release_flow(state, TRACING, caller=ME)
    assert isinstance(step(flow), Forget)
    asked = step(flow)
    assert asked == Releasing(state.channel)
    delete = until_execute(flow, 3)
    assert delete.params["own_slot"] == 3
    with pytest.raises(StopIteration) as done:
        step(flow, Result(1, (("",),)))
    assert done.value.value is True


def test_a_release_sent_again_after_its_first_send_met_a_changed_table_still_leaves_its_process_out() -> None:
    state = lock()
    hold = held(state)
    releaser = object()
    assert state.begin_release(ME, releaser) is hold
    changed = DatabaseError("column gone", sqlstate="42703")
    flow = release_flow(state, TRACING, caller=ME, began=(hold, releaser), first=changed)
    assert isinstance(step(flow), Forget)
    assert step(flow) == Releasing(state.channel)
    inspect = step(flow, 5)
    assert isinstance(inspect, Shape)
    assert inspect.fresh, "the table changed: inspected again"
    again = step(flow, STATEMENTS)
    assert isinstance(again, Execute)
    assert again.params["own_slot"] == 5


def test_a_release_from_another_thread_is_recorded_for_the_holding_block() -> None:
    state = lock()
    hold = held(state)
    flow = release_flow(state, TRACING, caller=object())
    step(flow)
    until_execute(flow)
    with pytest.raises(StopIteration):
        step(flow, Result(1, (("",),)))
    assert hold.reason.startswith("release() was called from another thread")
    with pytest.raises(LockNotHeldError, match="another thread"):
        state.require_held()


def test_one_heartbeat_statement_decides_hold_by_hold() -> None:
    kept, gone = lock("kept", "a"), lock("gone", "b")
    holds = [held(kept, token=11), held(gone, token=12)]
    flow = heartbeat(holds, STATEMENTS, TRACING, 1.0)
    beat = step(flow)
    assert isinstance(beat, Execute)
    assert beat.urgent, "heartbeats go before other statements"
    assert beat.params["tokens"] == [11, 12], "each hold named by its token"
    with pytest.raises(StopIteration) as done:
        step(flow, Result(2, ((11, True, True), (12, False, False)), now()))
    outcome = done.value.value
    assert outcome.renewed == [holds[0]]
    assert [hold for hold, _ in outcome.lost] == [holds[1]]
    assert holds[1].status is HoldStatus.LOST
    assert holds[1].reason == ROW_GONE
    assert kept.held
    assert not gone.held


def test_a_row_locked_by_another_session_is_waited_for_briefly_then_busy_not_lost() -> None:
    state, other = lock(), lock("other", "b")
    holds = [held(state, token=21), held(other, token=22)]
    flow = heartbeat(holds, STATEMENTS, TRACING, 1.0)
    assert STATEMENTS.heartbeat_by_token is not None
    renew, renew_waiting = STATEMENTS.heartbeat_by_token
    assert step(flow).statement is renew
    again = step(flow, Result(2, ((21, False, True), (22, True, True)), now()))
    assert isinstance(again, Execute)
    assert again.statement is renew_waiting, "the skipped row gets a second, waiting try"
    assert again.params["tokens"] == [21], "only the skipped one"
    with pytest.raises(StopIteration) as done:
        step(flow, Result(1, ((21, False, True),), now()))
    outcome = done.value.value
    assert outcome.busy == [holds[0]]
    assert outcome.renewed == [holds[1]]
    assert state.held, "retried soon; lost only if its lease runs out"


def test_a_row_pointed_at_the_lease_and_renewed_on_the_waiting_try_stays_held() -> None:
    state, other = lock(), lock("other", "b")
    holds = [held(state, token=21), held(other, token=22)]
    flow = heartbeat(holds, STATEMENTS, TRACING, 1.0, lease_key=42)
    assert STATEMENTS.heartbeat_leased is not None
    renew, renew_waiting = STATEMENTS.heartbeat_leased
    first = step(flow)
    assert first.statement is renew
    assert first.params["within"] == heartbeat_flows.lease_within(holds, 1.0), "a lapsed lease is not revived"
    # Both answers end with the lease's revision.
    again = step(flow, Result(2, ((21, False, True, 5), (22, True, True, 5)), now()))
    assert again.statement is renew_waiting
    with pytest.raises(StopIteration) as done:
        step(flow, Result(1, ((21, True, True, 5),), now()))
    outcome = done.value.value
    assert outcome.lost == [], "renewed on the waiting try: not lost"
    assert set(outcome.renewed) == set(holds)
    assert outcome.revision == 5
    assert state.held


def test_a_hold_acquired_before_the_table_had_tokens_is_renewed_by_its_stamp() -> None:
    state = lock()
    state.begin_acquire(ACQUIRER)
    hold = state.won(acquired_at=STAMP, token=None, sent_at=now(), owner=ME, span_context=None)
    flow = heartbeat([hold], STATEMENTS, TRACING, 1.0)
    beat = step(flow)
    assert beat.statement is STATEMENTS.heartbeat
    assert beat.params["acquired_ats"] == [STAMP]
    with pytest.raises(StopIteration) as done:
        step(flow, Result(1, (("job", "me", STAMP, True, True),), now()))
    assert done.value.value.renewed == [hold]


def test_a_failed_heartbeat_renews_nothing_and_loses_nothing() -> None:
    state = lock()
    hold = held(state)
    deadline = hold.lease_deadline
    flow = heartbeat([hold], STATEMENTS, TRACING, 1.0)
    step(flow)
    with pytest.raises(StopIteration) as done:
        flow.throw(OperationTimeout("no reply", transient=True, outcome_unknown=True))
    assert done.value.value.error is not None
    assert hold.lease_deadline == deadline
    assert state.held


@pytest.fixture
def stray() -> LockState:
    state = lock()
    state.attempt_sent()  # an acquire's statement went, and its reply never came
    return state


def test_a_clean_up_superseded_by_an_acquire_is_dropped(stray: LockState) -> None:
    cleanup = Cleanup(stray, acquired_at=None, generation=stray.generation, conclusive_from=now(), give_up_at=now() + 9)
    stray.begin_acquire(ACQUIRER)  # an acquire began: it takes any row of ours back itself
    with pytest.raises(StopIteration) as done:
        step(clean_up(cleanup))
    assert done.value.value is True


def test_a_clean_up_before_an_unanswered_statement_could_land_runs_again_later(stray: LockState) -> None:
    later = now() + 60
    cleanup = Cleanup(stray, acquired_at=None, generation=stray.generation, conclusive_from=later, give_up_at=later)
    flow = clean_up(cleanup)
    delete = until_execute(flow)
    assert delete.statement is STATEMENTS.cleanup
    assert delete.stray_row is cleanup
    with pytest.raises(StopIteration) as done:
        step(flow, Result(1, (("",),)))
    assert done.value.value is False, "the unanswered statement may still land: not settled"
    assert stray.stray_row_possible


# -- a hold that names its session (reclaim_disconnected_after): held, in doubt, confirmed --------

NAMING = Timing.validate(
    heartbeat_interval=1.0,
    alert_threshold=3.0,
    stale_threshold=600.0,
    poll_interval=0.5,
    operation_timeout=None,
    reclaim_disconnected_after=10.0,
)


class Clock:
    """The library's clock, set by the test: a hold's states follow it, and nothing else."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.t = 1000.0
        monkeypatch.setattr("postgres_mutex._state.locks.now", lambda: self.t)


def test_a_hold_is_in_doubt_one_interval_before_it_may_be_reclaimed_and_a_heartbeat_confirms_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock(monkeypatch)
    state = lock(timing=NAMING)
    state.begin_acquire(ACQUIRER)
    hold = state.won(acquired_at=STAMP, token=1, sent_at=clock.t, owner=ME, span_context=None)
    clock.t += 8.9
    assert hold.held
    assert state.lease_remaining() == pytest.approx(0.1)
    assert state.tell_running_out(hold) is not None, "two thirds of its trust went by"
    clock.t += 0.1  # reclaim_disconnected_after - heartbeat_interval since the acquire was sent
    assert not state.held
    assert hold.in_doubt
    assert state.lease_remaining() is None
    with pytest.raises(LockNotHeldError, match="in doubt"):
        state.require_held()
    assert state.require_renewable() is hold, "a heartbeat may still confirm it"
    assert state.tell_doubt(hold)
    assert not state.tell_doubt(hold), "told once"
    # A heartbeat sent before the doubt, answered now, leaves it in doubt: it says nothing of since.
    assert state.renew(hold, sent_at=clock.t - 9.5) == 0.0
    assert hold.in_doubt
    # One sent now confirms it.
    clock.t += 2.0
    assert state.renew(hold, sent_at=clock.t) == pytest.approx(2.0)
    assert hold.held
    assert state.tell_running_out(hold) is None, "its trust starts again"
    # Past its lease it is lost, in doubt or not.
    clock.t += 600.0
    assert state.lose(hold, "lease", only_if_expired=True) is not None


def test_a_hold_that_names_no_session_is_never_in_doubt(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch)
    state = lock(timing=dataclasses.replace(NAMING, reclaim_disconnected_after=None))
    state.begin_acquire(ACQUIRER)
    hold = state.won(acquired_at=STAMP, token=1, sent_at=clock.t, owner=ME, span_context=None)
    clock.t += 500.0
    assert hold.held
    assert not hold.in_doubt
    assert not state.tell_doubt(hold)


def _first_attempt(state: LockState, reply: Result | DatabaseError) -> FirstAttempt:
    """An acquire begun and its first statement answered outside the flow, as `Acquisition` does it."""
    generation = state.begin_acquire(ACQUIRER)
    possible_before = state.attempt_sent()
    return FirstAttempt(generation, now(), STATEMENTS, TIMING.operation_timeout, possible_before, reply)


def test_a_busy_lock_found_by_the_first_attempt_goes_on_waiting_in_the_flow() -> None:
    state = lock()
    first = _first_attempt(state, contended_row("other"))
    flow = acquire_flow(state, TRACING, blocking=True, timeout=5.0, owner=ME, acquirer=ACQUIRER, first=first)
    assert isinstance(step(flow), Listen), "the first attempt's reply counts: it listens, then tries again"
    again = until_execute(flow, True)
    assert again.statement is STATEMENTS.acquire_plain
    assert isinstance(step(flow, acquired_row()), Keep)
    assert isinstance(step(flow), StopListening)
    with pytest.raises(StopIteration) as done:
        step(flow)
    hold = done.value.value
    assert isinstance(hold, Hold)
    assert state.hold is hold
    assert state.phase is Phase.HOLDING
    assert state.last_holder == "other", "the first attempt's holder was recorded"


def test_a_failed_first_attempt_is_retried_by_the_flow_once_at_once() -> None:
    state = lock()
    died = DatabaseError("server closed the connection", transient=True, outcome_unknown=True)
    first = _first_attempt(state, died)
    flow = acquire_flow(state, TRACING, blocking=False, timeout=None, owner=ME, acquirer=ACQUIRER, first=first)
    again = until_execute(flow)
    assert again.statement is STATEMENTS.acquire_plain, "a connection found dead on use: one prompt retry"
    assert state.stray_row_may_land_until > now(), "the unanswered first attempt may still land"


def test_a_release_whose_row_was_gone_is_reported_lost_by_the_flow() -> None:
    state = lock()
    hold = held(state)
    releaser = object()
    assert state.begin_release(ME, releaser) is hold
    flow = release_flow(state, TRACING, caller=ME, began=(hold, releaser), first=Result(0))
    assert isinstance(step(flow), Forget)
    told = step(flow)
    assert isinstance(told, Tell)
    with pytest.raises(LockNotHeldError) as raised:
        step(flow)
    assert raised.value.reason == ROW_GONE
    assert state.phase is Phase.IDLE, "the release begun outside the flow was ended by it"


DEFAULTS = Timing.validate(
    heartbeat_interval=10.0, alert_threshold=30.0, stale_threshold=600.0, poll_interval=0.5, operation_timeout=5.0
)


def test_a_lease_renewal_extends_no_holds_trust() -> None:
    state = lock(timing=DEFAULTS)
    state.begin_acquire(ACQUIRER)
    hold = state.won(acquired_at=STAMP, token=7, sent_at=now(), owner=ME, span_context=None, plain=True)
    assert heartbeat_flows.follows_lease(hold)
    trusted_until = hold.lease_deadline
    flow = heartbeat_flows.renew_lease([hold], [3], STATEMENTS, 42, 5.0)
    op = step(flow)
    assert isinstance(op, Execute)
    assert op.statement is STATEMENTS.renew_lease
    assert op.params == {"lease_key": 42, "detach": [3], "within": 600.0 - 5.0 - 1.0}
    with pytest.raises(StopIteration) as done:
        flow.send(Result(1, ((5, []),), now() + 1.0))
    revision, kept, _ = done.value.value
    assert kept == []
    assert revision == 5
    assert hold.lease_deadline == trusted_until, "trusted from its row's own heartbeat, never the lease's"


def test_the_rows_due_go_in_the_lease_renewals_statement_and_are_trusted_from_it() -> None:
    state = lock(timing=DEFAULTS)
    state.begin_acquire(ACQUIRER)
    hold = state.won(acquired_at=STAMP, token=7, sent_at=now(), owner=ME, span_context=None, plain=True)
    renewal = heartbeat_flows.LeaseRenewal(42, [3], 594.0)
    flow = heartbeat_flows.heartbeat([hold], STATEMENTS, TRACING, 5.0, renewal=renewal)
    op = step(flow)
    assert isinstance(op, Execute)
    assert op.statement is STATEMENTS.renew_lease_with_rows, "one statement: the lease and its rows due"
    assert op.params["tokens"] == [7]
    assert (op.params["lease_key"], op.params["detach"], op.params["within"]) == (42, [3], 594.0)
    sent = now() + 1.0
    with pytest.raises(StopIteration) as done:
        flow.send(Result(1, ((7, True, True, 5, [3]),), sent))
    beat = done.value.value
    assert beat.revision == 5
    assert beat.kept == [3], "a row it could not detach is sent again"
    assert beat.renewed == [hold]
    assert hold.renewed_at == sent, "trusted from its own row's renewal"


def lease_fit(holds: list[Hold], interval: float, timeout: float) -> float | None:
    """`heartbeat_flows.fit` of ``holds``, counted as their group counts them."""
    return heartbeat_flows.fit(collections.Counter(map(heartbeat_flows.facts, holds)), interval, timeout)


def test_a_group_counts_what_its_holds_are_as_they_come_and_go() -> None:
    # A heartbeat round reads the group's counts, not every hold (thousands, at times): they must stay those of
    # the holds it has, whatever order holds are kept and forgotten in, and twice over.
    leased, other = lock(timing=DEFAULTS), lock("other", timing=DEFAULTS)
    holds = []
    for index, state in enumerate([leased] * heartbeat_flows.LEASE_FROM + [other]):
        state.begin_acquire(ACQUIRER)
        plain = state is leased
        holds.append(state.won(acquired_at=STAMP, token=index, sent_at=now(), owner=ME, span_context=None, plain=plain))
        state.phase = Phase.IDLE
    group = HeartbeatGroup("key", 10.0, TRACING)
    for hold in holds + holds[:3]:
        group.add(hold, heartbeat_flows.facts(hold))
    assert group.counts == collections.Counter(map(heartbeat_flows.facts, holds))
    assert heartbeat_flows.fit(group.counts, 10.0, 5.0) == lease_fit(holds, 10.0, 5.0) == 600.0 - 5.0 - 1.0
    for hold in [holds[0], holds[0], holds[-1]]:
        group.discard(hold)
    assert group.counts == collections.Counter(map(heartbeat_flows.facts, holds[1:-1]))
    assert heartbeat_flows.fit(group.counts, 10.0, 5.0) is None, "one lock too few to follow a lease"
    for hold in holds:
        group.discard(hold)
    assert (group.holds, group.counts) == ({}, {})


def test_a_lease_is_used_only_where_the_thresholds_leave_it_room() -> None:
    state = lock(timing=DEFAULTS)
    state.begin_acquire(ACQUIRER)
    hold = state.won(acquired_at=STAMP, token=7, sent_at=now(), owner=ME, span_context=None, plain=True)
    many = heartbeat_flows.LEASE_FROM
    assert lease_fit([hold] * many, 10.0, 5.0) == 600.0 - 5.0 - 1.0
    assert lease_fit([hold] * (many - 1), 10.0, 5.0) is None, "a few locks renew their rows"
    other = lock("other", timing=DEFAULTS)
    other.begin_acquire(ACQUIRER)
    unleased = other.won(acquired_at=STAMP, token=8, sent_at=now(), owner=ME, span_context=None)
    assert not heartbeat_flows.follows_lease(unleased)
    assert lease_fit([hold] * (many - 1) + [unleased] * 10, 10.0, 5.0) is None, (
        "only the locks that may follow the lease count"
    )
    assert heartbeat_flows.own_heartbeat_period(hold) == (600.0 - 10.0) / 3
    short = lock(timing=TIMING)  # a stale threshold shorter than the statement's deadline
    short.begin_acquire(ACQUIRER)
    fast = short.won(acquired_at=STAMP, token=8, sent_at=now(), owner=ME, span_context=None, plain=True)
    assert lease_fit([fast] * many, 0.1, 2.0) is None
    minimum = lock(timing=DEFAULTS)
    minimum.begin_acquire(ACQUIRER)
    kept = minimum.won(acquired_at=STAMP, token=9, sent_at=now(), owner=ME, span_context=None, plain=False)
    assert not heartbeat_flows.follows_lease(kept), "a minimum hold's row is renewed by itself"
