"""What each lock operation does, written once for the sync and async paths: acquire, release, clean-up.

Each flow is a generator that yields the steps it needs (`_state.steps`: `Execute`, `Pause`,
`Listen`, ...) and receives the result; an engine (`_io.engine_async`, and `_io.engine` generated
from it) performs those steps on a connection. Retries, deadlines and the meaning of every
result live here; what each event means to the outside world is told by `LockEvents`.
Nothing here does I/O. The heartbeat's flows are in `_state.heartbeat_flows`, the table's in
`_state.admin_flows`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from .._base.clock import now
from .._observe.tracing import AttributeValue, Tracing
from ..errors import DatabaseError, LockAcquisitionTimeout, OperationTimeout, SchemaError, phrase
from .failures import CANCELLED, SERIALIZATION_FAILURE, SHAPE_CHANGED
from .locks import LEASE_EXPIRED, NOT_HELD, Hold, HoldStatus, LockState
from .outcome import AcquireResult, Outcome
from .steps import (
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
    StopSignal,
    Tell,
    WaitForRelease,
)

if TYPE_CHECKING:
    from .._sql import Statement, Statements

T = TypeVar("T")


# -- acquire -------------------------------------------------------------------

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# A statement capped by an acquire's remaining time still gets this long, so
# that a nearly spent timeout ends in a real attempt rather than a cut-off one.
_MIN_STATEMENT_TIMEOUT = 0.1
_CLEANUP_LOOK = 0.01  # seconds between looks at a clean-up on the wire (rare: after an interrupted statement)
_LOST_RACE_PAUSE = 0.05  # seconds at most before a read/write lock's next attempt after a race lost

# How long after a release that woke another process's waiter this Mutex's next blocking acquire lets that
# waiter go first (`LockState.gave_way_at`): the woken one tries within a round trip or two; past this, it
# has, and the acquire tries at once as any does. A wait begun this way still ends at the first release heard,
# at the latest after a poll_interval, as any waiter's.
_GIVE_WAY_FOR = 1.0

# At most so many attempts are sent again at once when the reply says it may win (`LockKind.again_at_once`).
_QUICK_RETRIES = 5


@dataclass(frozen=True, slots=True)
class FirstAttempt:
    """An acquire's first attempt, made before the flow (`Acquisition`'s direct path) and not a plain win.

    The flow takes it from there as if it had made the attempt itself: ``reply``
    is the statement's result, or the `DatabaseError` it failed with.
    """

    generation: int
    started: float
    statements: Statements
    statement_timeout: float
    possible_before: bool
    reply: Result | DatabaseError | None
    """None: the acquire began, and sent nothing yet (a clean-up of ours was on the wire, or the table, as last
    inspected, lacked what the lock's kind needs: the flow inspects it again)."""


def acquire(
    lock: LockState,
    tracing: Tracing,
    *,
    blocking: bool,
    timeout: float | None,
    owner: object,
    acquirer: object,
    stop: StopSignal | None = None,
    first: FirstAttempt | None = None,
    hold_at_least: float | None = None,
) -> Flow[Hold | None]:
    """Try to take the lock: once, or until ``timeout`` if ``blocking``; ``acquirer`` names this acquire.

    With ``hold_at_least`` (seconds, checked by the caller), the lock stays taken at least that long
    after it is acquired, whenever it is released (`_sql.lock`'s minimum hold); on a table without
    the column for it, `SchemaError` names the migration.

    Returns the hold when acquired, None when non-blocking and held
    elsewhere, or when ``stop`` was set before an attempt won the lock (the
    span then ends as ``cancelled``). Raises `LockAcquisitionTimeout` when a blocking acquire runs out
    of time, `LockAlreadyHeldError` if this Mutex holds the lock already, and
    `DatabaseError` for failures it cannot wait out. A non-blocking acquire
    returns within one ``operation_timeout`` (plus a connect). Whatever way it
    ends without the lock (cancellation included), a stray row an unanswered
    attempt may have left is handed to the background to delete. An
    exception raised into it (a signal handler's) after it won the lock ends
    that hold too: the caller gets the hold only by the flow's return, and
    the acquirer's `abandon` undoes whatever ends it sooner.

    The whole acquire is one span, each attempt an event on it. With ``first``,
    the acquire began (`LockState.begin_acquire`) and made its first attempt
    before this flow: it goes on from that attempt's reply.
    """
    generation = lock.begin_acquire(acquirer) if first is None else first.generation
    outcome = "cancelled"
    with tracing.span("postgres_mutex.acquire", lambda: _acquire_attributes(lock, blocking, timeout)) as span:
        attempts = _Attempts(
            lock,
            span,
            blocking=blocking,
            timeout=timeout,
            generation=generation,
            acquirer=acquirer,
            stop=stop,
            first=first,
            hold_at_least=hold_at_least,
        )
        try:
            hold = yield from attempts.until_done(owner)
            result = attempts.result
            if attempts.stopped:
                pass  # stays "cancelled": nobody is waiting for the lock any more
            elif hold is None:
                outcome = "contended"
            else:
                outcome = "reclaimed" if result is not None and result.outcome is Outcome.RECLAIMED else "acquired"
            return hold
        except LockAcquisitionTimeout:
            outcome = "timeout"
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            result = attempts.result
            lock.events.acquire_ended(
                span,
                outcome,
                attempts=attempts.count,
                waited=now() - attempts.started,
                holder=None if result is None else result.holder,
            )


class _Attempts:
    """One acquire's attempts, until one wins, the lock is busy, time runs out or a failure cannot be waited out.

    Its deadlines: ``deadline``, the caller's timeout; ``budget``, the time the
    statements may take (the deadline when blocking, one ``operation_timeout``
    otherwise). What it saw is read by `acquire` for the span and the metrics.
    """

    def __init__(
        self,
        lock: LockState,
        span: Any,
        *,
        blocking: bool,
        timeout: float | None,
        generation: int,
        acquirer: object,
        stop: StopSignal | None,
        first: FirstAttempt | None = None,
        hold_at_least: float | None = None,
    ) -> None:
        self.lock = lock
        self.hold_at_least = hold_at_least
        self.span = span
        self.blocking = blocking
        self.timeout = timeout
        self.generation = generation
        self.acquirer = acquirer
        self.stop = stop
        self.first = first
        self.started = now() if first is None else first.started
        self.deadline = None if timeout is None else self.started + timeout
        self.budget = budget(lock, blocking=blocking, timeout=timeout, started=self.started)
        if first is not None and first.reply is None:
            first = self.first = None  # nothing was sent: the attempts begin here
        self.count = 0 if first is None else 1
        self.result: AcquireResult | None = None
        self.stopped = False
        self.statements: Statements | None = None if first is None else first.statements
        self.quick_retry_spent = False
        self.quick_retries = 0
        self.held: int | None = None  # how many rows of the lock were held, at the last attempt

    def _wait_for_release(self, pause: float) -> WaitForRelease:
        """A wait for a release, ``pause`` at most before the next poll, and never past the deadline.

        The process's waiters on a lock with one hold share its polls (`WaitForRelease.shared_until`): one
        poll per pause, whatever their number. Not the last wait before the deadline: it ends in this
        waiter's own attempt.
        """
        wait = _until(self.deadline, pause)
        if not (self.lock.kind.single_hold and not self.lock.kind.queues and wait >= pause):
            return WaitForRelease(wait, self.stop)
        return WaitForRelease(wait, self.stop, math.inf if self.deadline is None else self.deadline)

    def until_done(self, owner: object) -> Flow[Hold | None]:
        lock = self.lock
        listening = False
        closing = False
        handed: tuple[int, int] | None = None
        try:
            yield from self._after_cleanup_on_the_wire()
            gave_way_at, lock.gave_way_at = lock.gave_way_at, None
            if self.first is None and self.blocking and gave_way_at is not None and now() - gave_way_at < _GIVE_WAY_FOR:
                # This Mutex's last release woke another process's waiter: that one goes first, and this
                # acquire waits for a release as if its attempt had found the lock held. A release heard
                # since that one (it may be free again) is tried at once, as after any LISTEN.
                listening = True
                lock.events.waiting()
                if not (yield Listen(lock.channel, lock.timing.operation_timeout, None, gave_way_at, True)):
                    yield self._wait_for_release(lock.timing.poll_interval)
            while True:
                first, self.first = self.first, None
                if handed is not None and lock.kind.handed_whole and not (self.stop is not None and self.stop.is_set()):
                    # A fair lock's release handed the row to this waiter, and said so: no attempt needed.
                    taken = yield from self._take_handed(handed, owner)
                    if taken is not None:
                        return taken
                handed = None
                if first is not None:
                    statement_timeout, possible_before = first.statement_timeout, first.possible_before
                else:
                    if self.stop is not None and self.stop.is_set():
                        self.stopped = True
                        yield from self._leave_nothing_behind()
                        lock.abort_acquire(self.acquirer)
                        return None
                    statement_timeout = self._statement_timeout()
                    possible_before = lock.attempt_sent()
                    self.count += 1
                try:
                    if first is None:
                        if self.statements is None:
                            # Inside the retries: the table's first inspection can meet a busy pool or a restart too.
                            self.statements = yield Shape(lock.names, statement_timeout)
                            if (
                                lock.timing.reclaim_disconnected_after is not None
                                and not self.statements.shape.sessions
                            ):
                                lock.events.sessions_unnamed(lock.names.table_name)
                        if not lock.kind.migrated(self.statements):
                            self.statements = yield Shape(lock.names, statement_timeout, fresh=True)  # migrated since?
                        if self.hold_at_least is not None and not self.statements.shape.holds:
                            self.statements = yield Shape(lock.names, statement_timeout, fresh=True)  # migrated since?
                            if not self.statements.shape.holds:
                                raise no_minimum_hold(lock)
                        kind, plain = lock.kind, self.statements.acquire_plain
                        if (
                            plain is not None
                            and kind.direct
                            and not kind.queues
                            and self.hold_at_least is None
                            and lock.timing.reclaim_disconnected_after is None
                        ):
                            # As the first attempt's (`Acquisition`): a waiter's attempt after a release
                            # wins by its INSERT alone, the rest of the statement only when a row is in the way.
                            statement, params = plain, lock.plain_acquire_params
                        else:
                            statement, params = kind.acquire_statement(self.statements, lock.lock_name), lock.params()
                            params["hold_seconds"] = self.hold_at_least
                            if kind.queues:
                                params["wait_id"] = self.wait_id
                            kind.acquiring(params, blocking=self.blocking)
                        reply = yield Execute(statement, params, statement_timeout, lock.describe("acquire"))
                    elif isinstance(first.reply, DatabaseError):
                        raise first.reply
                    else:
                        reply = first.reply
                except DatabaseError as exc:
                    if exc.outcome_unknown:
                        # Sent before now; it can run on the server for a statement_timeout at most.
                        lock.attempt_unanswered(statement_timeout)
                    else:
                        lock.attempt_refused(possible_before)
                    if (yield from self._after_failure(exc)):
                        continue
                    lock.abort_acquire(self.acquirer)
                    return None
                except BaseException:
                    # Interrupted mid-statement (cancelled, a signal's exception): it may still land.
                    lock.attempt_unanswered(statement_timeout)
                    raise

                read = lock.kind.read(reply.row, lock.instance_id)
                result, row_name, self.held = read.result, read.row_name, read.held
                refused = lock.kind.refusal(read, lock.names.table_name, lock.lock_name)
                if refused is not None:
                    lock.attempt_contended(None)
                    if lock.kind.queues:
                        lock.in_line()  # an earlier attempt queued it: it must leave the line as it goes
                    raise refused
                if lock.kind.again_at_once(read) and self.quick_retries < _QUICK_RETRIES:
                    self.quick_retries += 1
                    lock.attempt_contended(result.holder)
                    if lock.kind.queues:
                        lock.in_line()
                    continue
                assert self.statements is not None  # inspected by this attempt, or given with the first
                if result.outcome.acquired and not self.statements.shape.tokens and result.token is not None:
                    result = yield from tokens_appeared(lock, result, statement_timeout)
                self.result = result
                if result.outcome.acquired:
                    assert result.acquired_at is not None
                    hold = lock.won(
                        acquired_at=result.acquired_at,
                        token=result.token,
                        sent_at=reply.sent_at,
                        owner=owner,
                        span_context=self.span.get_span_context(),
                        row_name=row_name,
                        plain=self.hold_at_least is None,
                    )
                    lock.events.acquired(self.span, result, expected_own_row=possible_before, row=row_name)
                    yield Keep(hold)
                    return hold
                lock.attempt_contended(result.holder)
                if lock.kind.queues:
                    lock.in_line()
                alert = lock.alert_gate.should_alert(result.holder, result.heartbeat_age)
                lock.events.contended(self.span, result, alert=alert)
                if not self.blocking:
                    yield from self._leave_nothing_behind()  # an earlier attempt's, if it went unanswered
                    lock.abort_acquire(self.acquirer)
                    return None
                if _passed(self.deadline):
                    raise LockAcquisitionTimeout(
                        lock.still_busy(result.holder, self.held, self._waited()),
                        self.timeout,
                        lock_name=lock.lock_name,
                        holder=result.holder,
                    )
                if not listening:
                    listening = True
                    lock.events.waiting()
                    who = self.wait_id if lock.kind.queues else None
                    since = reply.sent_at or None
                    if (yield Listen(lock.channel, lock.timing.operation_timeout, who, since, lock.kind.single_hold)):
                        # Listening now: try again at once, lest a release before the LISTEN be missed.
                        continue
                pause = lock.timing.poll_interval
                if result.heartbeat_age is not None and result.heartbeat_age < 0:
                    # Released before its minimum hold ended: its heartbeat is that end, and the lock is not
                    # free before it. Polling sooner would only find it held; a forced release still wakes us.
                    pause = max(pause, -result.heartbeat_age)
                handed = yield self._wait_for_release(pause)
        except GeneratorExit:
            # Closed, its engine gone (an exception landed between two steps): it takes no more
            # steps. Whoever ran it undoes the acquire (`abandon`), steps and all.
            closing = True
            raise
        except BaseException:
            # Timeout, error or interruption, wherever it landed (a signal's exception after the
            # lock was won included): leave nothing behind, in the background.
            yield from abandon(lock, self.acquirer)
            raise
        finally:
            if listening:
                lock.events.stopped_waiting()
                if not closing:
                    yield StopListening()

    @property
    def wait_id(self) -> str:
        """This acquire, as a fair lock's queue names it (`wait_id`)."""
        return wait_id(self.lock, self.generation)

    def _take_handed(self, handed: tuple[int, int], owner: object) -> Flow[Hold | None]:
        """The hold a fair lock's release handed this waiter (its token, its ``acquired_at`` in µs), taken;
        None if its lease would be too short (the next attempt then takes the row over, for a lease of its own).

        The row's heartbeat is the moment the release wrote it (``clock_timestamp()``), which the waiter
        does not know. Its lease counts from a moment surely before: this acquire began. The release
        handed the row to the waiter its queue entry named, and only an attempt of this acquire,
        sent after it began, wrote this acquire's name there; the release read it once committed,
        then wrote the row. Not from the release's ``now()``: a release that waited on a row lock
        may have begun before this acquire did.
        """
        lock = self.lock
        token, acquired_us = handed
        start = self.started
        if now() - start > (lock.timing.stale_threshold - lock.timing.heartbeat_interval) / 2:
            return None
        result = AcquireResult(Outcome.ACQUIRED, None, None, _EPOCH + timedelta(microseconds=acquired_us), token)
        self.result = result
        assert result.acquired_at is not None
        hold = lock.won(
            acquired_at=result.acquired_at,
            token=token,
            sent_at=start,
            owner=owner,
            span_context=self.span.get_span_context(),
            row_name=lock.row_name,
            plain=True,
        )
        lock.events.acquired(self.span, result, expected_own_row=True)
        yield Keep(hold)
        return hold

    def _after_cleanup_on_the_wire(self) -> Flow[None]:
        """Wait while a clean-up of a row of ours is on the wire: sent after it, the acquire could be undone by it.

        Bounded by its landing deadline (`LockState.take_cleanup_turn`) and by this acquire's own.
        """
        lock = self.lock
        while (until := lock.cleanup_on_the_wire_until()) is not None:
            if self.budget is not None and now() >= self.budget:
                what = (
                    f"the clean-up of a row instance {lock.instance_id!r} left (an interrupted statement's) "
                    "was still running on the server"
                )
                if self.blocking:
                    raise LockAcquisitionTimeout(
                        f"{lock.kind} {lock.lock_name!r} not acquired within {self._waited():g}s: {what}",
                        self.timeout,
                        lock_name=lock.lock_name,
                        holder=None,
                    )
                raise OperationTimeout(
                    f"{lock.describe('acquire')} did not begin within operation_timeout "
                    f"({lock.timing.operation_timeout:g}s): {what}",
                    transient=True,
                    outcome_unknown=False,
                )
            pause = until - now()
            if self.budget is not None:
                pause = min(pause, self.budget - now())
            yield Pause(max(0.0, min(pause, _CLEANUP_LOOK)))

    def _statement_timeout(self) -> float:
        return statement_timeout(self.lock, self.budget)

    def _waited(self) -> float:
        return max(self.timeout or 0.0, 0.0)

    def _leave_nothing_behind(self) -> Flow[None]:
        if self.lock.stray_row_possible:
            yield Schedule(stray_row_cleanup(self.lock, self.generation))

    def _after_failure(self, exc: DatabaseError) -> Flow[bool]:
        """What a failed attempt means: True to try again, False when the lock is busy; else it raises."""
        lock, span = self.lock, self.span
        # A read/write lock's race lost between its check and its write: a constraint refused the
        # statement, so nothing was written. That is "busy", not a failure (`_sql.rwlocks`).
        lost_race = lock.kind.lost_race(exc.sqlstate)
        if lost_race and self.blocking:
            yield Pause(_until(self.deadline, min(lock.timing.poll_interval, _LOST_RACE_PAUSE)))
            return True  # the next attempt's reply, contended or not, meets the deadline's check
        if (exc.sqlstate == CANCELLED or lost_race) and not self.blocking:
            # The server gave up waiting for the row: another session has it
            # locked (an acquire in flight, a holder's fenced transaction).
            busy = AcquireResult(Outcome.CONTENDED, None, None)
            self.result = busy
            lock.events.contended(span, busy, alert=False)
            yield from self._leave_nothing_behind()
            return False
        if lock.kind.changed_meanwhile(exc.sqlstate) and not self.quick_retry_spent:
            # What the lock is (a semaphore's N) was changed while this attempt ran: the next one reads it.
            self.quick_retry_spent = True
            return True
        if exc.sqlstate in SHAPE_CHANGED and not self.quick_retry_spent:
            # Rejected at parse time (the history dropped, say): as the table is now.
            self.quick_retry_spent = True
            self.statements = yield Shape(lock.names, self._statement_timeout(), fresh=True)
            return True
        if _retry_at_once(exc) and not self.quick_retry_spent and (self.budget is None or now() < self.budget):
            # A connection the server closed while idle, or a serialization
            # failure a session default caused: one prompt retry, even
            # when not blocking.
            self.quick_retry_spent = True
            lock.events.attempt_failed(span, exc, retrying_in=None)
            return True
        if not self.blocking or not exc.transient:
            lock.events.attempt_failed(span, exc, retrying_in=None)
            raise exc
        if _passed(self.deadline):
            # Out of time while the database stood in the way (a row locked by
            # another session, a silent network): to the caller, that is the
            # timeout it asked for, with what stood in the way as its cause.
            lock.events.attempt_failed(span, exc, retrying_in=None)
            raise LockAcquisitionTimeout(
                f"lock {lock.lock_name!r} not acquired within {self._waited():g}s: the last attempt failed: {exc}",
                self.timeout,
                lock_name=lock.lock_name,
                holder=lock.last_holder,
            ) from exc
        pause = _until(self.deadline, lock.timing.poll_interval)
        lock.events.attempt_failed(span, exc, retrying_in=pause)
        yield Pause(pause)
        return True


def wait_id(lock: LockState, generation: int) -> str:
    """An acquire (the ``generation`` it began), as a fair lock's queue names it: a hand-off meant for an earlier
    acquire is not taken."""
    return f"{lock.instance_id}/{generation}"


def budget(lock: LockState, *, blocking: bool, timeout: float | None, started: float) -> float | None:
    """Until when an acquire's statements may run: its deadline when blocking (None: none), else one
    ``operation_timeout`` from ``started``, which the whole non-blocking acquire fits in."""
    if blocking:
        return None if timeout is None else started + timeout
    return started + lock.timing.operation_timeout


def statement_timeout(lock: LockState, budget: float | None) -> float:
    """An acquire's next statement's deadline: one ``operation_timeout``, capped by what is left of ``budget``."""
    timeout = lock.timing.operation_timeout
    if budget is not None:
        timeout = min(timeout, max(_MIN_STATEMENT_TIMEOUT, budget - now()))
    return timeout


def abandon(lock: LockState, acquirer: object) -> Flow[None]:
    """End ``acquirer``'s acquire, which its caller will never learn the result of: nothing of it stays.

    A hold it won is no longer renewed; its row, like any an unanswered
    attempt may leave, is deleted in the background (a later acquire of the
    same lock takes it back first, if it comes sooner).
    """
    undone = lock.abandon_acquire(acquirer)
    if undone is None:
        return  # ended already (or never began: another acquire's)
    generation, hold, stray = undone
    if hold is not None:
        yield Forget(hold)
        lock.events.abandoned()
    if stray:
        yield Schedule(stray_row_cleanup(lock, generation))


def no_minimum_hold(lock: LockState) -> SchemaError:
    """A minimum hold asked for on a table without the column that keeps it (it predates the feature)."""
    return SchemaError(
        phrase(
            "{hold_at_least} needs the lock table {table} to have its hold_until column, which it lacks: "
            "run {LockTable.migrate()} once (the lock is not taken meanwhile)",
            table=lock.names.table_name,
        )
    )


def _retry_at_once(exc: DatabaseError) -> bool:
    """A failure that says nothing about the moment: a connection found dead on use, a serialization failure."""
    return died_while_idle(exc) or exc.sqlstate == SERIALIZATION_FAILURE


def died_while_idle(exc: DatabaseError) -> bool:
    """A connection found dead on use (server restart, idle timeout), as opposed to a deadline or a failed connect."""
    return exc.transient and exc.outcome_unknown and not isinstance(exc, OperationTimeout)


def _passed(deadline: float | None) -> bool:
    return deadline is not None and now() >= deadline


def _until(deadline: float | None, pause: float) -> float:
    if deadline is None:
        return pause
    return max(0.0, min(pause, deadline - now()))


def stray_row_cleanup(lock: LockState, generation: int) -> Cleanup:
    """Delete whatever row of ours an unanswered acquire may have left, once it can no longer land."""
    current = now()
    return Cleanup(
        lock,
        acquired_at=None,
        generation=generation,
        conclusive_from=max(current, lock.stray_row_may_land_until),
        give_up_at=current + lock.timing.stale_threshold,
        ended_how="abandoned",
    )


def _acquire_attributes(lock: LockState, blocking: bool, timeout: float | None) -> dict[str, AttributeValue]:
    extra: dict[str, AttributeValue] = {"postgres_mutex.blocking": blocking}
    if timeout is not None:
        extra["postgres_mutex.timeout"] = timeout
    return lock.span_attributes(**extra)


# -- release -------------------------------------------------------------------


def release(
    lock: LockState,
    tracing: Tracing,
    *,
    caller: object,
    began: tuple[Hold | None, object] | None = None,
    first: Result | DatabaseError | None = None,
) -> Flow[bool]:
    """Delete this Mutex's row and wake waiters: one statement, within one ``operation_timeout``.

    Returns True if a row was deleted. Raises `LockNotHeldError` if nothing
    was held (as ``threading.Lock.release`` does), or if the lock had been
    lost (its row, if it may still be ours, is deleted in the background:
    nothing is sent in the caller's time for a lock known to be lost). Raises
    `DatabaseError` if the row could not be deleted: it is then deleted in
    the background as soon as the database answers. An exception raised into
    it (a signal handler's), wherever it lands, leaves the row to the
    background likewise.

    With ``began`` (what `LockState.begin_release` returned, and the releaser
    it was given), the release began before this flow; with ``first``, its
    statement was sent too (`Acquisition`'s direct path), and this is its reply.
    """
    releaser = object() if began is None else began[1]
    settled = False  # the row's fate is known: deleted, gone, or handed to the background
    closing = False
    try:
        hold = lock.begin_release(caller, releaser) if began is None else began[0]
        if hold is None:
            settled = True
            raise lock.not_held_error(NOT_HELD)
        yield Forget(hold)
        with tracing.span("postgres_mutex.release", lambda: lock.span_attributes()) as span:
            if hold.status is HoldStatus.HELD:
                # Its lease ran out before anyone noticed: that is a loss, reported once.
                lost = lock.lose(hold, LEASE_EXPIRED)
                if lost is not None:
                    yield Tell(lock, lost)
            if hold.status is HoldStatus.LOST:
                lock.events.released_after_loss(span)
                if hold.reason == LEASE_EXPIRED:
                    # Nobody may have reclaimed it yet: the row may still be ours.
                    yield Schedule(scoped_cleanup(lock, hold, ended_how="lost"))
                settled = True
                raise hold.error()
            timeout = lock.timing.operation_timeout
            params = lock.params()
            # Unless sent already (`first`): it wakes another process, not this one's registration.
            own_slot = params["own_slot"] = None if isinstance(first, Result) else (yield Releasing(lock.channel))
            try:
                result = yield from _execute_in_shape(
                    lock, lock.kind.release_statement, params, timeout, "release", first
                )
            except DatabaseError as exc:
                # Failed or cut off: the row may remain. Delete it later.
                yield Schedule(scoped_cleanup(lock, hold))
                settled = True
                # Of the failure's own class: a release cut at its deadline is an `OperationTimeout`.
                error = type(exc)(
                    f"{exc}; the lock row is deleted in the background as soon as the database answers "
                    f"(else another instance may reclaim it after stale_threshold, {lock.timing.stale_threshold:g}s)",
                    transient=exc.transient,
                    outcome_unknown=exc.outcome_unknown,
                    sqlstate=exc.sqlstate,
                )
                lock.events.release_failed(error, was_held=True)
                raise error from exc
            settled = True
            deleted = result.rowcount > 0
            if deleted and own_slot is not None and result.rows and not lock.kind.queues:
                # The channel notified: a slot's if it woke another process's waiter, which goes first.
                lock.released_and_woke(result.rows[0][0], result.sent_at)
            lock.events.released(span, deleted=deleted)
            if not deleted:
                # Held by our lease, yet the row was gone: someone deleted or took it.
                gone = lock.row_gone(hold)
                yield Tell(lock, gone)
                raise gone
            return True
    except GeneratorExit:
        closing = True  # its engine is gone: no more steps (the row goes at stale_threshold)
        raise
    finally:
        # Whichever way it ended, and wherever an exception landed: the hold it began to release.
        begun = lock.end_release(releaser)
        if closing:
            pass
        elif begun is not None and not settled:
            # Interrupted before the row's fate was known: it may remain. Delete it later.
            yield Forget(begun)
            yield Schedule(scoped_cleanup(lock, begun))
        if not closing and (lock.stray_row_possible or now() < lock.stray_row_may_land_until):
            # An unanswered acquire of ours may still land: sweep after it no longer can.
            yield Schedule(stray_row_cleanup(lock, lock.generation))


def _execute_in_shape(
    lock: LockState,
    pick: Callable[[Statements], Statement],
    params: Mapping[str, object],
    timeout: float,
    verb: str,
    first: Result | DatabaseError | None = None,
) -> Flow[Result]:
    """Run the table's statement ``pick`` names; again, once, if the table changed shape since it was inspected.

    A table or column the statement names is gone (the history dropped while
    this process ran, say): the engine forgot the table's shape; the
    statement, as the table is now, runs instead of failing the caller.
    ``first``: the statement was sent already, and this is how it ended.
    """
    try:
        if isinstance(first, DatabaseError):
            raise first
        if first is not None:
            return first
        statements: Statements = yield Shape(lock.names, timeout)
        result: Result = yield Execute(pick(statements), params, timeout, lock.describe(verb))
        return result
    except DatabaseError as exc:
        if exc.sqlstate not in SHAPE_CHANGED:
            raise
    # Rejected before it ran (at parse time): nothing was done, it is safe to send again.
    statements = yield Shape(lock.names, timeout, fresh=True)
    again: Result = yield Execute(pick(statements), params, timeout, lock.describe(verb))
    return again


def scoped_cleanup(lock: LockState, hold: Hold, *, ended_how: str = "released") -> Cleanup:
    current = now()
    return Cleanup(
        lock,
        row_name=hold.row_name,
        acquired_at=hold.acquired_at,
        generation=lock.generation,
        conclusive_from=current,
        give_up_at=current + lock.timing.stale_threshold,
        ended_how=ended_how,
    )


# -- clean-up --------------------------------------------------------------------


def clean_up(cleanup: Cleanup) -> Flow[bool]:
    """Try to delete the row ``cleanup`` describes; True once nothing more needs doing.

    Raises `DatabaseError` (the caller retries later) or `CleanupSuperseded`.
    """
    lock = cleanup.lock
    if cleanup.superseded:
        return True  # an acquire began since: it takes any row of ours back itself
    statements: Statements = yield Shape(lock.names, lock.timing.operation_timeout, urgent=True)
    params = {**lock.params(), "acquired_at": cleanup.acquired_at, "ended_how": cleanup.ended_how}
    if cleanup.row_name is not None:
        params["lock_name"] = cleanup.row_name
    stray = cleanup.acquired_at is None
    stray_statement = lock.kind.stray_cleanup(statements)
    # Urgent, as a heartbeat is: the heartbeat worker sends it, and renews nothing while it waits.
    # Queued behind the process's acquires stuck on a busy lock, it would let the leases run out.
    result: Result = yield Execute(
        (stray_statement or statements.cleanup) if stray else lock.kind.release_statement(statements),
        params,
        lock.timing.operation_timeout,
        lock.describe("clean-up"),
        urgent=True,
        stray_row=cleanup if stray else None,
    )
    if result.rowcount:
        lock.events.row_removed()
    conclusive = result.sent_at >= cleanup.conclusive_from
    if conclusive and stray:
        lock.stray_row_cleaned(cleanup.generation)
    return conclusive


def tokens_appeared(lock: LockState, result: AcquireResult, timeout: float) -> Flow[AcquireResult]:
    """The table was migrated while this process used it without tokens: use its new shape from now on.

    A fresh row took its token from the column's default. A row taken over
    kept the previous hold's, which must not name this one: it gets a new
    token (or none, if that fails: fencing then says the hold has none).
    """
    taken_over = result.outcome is not Outcome.ACQUIRED
    token = None if taken_over else result.token
    try:
        statements: Statements = yield Shape(lock.names, timeout, fresh=True)
        if taken_over and statements.retoken is not None:
            params = {**lock.params(), "acquired_at": result.acquired_at}
            reply = yield Execute(statements.retoken, params, timeout, lock.describe("acquire"))
            token = None if reply.row is None else reply.row[0]
    except DatabaseError:
        pass  # the hold stands; only its token is unknown
    return replace(result, token=token)
