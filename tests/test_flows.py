"""The flows' bookkeeping under interruption, driven step by step without a database.

These pin down what must hold whatever the I/O does: an acquire or a release
cut short by cancellation or Ctrl-C leaves the Mutex knowing its row may
remain, so it is cleaned up, and never leaves it stuck looking held.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from postgres_mutex._flows import Execute, Flow, LockContext, Result, StopListening, WaitForRelease
from postgres_mutex._flows import acquire as acquire_flow
from postgres_mutex._flows import release as release_flow
from postgres_mutex._metrics import MetricsDispatch
from postgres_mutex._settings import Timing
from postgres_mutex._sql import Statements
from postgres_mutex._state import LockState, Status, lease_clock
from postgres_mutex._tracing import Tracing
from postgres_mutex.errors import OperationTimeout

TIMING = Timing.validate(
    heartbeat_interval=0.1, alert_threshold=0.6, stale_threshold=1.5, poll_interval=0.05, operation_timeout=2.0
)
TOKEN = datetime(2026, 12, 2, tzinfo=UTC)


def lock() -> LockContext:
    state = LockState(lock_name="job", instance_id="me", timing=TIMING, metrics=MetricsDispatch(None), on_lost=None)
    return LockContext(state, Statements("mutex_lock"), Tracing(None, {}))


def step(flow: Flow[Any], reply: Any = None) -> Any:
    return flow.send(reply)


def test_an_acquire_cancelled_mid_statement_cleans_up_before_ending() -> None:
    context = lock()
    flow = acquire_flow(context, blocking=False, timeout=None)
    first = step(flow)
    assert isinstance(first, Execute)
    assert first.query is context.statements.acquire
    cleanup = flow.throw(asyncio.CancelledError())
    assert isinstance(cleanup, Execute), "the statement may have inserted our row: remove it"
    assert cleanup.query is context.statements.cleanup
    with pytest.raises(asyncio.CancelledError):
        step(flow, Result(1))
    assert context.state.status is Status.IDLE
    assert not context.state.orphan_suspected


def test_an_acquire_whose_cleanup_fails_keeps_the_row_suspected() -> None:
    context = lock()
    flow = acquire_flow(context, blocking=False, timeout=None)
    step(flow)
    flow.throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        flow.throw(OperationTimeout("cleanup passed its deadline", transient=True, outcome_unknown=True))
    assert context.state.orphan_suspected, "so the next acquire, close() and exit still remove it"
    assert context.state.may_have_row


def test_a_blocking_acquire_stops_listening_when_done() -> None:
    context = lock()
    flow = acquire_flow(context, blocking=True, timeout=10)
    step(flow)
    wait = step(flow, Result(1, ((None, "other", 0.1, None),)))
    assert isinstance(wait, WaitForRelease)
    again = step(flow)
    assert isinstance(again, Execute)
    stop = step(flow, Result(1, ((True, None, None, TOKEN),)))
    assert isinstance(stop, StopListening)
    with pytest.raises(StopIteration) as done:
        step(flow)
    assert done.value.value is True
    assert context.state.held


def held(context: LockContext) -> LockContext:
    context.state.begin_acquire()
    context.state.acquired(lease_clock(), TOKEN)
    return context


def test_a_release_interrupted_mid_statement_leaves_the_mutex_idle_and_the_row_suspected() -> None:
    context = held(lock())
    previous = context.state.begin_release()
    flow = release_flow(context, previous)
    delete = step(flow)
    assert isinstance(delete, Execute)
    assert delete.params["token"] == TOKEN, "the DELETE is scoped to this hold"
    with pytest.raises(KeyboardInterrupt):
        flow.throw(KeyboardInterrupt())
    assert context.state.status is Status.IDLE, "not stuck looking held"
    assert context.state.orphan_suspected
    context.state.begin_acquire()  # a later acquire is allowed (and takes the row back)


def test_a_release_does_not_touch_the_table_while_another_thread_acquires() -> None:
    context = lock()
    context.state.begin_acquire()
    context.state.orphan_suspected = True
    flow = release_flow(context, context.state.begin_release())
    with pytest.raises(StopIteration) as done:
        step(flow)
    assert done.value.value is False
