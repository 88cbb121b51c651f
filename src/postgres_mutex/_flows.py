"""What each lock operation does, written once for the sync and async paths.

Each flow is a generator that yields the I/O it needs (`Execute`, `Pause`,
`WaitForRelease`) and receives the result; a runner (`_runners`) performs
those steps with a sync or an async connection. Retries, deadlines, the
meaning of every result and every metrics call live here, so the sync and
async methods of `Mutex` cannot drift apart.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry.trace import Span
from psycopg import sql

from ._metrics import LockObservation, MetricsDispatch
from ._rules import AcquireResult, Outcome, WatchAlerts, interpret_acquire, observe
from ._sql import Statements
from ._state import ROW_GONE, CleanupGuard, LockState, Status, lease_clock
from ._tracing import INSTANCE_ID, LOCK_NAME, OUTCOME, AttributeValue, Tracing, mark_error, set_outcome
from .errors import DatabaseError, LockAcquisitionTimeout, LockNotHeldError, OperationTimeout, SchemaError

logger = logging.getLogger("postgres_mutex")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Execute:
    """Run one statement within ``timeout`` seconds; the runner sends back a `Result`.

    Failures come back as `DatabaseError` thrown into the flow.
    """

    query: sql.Composed
    params: Mapping[str, object]
    timeout: float
    action: str
    guard: CleanupGuard | None = None
    """For a clean-up: the runner holds the guard's lock while it runs, and does
    not send it (raising `CleanupSuperseded`) if an acquire began since."""


class CleanupSuperseded(Exception):
    """A clean-up was not sent: an acquire began after it, and takes the row back itself."""


@dataclass(frozen=True, slots=True)
class Result:
    rowcount: int
    rows: tuple[tuple[Any, ...], ...] = ()

    @property
    def row(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait ``seconds``; the runner sends back False if it was asked to stop meanwhile."""

    seconds: float


@dataclass(frozen=True, slots=True)
class WaitForRelease:
    """Wait up to ``seconds`` for the holder's release to be announced on ``channel``.

    Where LISTEN is possible (a dedicated connection) the runner starts
    listening the first time and returns at once, so the flow re-checks the
    lock before waiting and cannot miss a release that happened in between.
    Elsewhere it simply sleeps: polling is the fallback.
    """

    channel: str
    seconds: float
    listen: sql.Composed
    statement_timeout: float


@dataclass(frozen=True, slots=True)
class StopListening:
    """Stop listening on ``channel`` if the runner listens there; failures are ignored."""

    channel: str
    unlisten: sql.Composed
    statement_timeout: float


Op = Execute | Pause | WaitForRelease | StopListening
Flow = Generator[Op, Any, T]


class LockContext:
    """One lock as the flows see it: its state, statements, parameters and tracing."""

    def __init__(self, state: LockState, statements: Statements, tracing: Tracing) -> None:
        self.state = state
        self.statements = statements
        self.tracing = tracing
        self.channel = statements.channel(state.lock_name)

    def params(self) -> dict[str, object]:
        state = self.state
        return {
            "lock_name": state.lock_name,
            "instance_id": state.instance_id,
            "stale_seconds": state.timing.stale_threshold,
            "channel": self.channel,
            "token": state.token,
        }

    def describe(self, verb: str) -> str:
        return f"{verb} of lock {self.state.lock_name!r} (instance_id {self.state.instance_id!r})"

    def span_attributes(self, **extra: AttributeValue) -> dict[str, AttributeValue]:
        return {LOCK_NAME: self.state.lock_name, INSTANCE_ID: self.state.instance_id, **extra}


# A statement capped by an acquire's remaining time still gets this long, so
# that a nearly spent timeout ends in a real attempt rather than a cut-off one.
_MIN_STATEMENT_TIMEOUT = 0.1


@dataclass
class _Progress:
    attempts: int = 0
    result: AcquireResult | None = None


def acquire(lock: LockContext, *, blocking: bool, timeout: float | None) -> Flow[bool]:
    """Try to take the lock: once, or until ``timeout`` if ``blocking``.

    Returns True when acquired, False when non-blocking and held elsewhere.
    Raises `LockAcquisitionTimeout` when a blocking acquire runs out of time,
    `LockAlreadyHeldError` if this Mutex holds the lock already, and
    `DatabaseError` for failures it cannot wait out. Whatever way it ends
    without the lock (including cancellation), a row an unanswered attempt
    may have left is removed first.

    The whole acquire is one span, each attempt an event on it; the time it
    took is reported to the hook's ``acquire_wait`` with its outcome.
    """
    state = lock.state
    state.begin_acquire()
    started = time.monotonic()
    progress = _Progress()
    extra: dict[str, AttributeValue] = {"postgres_mutex.blocking": blocking}
    if timeout is not None:
        extra["postgres_mutex.timeout"] = timeout
    outcome = "cancelled"
    with lock.tracing.span("postgres_mutex.acquire", lock.span_attributes(**extra)) as span:
        try:
            acquired = yield from _attempt_until_done(lock, span, progress, blocking=blocking, timeout=timeout)
            result = progress.result
            if acquired:
                outcome = "reclaimed" if result is not None and result.outcome is Outcome.RECLAIMED else "acquired"
            else:
                outcome = "contended"
            return acquired
        except LockAcquisitionTimeout:
            outcome = "timeout"
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            waited = time.monotonic() - started
            result = progress.result
            holder = None if result is None else result.holder
            set_outcome(
                span,
                outcome,
                attempts=progress.attempts,
                wait_seconds=waited,
                previous_holder=holder if outcome == "reclaimed" else None,
                holder=holder if outcome in ("contended", "timeout") else None,
            )
            if outcome != "cancelled":
                state.metrics(
                    "acquire_wait", state.lock_name, instance_id=state.instance_id, seconds=waited, outcome=outcome
                )


def _attempt_until_done(
    lock: LockContext, span: Span, progress: _Progress, *, blocking: bool, timeout: float | None
) -> Flow[bool]:
    state = lock.state
    timing = state.timing
    deadline = None if timeout is None else time.monotonic() + timeout
    retried_lost_connection = False
    listening = False
    try:
        while True:
            statement_timeout = timing.operation_timeout
            if deadline is not None:
                statement_timeout = min(statement_timeout, max(_MIN_STATEMENT_TIMEOUT, deadline - time.monotonic()))
            suspected_before = state.orphan_suspected
            # Until a reply says otherwise, this attempt may leave our row behind:
            # an interruption (cancellation, Ctrl-C) must clean up too.
            state.orphan_suspected = True
            sent_at = lease_clock()
            progress.attempts += 1
            try:
                reply = yield Execute(
                    lock.statements.acquire, lock.params(), statement_timeout, lock.describe("acquire")
                )
            except DatabaseError as exc:
                _attempt_event(span, "error", error=type(exc).__name__)
                if not exc.outcome_unknown:
                    state.orphan_suspected = suspected_before
                if _died_while_idle(exc) and not retried_lost_connection:
                    # A connection that died while idle (server restart, idle
                    # timeout) fails its next statement: one prompt retry on a
                    # fresh connection, even when not blocking.
                    retried_lost_connection = True
                    continue
                if not blocking or not exc.transient or _passed(deadline):
                    raise
                logger.warning("%s; retrying in %.3gs", exc, timing.poll_interval)
                yield Pause(_until(deadline, timing.poll_interval))
                continue

            result = interpret_acquire(reply.row, state.instance_id)
            progress.result = result
            _attempt_event(span, result.outcome.value, holder=result.holder, heartbeat_age=result.heartbeat_age)
            if result.outcome.acquired:
                _record_acquired(lock, result, sent_at, expected_own_row=suspected_before)
                state.hold_span_context = span.get_span_context()
                return True
            # Our statement ran: whatever an earlier attempt left, the row is not ours.
            state.orphan_suspected = False
            _record_contended(lock, result)
            if not blocking:
                state.abort_acquire()
                return False
            if _passed(deadline):
                raise LockAcquisitionTimeout(
                    f"lock {state.lock_name!r} still held by {result.holder or 'another instance'} after {timeout:g}s",
                    lock_name=state.lock_name,
                    holder=result.holder,
                )
            listening = True
            yield WaitForRelease(
                lock.channel,
                _until(deadline, timing.poll_interval),
                lock.statements.listen(lock.channel),
                timing.operation_timeout,
            )
    except BaseException:
        # Timeout, error or cancellation: leave nothing behind.
        if state.orphan_suspected:
            yield from remove_orphan(lock)
        state.abort_acquire()
        raise
    finally:
        if listening:
            # Stop hearing this lock's releases (our own included) once done waiting.
            yield StopListening(lock.channel, lock.statements.unlisten(lock.channel), timing.operation_timeout)


def _attempt_event(span: Span, outcome: str, **attributes: AttributeValue | None) -> None:
    if span.is_recording():
        values = {f"postgres_mutex.{key}": value for key, value in attributes.items() if value is not None}
        span.add_event("postgres_mutex.attempt", {OUTCOME: outcome, **values})


def _died_while_idle(exc: DatabaseError) -> bool:
    """A connection found dead on use, as opposed to a deadline or a failed connect."""
    return exc.transient and exc.outcome_unknown and not isinstance(exc, OperationTimeout)


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _until(deadline: float | None, pause: float) -> float:
    if deadline is None:
        return pause
    return max(0.0, min(pause, deadline - time.monotonic()))


def _record_acquired(lock: LockContext, result: AcquireResult, sent_at: float, *, expected_own_row: bool) -> None:
    state = lock.state
    if result.outcome is Outcome.RECLAIMED:
        logger.warning(
            "reclaimed lock %r from %r, silent for %.1fs (stale_threshold %gs)",
            state.lock_name,
            result.holder,
            result.heartbeat_age or 0.0,
            state.timing.stale_threshold,
        )
        state.metrics("stale_reclaimed", state.lock_name, instance_id=state.instance_id, previous_holder=result.holder)
    elif result.outcome is Outcome.REACQUIRED and not expected_own_row:
        logger.warning(
            "lock %r already carried this Mutex's instance_id %r; took it back. "
            "A restarted process reusing its id, or an id shared by two live processes?",
            state.lock_name,
            state.instance_id,
        )
    assert result.token is not None
    state.acquired(sent_at, result.token)
    state.metrics("acquired", state.lock_name, instance_id=state.instance_id)


def _record_contended(lock: LockContext, result: AcquireResult) -> None:
    state = lock.state
    state.last_holder = result.holder
    state.metrics("contended", state.lock_name, instance_id=state.instance_id)
    if state.alert_gate.should_alert(result.holder, result.heartbeat_age):
        logger.warning(
            "lock %r: holder %r has not heartbeated for %.1fs (alert_threshold %gs)",
            state.lock_name,
            result.holder,
            result.heartbeat_age,
            state.timing.alert_threshold,
        )
        state.metrics("alert", state.lock_name, holder=result.holder, seconds_since_heartbeat=result.heartbeat_age)


def remove_orphan(lock: LockContext) -> Flow[None]:
    """Delete any row of ours an unanswered acquire may have left. Never raises a `DatabaseError`."""
    state = lock.state
    try:
        yield Execute(lock.statements.cleanup, lock.params(), state.timing.operation_timeout, lock.describe("cleanup"))
    except DatabaseError as exc:
        logger.error(
            "%s; a row from an unanswered acquire may remain: this Mutex takes it back on its next "
            "acquire and deletes it at exit; others may reclaim it after stale_threshold (%gs)",
            exc,
            state.timing.stale_threshold,
        )
        return
    state.orphan_suspected = False


def sweep_orphan(lock: LockContext) -> Flow[None]:
    """Keep deleting a row an unanswered statement may have left, until it is gone.

    Runs in the background after an acquire or release gave up on a broken
    network: the lock comes back as soon as the database is reachable again,
    not after ``stale_threshold``. Gives up once the row could be reclaimed
    anyway, or as soon as this Mutex acquires again (which takes the row back).
    """
    state = lock.state
    timing = state.timing
    guard = state.cleanup_guard()
    give_up_at = time.monotonic() + timing.stale_threshold
    while time.monotonic() < give_up_at:
        keep_going = yield Pause(timing.poll_interval)
        if not keep_going or guard.superseded or not state.orphan_suspected:
            return
        try:
            yield Execute(
                lock.statements.cleanup, lock.params(), timing.operation_timeout, lock.describe("cleanup"), guard
            )
        except CleanupSuperseded:
            return
        except DatabaseError as exc:
            logger.debug("%s; retrying", exc)
            continue
        state.orphan_cleaned(guard)
        logger.info("lock %r: removed the row an unanswered statement may have left", state.lock_name)
        return


def heartbeat(lock: LockContext) -> Flow[None]:
    """Renew the lease once: one UPDATE, scoped to this hold.

    Raises `LockNotHeldError` if the lock is not held or the row is gone (the
    lock is then marked lost), `DatabaseError` if the heartbeat failed (the
    lock stays held until its lease runs out). Each heartbeat is a span of its
    own, linked to the span of the acquire that began the hold.
    """
    state = lock.state
    generation = state.require_held()
    with lock.tracing.span("postgres_mutex.heartbeat", lock.span_attributes(), link=state.hold_span_context) as span:
        sent_at = lease_clock()
        timeout = min(state.timing.operation_timeout, max(0.0, state.lease_deadline - sent_at))
        started = time.monotonic()
        try:
            result = yield Execute(lock.statements.heartbeat, lock.params(), timeout, lock.describe("heartbeat"))
        except DatabaseError as exc:
            set_outcome(span, "failed")
            logger.warning("%s; retrying until the lease runs out", exc)
            state.metrics("heartbeat_failed", state.lock_name, instance_id=state.instance_id, error=exc)
            raise
        if result.rowcount == 1:
            latency = time.monotonic() - started
            state.renewed(generation, sent_at)
            set_outcome(span, "renewed", latency_seconds=latency)
            state.metrics("heartbeat_latency", state.lock_name, instance_id=state.instance_id, seconds=latency)
            return
        set_outcome(span, "lost")
        raise state.lose(ROW_GONE, generation) or state.not_held_error()


def keep_alive(lock: LockContext, generation: int) -> Flow[None]:
    """Heartbeat every ``heartbeat_interval`` while hold ``generation`` lasts.

    Failed heartbeats are retried every `Timing.heartbeat_retry`; when the
    lease runs out first, or a heartbeat finds the row gone, the lock is
    marked lost and the loop ends. Ends quietly when the runner is stopped.
    """
    state = lock.state
    timing = state.timing
    next_beat = lease_clock() + timing.heartbeat_interval
    while state.is_current(generation):
        wake = min(next_beat, state.lease_deadline)
        keep_going = yield Pause(max(0.0, wake - lease_clock()))
        if not keep_going or not state.is_current(generation):
            return
        if lease_clock() >= state.lease_deadline:
            state.check_lease()
            return
        if lease_clock() < next_beat:
            continue
        started = lease_clock()
        try:
            yield from heartbeat(lock)
        except LockNotHeldError:
            return
        except DatabaseError:
            next_beat = lease_clock() + timing.heartbeat_retry
            continue
        next_beat = started + timing.heartbeat_interval


def release(lock: LockContext, previous: Status) -> Flow[bool]:
    """Delete this hold's row and wake waiters: one statement.

    ``previous`` is the status `LockState.begin_release` returned. Returns
    True if a row was deleted. A transient failure is retried once (the
    DELETE is scoped to this hold, so repeating it is safe); if that fails
    too, `DatabaseError` says the row may remain, and the Mutex keeps trying
    at its next acquire, at close and at exit. Raises `LockNotHeldError`
    after the clean-up if the lock had been lost.
    """
    state = lock.state
    holding = previous in (Status.HELD, Status.LOST)
    if not holding and not (previous is Status.IDLE and state.orphan_suspected):
        # Nothing of ours, or another thread is acquiring: its row is not ours to touch.
        return False
    with lock.tracing.span("postgres_mutex.release", lock.span_attributes()) as span:
        try:
            deleted = yield from _delete_row(lock, previous, holding=holding)
        except DatabaseError as exc:
            if previous is not Status.LOST:
                raise
            # The loss is what the caller must hear; the row is swept up later.
            set_outcome(span, "lost")
            raise state.not_held_error() from exc
        set_outcome(span, "released" if deleted else "not_found")
        if previous is Status.LOST:
            set_outcome(span, "lost")
            mark_error(span, "the lock had been lost before it was released")
            raise state.not_held_error()
        return deleted


def _delete_row(lock: LockContext, previous: Status, *, holding: bool) -> Flow[bool]:
    state = lock.state
    statement = lock.statements.release if holding else lock.statements.cleanup
    # Deleting any row of ours (no hold to scope it to) must not race a new acquire.
    guard = None if holding else state.cleanup_guard()
    action = lock.describe("release")
    unknown = False
    finished = False
    try:
        for attempt in (1, 2):
            try:
                result = yield Execute(statement, lock.params(), state.timing.operation_timeout, action, guard)
                break
            except CleanupSuperseded:
                # An acquire began meanwhile: it takes the row back itself.
                return False
            except DatabaseError as exc:
                unknown = unknown or exc.outcome_unknown
                if attempt == 2 or not exc.transient:
                    raise DatabaseError(
                        f"{exc}; the lock row may remain until another instance reclaims it "
                        f"after stale_threshold ({state.timing.stale_threshold:g}s)",
                        transient=exc.transient,
                        outcome_unknown=exc.outcome_unknown,
                        sqlstate=exc.sqlstate,
                    ) from exc
                logger.warning("%s; retrying once", exc)
        finished = True
    finally:
        # An interrupted or failed release may leave our row: remember to retry.
        state.orphan_suspected = not finished
        if not finished and previous is Status.HELD:
            state.metrics("release_failed", state.lock_name, instance_id=state.instance_id, error=sys.exc_info()[1])
        deleted: bool = finished and result.rowcount > 0
        if previous is Status.HELD and finished and not deleted and not unknown:
            # Held by our lease, yet the row was gone: someone deleted or took it.
            gone: LockNotHeldError | None = state.lost_while_releasing(ROW_GONE)
        else:
            gone = None
        state.released()
    if deleted:
        state.metrics("released", state.lock_name, instance_id=state.instance_id)
    if gone is not None:
        raise gone
    return deleted


@dataclass
class WatchContext:
    """What a watcher reads and whom it tells: shared by the sync thread and the async task."""

    statements: Statements
    lock_names: frozenset[str] | None
    alert_threshold: float
    stale_threshold: float
    interval: float
    operation_timeout: float
    alerts: WatchAlerts
    metrics: MetricsDispatch
    latest: list[LockObservation] = field(default_factory=list)
    healthy: bool | None = None


def watch(context: WatchContext) -> Flow[list[LockObservation]]:
    """Read the lock table once (one query, the server's clock) and report what it shows.

    Fires ``alert`` once per stale episode, without anyone trying to acquire;
    reports every held lock to the hook's ``observed``. Raises `DatabaseError`
    (after reporting ``watcher_failed``) if the table could not be read.
    """
    names = None if context.lock_names is None else sorted(context.lock_names)
    try:
        reply = yield Execute(
            context.statements.watch,
            {"lock_names": names},
            context.operation_timeout,
            f"watcher read of table {context.statements.table_name}",
        )
    except DatabaseError as exc:
        context.healthy = False
        logger.warning("%s; the watcher keeps trying", exc)
        context.metrics("watcher_failed", error=exc)
        raise
    observations = observe(reply.rows, alert_threshold=context.alert_threshold, stale_threshold=context.stale_threshold)
    for seen in observations:
        if context.alerts.should_alert(seen.lock_name, seen.holder, seen.seconds_since_heartbeat):
            logger.warning(
                "lock %r: holder %r has not heartbeated for %.1fs (alert_threshold %gs)",
                seen.lock_name,
                seen.holder,
                seen.seconds_since_heartbeat,
                context.alert_threshold,
            )
            context.metrics(
                "alert", seen.lock_name, holder=seen.holder, seconds_since_heartbeat=seen.seconds_since_heartbeat
            )
    context.alerts.held_now({seen.lock_name for seen in observations})
    context.latest, context.healthy = observations, True
    context.metrics(
        "observed",
        observations,
        watched=context.lock_names,
        alert_threshold=context.alert_threshold,
        stale_threshold=context.stale_threshold,
    )
    return observations


def watch_forever(context: WatchContext) -> Flow[None]:
    """Read the table every ``interval`` seconds until the runner is stopped; outages are ridden out.

    When it ends (stopped or cancelled), the hook hears ``watcher_stopped``, so
    exporters stop reporting a state nobody watches any more.
    """
    try:
        while True:
            with contextlib.suppress(DatabaseError):
                yield from watch(context)
            keep_going = yield Pause(context.interval)
            if not keep_going:
                return
    finally:
        context.healthy = None
        context.metrics("watcher_stopped", watched=context.lock_names)


def force_release(statements: Statements, lock_name: str, timeout: float) -> Flow[tuple[str, float] | None]:
    """Delete a lock's row whoever holds it; return (holder, seconds since its heartbeat), or None if free."""
    reply = yield Execute(
        statements.force_release,
        {"lock_name": lock_name, "channel": statements.channel(lock_name)},
        timeout,
        f"forced release of lock {lock_name!r}",
    )
    if reply.row is None:
        return None
    holder, age, _ = reply.row
    return str(holder), float(age)


_CONCURRENT_CREATE = frozenset({"23505", "42P07", "42710"})


def create_schema(statements: Statements, timeout: float) -> Flow[None]:
    """CREATE TABLE IF NOT EXISTS, safe when many instances start at once.

    Two sessions creating the same table race in the catalog; the loser gets a
    unique violation once the winner has committed, so one retry sees the
    table and does nothing.
    """
    action = f"create_schema of table {statements.table_name}"
    for attempt in (1, 2, 3):
        try:
            yield Execute(statements.create_table, {}, timeout, action)
            return
        except DatabaseError as exc:
            if exc.sqlstate in _CONCURRENT_CREATE and attempt < 3:
                continue
            if exc.sqlstate == "42501":
                raise SchemaError(
                    f"{action} failed: the role may not create it ({exc}). Create the table once as a "
                    "privileged role (see the README's Permissions section) and skip create_schema()",
                    sqlstate=exc.sqlstate,
                ) from exc
            if exc.sqlstate == "3F000":
                raise SchemaError(
                    f"{action} failed: its schema does not exist; create the schema first ({exc})",
                    sqlstate=exc.sqlstate,
                ) from exc
            raise
