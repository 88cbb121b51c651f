"""What each lock operation does, written once for the sync and async paths.

Each flow is a generator that yields the I/O it needs (`Execute`, `Pause`,
`Listen`, ...) and receives the result; an engine (`_engine_async`, and
`_engine` generated from it) performs those steps on a connection. Retries,
deadlines and the meaning of every result live here; what each event means
to the outside world is told by `LockEvents`. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, TypeVar

from . import _sql
from ._clock import now
from ._rules import (
    CANCELLED,
    LOCK_NOT_AVAILABLE,
    PRIVILEGE,
    SERIALIZATION_FAILURE,
    SHAPE_CHANGED,
    UNDEFINED_COLUMN,
    AcquireResult,
    Outcome,
    interpret_acquire,
    observe,
)
from ._sql import Names, Statement, Statements
from ._state import LEASE_EXPIRED, NOT_HELD, ROW_GONE, Hold, HoldStatus, LockState
from ._tracing import INSTANCE_ID, LOCK_NAME, AttributeValue, Tracing, mark_error, set_outcome
from .errors import DatabaseError, LockAcquisitionTimeout, LockNotHeldError, OperationTimeout, SchemaError

T = TypeVar("T")


# -- the steps a flow asks for ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Execute:
    """Run one statement within ``timeout`` seconds; the engine sends back a `Result`.

    Failures come back as `DatabaseError` thrown into the flow. ``urgent``
    statements (heartbeats) go before others waiting for the connection.
    """

    statement: Statement
    params: Mapping[str, object]
    timeout: float
    action: str
    urgent: bool = False
    guard: CleanupGuard | None = None
    """For a clean-up of rows carrying our id: the engine holds the Mutex's
    sending lock while it runs, and does not send it (raising
    `CleanupSuperseded`) if an acquire began since."""


@dataclass(frozen=True, slots=True)
class CleanupGuard:
    lock: LockState
    epoch: int

    @property
    def superseded(self) -> bool:
        return self.lock.cleanup_epoch != self.epoch


class CleanupSuperseded(Exception):
    """A clean-up was not sent: an acquire began after it, and takes the row back itself."""


@dataclass(frozen=True, slots=True)
class Result:
    rowcount: int
    rows: tuple[tuple[Any, ...], ...] = ()
    sent_at: float = 0.0
    """When the statement was sent: after any wait for the connection, so leases count from there."""

    @property
    def row(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait ``seconds``; the engine sends back False if it is shutting down."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Shape:
    """The statements for a table, in the shape it has; the engine inspects the table once and remembers.

    ``timeout`` bounds that one inspection, as it bounds the statement that needs it.
    """

    names: Names
    timeout: float
    fresh: bool = False
    """Inspect the table again even if the engine knows its shape (it changed since)."""


@dataclass(frozen=True, slots=True)
class Listen:
    """Start hearing releases on ``channel``; the engine sends back True once it listens.

    False where listening is impossible (a pool) or did not come about in
    ``timeout`` seconds: the flow then polls.
    """

    channel: str
    timeout: float


@dataclass(frozen=True, slots=True)
class WaitForRelease:
    """Wait up to ``seconds`` for the release announced on the channel `Listen` subscribed to (or just wait).

    With a ``stop``, the wait also ends the moment it is set.
    """

    seconds: float
    stop: StopSignal | None = None


class StopSignal:
    """A flag that ends a blocking acquire at once: an election's ``stop()``, from any thread.

    The acquire checks it before each attempt; the engine's wait for a
    release registers a waker on it, so setting it wakes the wait at once
    rather than after ``poll_interval``. No lock: setting it may happen in a
    signal handler that interrupted the very thread that waits, and list
    operations are atomic under the GIL.
    """

    __slots__ = ("_set", "_wakers")

    def __init__(self) -> None:
        self._set = False
        self._wakers: list[Callable[[], object]] = []

    def set(self) -> None:
        self._set = True
        for wake in list(self._wakers):
            wake()

    def is_set(self) -> bool:
        return self._set

    @contextmanager
    def waking(self, wake: Callable[[], object]) -> Iterator[None]:
        """While the block runs, setting the signal calls ``wake`` (at once, if it is set already)."""
        self._wakers.append(wake)
        try:
            if self._set:
                wake()
            yield
        finally:
            self._wakers.remove(wake)


@dataclass(frozen=True, slots=True)
class StopListening:
    """Stop hearing the channel `Listen` subscribed to (the engine UNLISTENs when nobody else waits on it)."""


@dataclass(frozen=True, slots=True)
class Settle:
    """Wait until no clean-up of rows carrying ``lock``'s id is on the wire (it would cross the acquire)."""

    lock: LockState


@dataclass(frozen=True, slots=True)
class Keep:
    """Renew ``hold`` with the engine's heartbeats from now on."""

    hold: Hold


@dataclass(frozen=True, slots=True)
class Forget:
    """Stop renewing ``hold``."""

    hold: Hold


@dataclass(eq=False)
class Cleanup:
    """A row of ours that may remain in the table, to delete in the background.

    ``acquired_at`` scopes the delete to one hold (a failed release, a lost
    lease); None means any row carrying our id (an acquire that went
    unanswered), which is guarded against a newer acquire by ``epoch``. The
    row is gone once a delete succeeds at or after ``settled_at``, the moment
    after which no statement of ours can still be running on the server.
    """

    lock: LockState
    acquired_at: datetime | None
    epoch: int
    settled_at: float
    give_up_at: float
    due: float = field(default_factory=now)
    ended_how: str = "released"
    """How the history records the hold this row belonged to, if the table keeps one."""


@dataclass(frozen=True, slots=True)
class Tell:
    """Report a loss: the engine hands it to the client's event thread (``on_lost`` runs there)."""

    lock: LockState
    error: LockNotHeldError


@dataclass(frozen=True, slots=True)
class Schedule:
    """Hand ``cleanup`` to the background; the flow does not wait for it."""

    cleanup: Cleanup


Op = Execute | Pause | Shape | Settle | Listen | WaitForRelease | StopListening | Keep | Forget | Tell | Schedule
Flow = Generator[Op, Any, T]


# -- acquire -------------------------------------------------------------------

# A statement capped by an acquire's remaining time still gets this long, so
# that a nearly spent timeout ends in a real attempt rather than a cut-off one.
_MIN_STATEMENT_TIMEOUT = 0.1


@dataclass
class _Progress:
    attempts: int = 0
    result: AcquireResult | None = None
    stopped: bool = False


def acquire(
    lock: LockState,
    tracing: Tracing,
    *,
    blocking: bool,
    timeout: float | None,
    owner: object,
    stop: StopSignal | None = None,
) -> Flow[Hold | None]:
    """Try to take the lock: once, or until ``timeout`` if ``blocking``.

    Returns the hold when acquired, None when non-blocking and held
    elsewhere, or when ``stop`` was set before an attempt won the lock (the
    span then ends as ``cancelled``). Raises `LockAcquisitionTimeout` when a blocking acquire runs out
    of time, `LockAlreadyHeldError` if this Mutex holds the lock already, and
    `DatabaseError` for failures it cannot wait out. A non-blocking acquire
    returns within one ``operation_timeout`` (plus a connect). Whatever way it
    ends without the lock (cancellation included), a row an unanswered
    attempt may have left is handed to the background to delete.

    The whole acquire is one span, each attempt an event on it.
    """
    epoch = lock.begin_acquire()
    started = now()
    progress = _Progress()
    extra: dict[str, AttributeValue] = {"postgres_mutex.blocking": blocking}
    if timeout is not None:
        extra["postgres_mutex.timeout"] = timeout
    outcome = "cancelled"
    with tracing.span("postgres_mutex.acquire", span_attributes(lock, **extra)) as span:
        try:
            hold = yield from _attempt_until_done(
                lock, tracing, span, progress, blocking=blocking, timeout=timeout, owner=owner, epoch=epoch, stop=stop
            )
            result = progress.result
            if progress.stopped:
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
            result = progress.result
            lock.events.acquire_ended(
                span,
                outcome,
                attempts=progress.attempts,
                waited=now() - started,
                holder=None if result is None else result.holder,
            )


def _attempt_until_done(
    lock: LockState,
    tracing: Tracing,
    span: Any,
    progress: _Progress,
    *,
    blocking: bool,
    timeout: float | None,
    owner: object,
    epoch: int,
    stop: StopSignal | None,
) -> Flow[Hold | None]:
    timing = lock.timing
    events = lock.events
    started = now()
    deadline = None if timeout is None else started + timeout
    # Without blocking, the whole acquire fits in one operation_timeout.
    budget = deadline if blocking else started + timing.operation_timeout
    quick_retry_spent = False
    listening = False
    try:
        yield Settle(lock)
        statements: Statements | None = None
        while True:
            if stop is not None and stop.is_set():
                progress.stopped = True
                if lock.row_suspected:
                    yield Schedule(unanswered_cleanup(lock, epoch))
                lock.abort_acquire()
                return None
            statement_timeout = timing.operation_timeout
            if budget is not None:
                statement_timeout = min(statement_timeout, max(_MIN_STATEMENT_TIMEOUT, budget - now()))
            suspected_before = lock.row_suspected
            # Until a reply says otherwise, this attempt may leave our row behind:
            # an interruption (cancellation, a signal's exception) must clean up too.
            lock.row_suspected = True
            progress.attempts += 1
            try:
                if statements is None:
                    # Inside the retries: the table's first inspection can meet a busy pool or a restart too.
                    statements = yield Shape(lock.names, statement_timeout)
                reply = yield Execute(statements.acquire, lock.params(), statement_timeout, lock.describe("acquire"))
            except BaseException as exc:
                if not isinstance(exc, DatabaseError):
                    # Interrupted mid-statement (cancelled, a signal's exception): it may still land.
                    lock.unanswered_until = max(lock.unanswered_until, now() + 2 * statement_timeout)
                    raise
                if exc.outcome_unknown:
                    # Sent before now; it can run on the server for a statement_timeout at most.
                    lock.unanswered_until = max(lock.unanswered_until, now() + 2 * statement_timeout)
                else:
                    lock.row_suspected = suspected_before
                if exc.sqlstate == CANCELLED and not blocking:
                    # The server gave up waiting for the row: another session has it
                    # locked (an acquire in flight, a holder's fenced transaction).
                    busy = AcquireResult(Outcome.CONTENDED, None, None)
                    progress.result = busy
                    events.contended(span, busy, alert=False)
                    lock.abort_acquire()
                    return None
                if exc.sqlstate in SHAPE_CHANGED and not quick_retry_spent:
                    # Rejected at parse time (the history dropped, say): as the table is now.
                    quick_retry_spent = True
                    statements = yield Shape(lock.names, statement_timeout, fresh=True)
                    continue
                if _retry_at_once(exc) and not quick_retry_spent and (budget is None or now() < budget):
                    # A connection the server closed while idle, or a serialization
                    # failure a session default caused: one prompt retry, even
                    # when not blocking.
                    quick_retry_spent = True
                    events.attempt_failed(span, exc, retrying_in=None)
                    continue
                if not blocking or not exc.transient:
                    events.attempt_failed(span, exc, retrying_in=None)
                    raise
                if _passed(deadline):
                    # Out of time while the database stood in the way (a row locked by
                    # another session, a silent network): to the caller, that is the
                    # timeout it asked for, with what stood in the way as its cause.
                    events.attempt_failed(span, exc, retrying_in=None)
                    raise LockAcquisitionTimeout(
                        f"lock {lock.lock_name!r} not acquired within {max(timeout or 0.0, 0.0):g}s: "
                        f"the last attempt failed: {exc}",
                        timeout,
                        lock_name=lock.lock_name,
                        holder=lock.last_holder,
                    ) from exc
                pause = _until(deadline, timing.poll_interval)
                events.attempt_failed(span, exc, retrying_in=pause)
                yield Pause(pause)
                continue

            result = interpret_acquire(reply.row, lock.instance_id)
            if result.outcome.acquired and not statements.shape.tokens and result.token is not None:
                result = yield from _tokens_appeared(lock, result, statement_timeout)
            progress.result = result
            if result.outcome.acquired:
                assert result.acquired_at is not None
                hold = lock.won(
                    acquired_at=result.acquired_at,
                    token=result.token,
                    sent_at=reply.sent_at,
                    owner=owner,
                    span_context=span.get_span_context(),
                )
                events.acquired(span, result, expected_own_row=suspected_before)
                yield Keep(hold)
                return hold
            # Our statement ran and the row is someone else's: nothing of ours
            # is in the table, unless an unanswered attempt lands later.
            lock.row_suspected = now() < lock.unanswered_until
            lock.last_holder = result.holder
            events.contended(span, result, alert=lock.alert_gate.should_alert(result.holder, result.heartbeat_age))
            if not blocking:
                lock.abort_acquire()
                return None
            if _passed(deadline):
                raise LockAcquisitionTimeout(
                    f"lock {lock.lock_name!r} still held by {result.holder or 'another instance'} "
                    f"after {max(timeout or 0.0, 0.0):g}s",
                    timeout,
                    lock_name=lock.lock_name,
                    holder=result.holder,
                )
            if not listening:
                listening = True
                if (yield Listen(lock.channel, timing.operation_timeout)):
                    # Listening now: try once more at once, so that a release
                    # between the attempt and the LISTEN cannot be missed.
                    continue
            yield WaitForRelease(_until(deadline, timing.poll_interval), stop)
    except BaseException:
        # Timeout, error or interruption: leave nothing behind, in the background.
        if lock.row_suspected:
            yield Schedule(unanswered_cleanup(lock, epoch))
        lock.abort_acquire()
        raise
    finally:
        if listening:
            yield StopListening()


def _tokens_appeared(lock: LockState, result: AcquireResult, timeout: float) -> Flow[AcquireResult]:
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


def unanswered_cleanup(lock: LockState, epoch: int) -> Cleanup:
    """Delete whatever row of ours an unanswered acquire may have left, once it can no longer land."""
    current = now()
    return Cleanup(
        lock,
        acquired_at=None,
        epoch=epoch,
        settled_at=max(current, lock.unanswered_until),
        give_up_at=current + lock.timing.stale_threshold,
        ended_how="abandoned",
    )


def span_attributes(lock: LockState, **extra: AttributeValue) -> dict[str, AttributeValue]:
    return {LOCK_NAME: lock.lock_name, INSTANCE_ID: lock.instance_id, **extra}


# -- release -------------------------------------------------------------------


def release(lock: LockState, tracing: Tracing, *, caller: object) -> Flow[bool]:
    """Delete this Mutex's row and wake waiters: one statement, within one ``operation_timeout``.

    Returns True if a row was deleted. Raises `LockNotHeldError` if nothing
    was held (as ``threading.Lock.release`` does), or if the lock had been
    lost (its row, if it may still be ours, is deleted in the background:
    nothing is sent in the caller's time for a lock known to be lost). Raises
    `DatabaseError` if the row could not be deleted: it is then deleted in
    the background as soon as the database answers.
    """
    hold = lock.begin_release(caller)
    if hold is None:
        if lock.row_suspected:
            yield Schedule(unanswered_cleanup(lock, lock.cleanup_epoch))
        raise lock.not_held_error(NOT_HELD)
    yield Forget(hold)
    try:
        with tracing.span("postgres_mutex.release", span_attributes(lock)) as span:
            if hold.status is HoldStatus.HELD:
                # Its lease ran out before anyone noticed: that is a loss, reported once.
                lost = lock.lose(hold, LEASE_EXPIRED)
                if lost is not None:
                    yield Tell(lock, lost)
            if hold.status is HoldStatus.LOST:
                lock.events.released_after_loss(span)
                if hold.reason == LEASE_EXPIRED:
                    # Nobody may have reclaimed it yet: the row may still be ours.
                    yield Schedule(_scoped_cleanup(lock, hold, ended_how="lost"))
                raise hold.error()
            timeout = lock.timing.operation_timeout
            try:
                result = yield from _execute_in_shape(lock, lambda statements: statements.release, timeout, "release")
            except BaseException as exc:
                # Failed, cut off or interrupted: the row may remain. Delete it later.
                yield Schedule(_scoped_cleanup(lock, hold))
                if not isinstance(exc, DatabaseError):
                    raise
                error = DatabaseError(
                    f"{exc}; the lock row is deleted in the background as soon as the database answers "
                    f"(else another instance may reclaim it after stale_threshold, {lock.timing.stale_threshold:g}s)",
                    transient=exc.transient,
                    outcome_unknown=exc.outcome_unknown,
                    sqlstate=exc.sqlstate,
                )
                lock.events.release_failed(error, was_held=True)
                raise error from exc
            deleted = result.rowcount > 0
            lock.events.released(span, deleted=deleted)
            if not deleted:
                # Held by our lease, yet the row was gone: someone deleted or took it.
                hold.reason = ROW_GONE
                gone = hold.error()
                yield Tell(lock, gone)
                raise gone
            return True
    finally:
        lock.end_release()
        if lock.row_suspected or now() < lock.unanswered_until:
            # An unanswered acquire of ours may still land: sweep after it no longer can.
            yield Schedule(unanswered_cleanup(lock, lock.cleanup_epoch))


def _execute_in_shape(
    lock: LockState, pick: Callable[[Statements], Statement], timeout: float, verb: str
) -> Flow[Result]:
    """Run the table's statement ``pick`` names; again, once, if the table changed shape since it was inspected.

    A table or column the statement names is gone (the history dropped while
    this process ran, say): the engine forgot the table's shape; the
    statement, as the table is now, runs instead of failing the caller.
    """
    statements: Statements = yield Shape(lock.names, timeout)
    try:
        first: Result = yield Execute(pick(statements), lock.params(), timeout, lock.describe(verb))
        return first
    except DatabaseError as exc:
        if exc.sqlstate not in SHAPE_CHANGED:
            raise
    # Rejected before it ran (at parse time): nothing was done, it is safe to send again.
    statements = yield Shape(lock.names, timeout, fresh=True)
    again: Result = yield Execute(pick(statements), lock.params(), timeout, lock.describe(verb))
    return again


def _scoped_cleanup(lock: LockState, hold: Hold, *, ended_how: str = "released") -> Cleanup:
    current = now()
    return Cleanup(
        lock,
        acquired_at=hold.acquired_at,
        epoch=lock.cleanup_epoch,
        settled_at=current,
        give_up_at=current + lock.timing.stale_threshold,
        ended_how=ended_how,
    )


# -- heartbeat -------------------------------------------------------------------


@dataclass
class Beat:
    """What one heartbeat statement did for each of the holds it carried."""

    renewed: list[Hold]
    lost: list[tuple[Hold, LockNotHeldError]]
    latency: float
    error: DatabaseError | None = None
    """The statement failed: nothing was renewed."""
    sent_at: float = 0.0
    """When the (first) heartbeat statement was sent."""
    busy: list[Hold] = field(default_factory=list)
    """Not renewed: another session holds the row locked. Tried again soon."""


def heartbeat(holds: list[Hold], statements: Statements, tracing: Tracing, timeout: float) -> Flow[Beat]:
    """Renew ``holds`` (one table, one engine) with one statement, each scoped to its hold.

    A hold whose row is gone (deleted or taken over) is lost; the others are
    renewed from the moment the statement was sent. A row another session
    has locked is skipped, then tried once more by a statement that waits for
    it briefly (a contender's acquire locks the row for an instant): if it is
    still locked, that hold is busy, and tried again soon. A table that
    changed shape since it was inspected (its history dropped) is inspected
    again and the statement sent as the table is now: that is no failure. A
    failure of the statement renews nothing: the caller retries until the
    leases run out.
    """
    attributes: dict[str, AttributeValue] = {"postgres_mutex.locks": len(holds)}
    if len(holds) == 1:
        attributes.update(span_attributes(holds[0].lock))
    links = [hold.span_context for hold in holds[:32]]
    with tracing.span("postgres_mutex.heartbeat", attributes, links=links) as span:
        action = holds[0].lock.describe("heartbeat") if len(holds) == 1 else f"heartbeat of {len(holds)} locks"
        beat = Beat([], [], 0.0)
        by_token, renew, renew_waiting = _heartbeat_statements(holds, statements)
        pending, waiting, reshaped = holds, False, False
        while pending:
            statement = renew_waiting if waiting else renew
            params = _heartbeat_params(pending, tokens=by_token)
            params["alert_seconds"] = holds[0].lock.timing.alert_threshold
            params["lock_timeout_ms"] = max(1, int(min(_BRIEF_WAIT, timeout / 2) * 1000))
            try:
                reply = yield Execute(statement, params, timeout, action, urgent=True)
            except DatabaseError as exc:
                if exc.sqlstate in SHAPE_CHANGED and not reshaped:
                    # Rejected before it ran (at parse time): nothing renewed, safe to send again.
                    reshaped = True
                    statements = yield Shape(holds[0].lock.names, timeout, fresh=True)
                    by_token, renew, renew_waiting = _heartbeat_statements(holds, statements)
                    continue
                if not waiting:
                    set_outcome(span, "failed")
                    return Beat([], [], 0.0, exc)
                beat.busy.extend(pending)  # still locked after a brief wait
                break
            sent_at = reply.sent_at
            if not beat.sent_at:
                beat.sent_at, beat.latency = sent_at, now() - sent_at
            answers = {tuple(row[:-2]): (row[-2], row[-1]) for row in reply.rows}
            skipped = []
            for hold in pending:
                lock = hold.lock
                renewed, present = answers.get(_hold_key(hold, tokens=by_token), (False, False))
                if renewed:
                    if lock.renew(hold, sent_at):
                        beat.renewed.append(hold)
                elif present:
                    skipped.append(hold)
                else:
                    error = lock.lose(hold, ROW_GONE)
                    if error is not None:
                        beat.lost.append((hold, error))
            if waiting:
                beat.busy.extend(skipped)
                break
            pending, waiting = skipped, True
        outcome = "lost" if beat.lost else "busy" if beat.busy else "renewed"
        set_outcome(span, outcome, latency_seconds=beat.latency, renewed=len(beat.renewed))
        if beat.lost:
            mark_error(span, f"{len(beat.lost)} of {len(holds)} locks were lost: their rows were gone")
        return beat


def _heartbeat_statements(holds: list[Hold], statements: Statements) -> tuple[bool, Statement, Statement]:
    """Whether ``holds`` are renewed by token, and the statement (and its waiting twin) that does it."""
    if statements.heartbeat_by_token is not None and all(hold.token is not None for hold in holds):
        return (True, *statements.heartbeat_by_token)
    return False, statements.heartbeat, statements.heartbeat_waiting


def _heartbeat_params(holds: list[Hold], *, tokens: bool) -> dict[str, object]:
    if tokens:
        return {"tokens": [hold.token for hold in holds]}
    return {
        "lock_names": [hold.lock.lock_name for hold in holds],
        "instance_ids": [hold.lock.instance_id for hold in holds],
        "acquired_ats": [hold.acquired_at for hold in holds],
    }


def _hold_key(hold: Hold, *, tokens: bool) -> tuple[object, ...]:
    """How the heartbeat statement's answer names a hold: by token, or by lock, instance and stamp."""
    if tokens:
        return (hold.token,)
    return (hold.lock.lock_name, hold.lock.instance_id, hold.acquired_at)


# How long a heartbeat waits for a row another session holds locked, once it skipped it;
# and a forced release, in each of its tries.
_BRIEF_WAIT = 0.25
# Between a forced release's tries: the client's other statements (heartbeats) go first.
_FORCED_RELEASE_PAUSE = 0.02
# The least time a forced release's last try gets: enough for a delete on a
# database that answers, never more than a sliver past the deadline.
_LEAST_TRY = 0.05


def busy_error(hold: Hold) -> DatabaseError:
    """What a heartbeat that found its row locked by another session reports."""
    return DatabaseError(
        f"{hold.lock.describe('heartbeat')} could not renew it: another session holds its row locked "
        "(SELECT ... FOR UPDATE or FOR SHARE, or a DELETE in progress)",
        transient=True,
    )


def heartbeat_now(lock: LockState, tracing: Tracing) -> Flow[None]:
    """A heartbeat of this Mutex's hold alone, now (``mutex.heartbeat()``).

    Raises `LockNotHeldError` if the lock is not held or turns out lost,
    `DatabaseError` if the heartbeat failed (the lock stays held until its
    lease runs out).
    """
    hold = lock.require_held()
    statements: Statements = yield Shape(lock.names, lock.timing.operation_timeout)
    timeout = min(lock.timing.operation_timeout, max(0.0, hold.lease_deadline - now()))
    beat = yield from heartbeat([hold], statements, tracing, timeout)
    failure = beat.error or (busy_error(hold) if beat.busy else None)
    if failure is not None:
        lock.events.heartbeat_failed(failure)
        raise failure
    for _, error in beat.lost:
        yield Tell(lock, error)
        raise error
    if not beat.renewed:
        lock.require_held()  # its lease ran out meanwhile: raises saying so
    lock.events.heartbeat_renewed(beat.latency)


# -- clean-up --------------------------------------------------------------------


def clean_up(cleanup: Cleanup) -> Flow[bool]:
    """Try to delete the row ``cleanup`` describes; True once nothing more needs doing.

    Raises `DatabaseError` (the caller retries later) or `CleanupSuperseded`.
    """
    lock = cleanup.lock
    if cleanup.acquired_at is None and cleanup.epoch != lock.cleanup_epoch:
        return True  # an acquire began since: it takes any row of ours back itself
    statements: Statements = yield Shape(lock.names, lock.timing.operation_timeout)
    params = {**lock.params(), "acquired_at": cleanup.acquired_at, "ended_how": cleanup.ended_how}
    if cleanup.acquired_at is None:
        statement, guard = statements.cleanup, CleanupGuard(lock, cleanup.epoch)
    else:
        statement, guard = statements.release, None
    result: Result = yield Execute(
        statement, params, lock.timing.operation_timeout, lock.describe("clean-up"), guard=guard
    )
    if result.rowcount:
        lock.events.row_removed()
    settled = result.sent_at >= cleanup.settled_at
    if settled and cleanup.acquired_at is None and cleanup.epoch == lock.cleanup_epoch:
        lock.row_suspected = False
    return settled


# -- the table itself ------------------------------------------------------------------

# Errors two sessions creating the same objects at once can get: the loser
# sees the winner's catalog rows once it commits; one more try sees them exist.
_CONCURRENT_CREATE = frozenset({"23505", "42P07", "42710"})
_LOCK_NOT_AVAILABLE = "55P03"


def create_table(
    names: Names, timeout: float, *, history: bool = False, history_retention: float | None = None
) -> Flow[bool]:
    """CREATE the lock table (with its token column) IF NOT EXISTS, safe when many instances start at once.

    With ``history``, the history table too. Returns True if the table has a
    token column. A table that already exists is left as it is (see `migrate`
    to add tokens, or the history, to one).
    """
    action = f"create_schema of table {names.table_name}"
    for attempt in range(1, 4):
        exists, has_token, has_history = yield from inspect(names, timeout)
        if exists:
            if history:
                yield from create_history(names, timeout, history_retention, exists=has_history)
            return has_token
        try:
            yield Execute(_sql.create_table(names), {}, timeout, action)
            if history:
                yield from create_history(names, timeout, history_retention, exists=has_history)
            return True
        except DatabaseError as exc:
            if exc.sqlstate in _CONCURRENT_CREATE and attempt < 3:
                continue
            if exc.sqlstate == PRIVILEGE:
                raise SchemaError(
                    f"{action} failed: the role may not create it ({_server_words(exc)}). Create the table once "
                    "as a privileged role (see the README's Permissions section), grant this role "
                    "SELECT, INSERT, UPDATE, DELETE on it and USAGE on its sequence, and skip create_schema()",
                    sqlstate=exc.sqlstate,
                ) from exc
            if exc.sqlstate == "3F000":
                raise SchemaError(
                    f"{action} failed: its schema does not exist; create the schema first ({_server_words(exc)})",
                    sqlstate=exc.sqlstate,
                ) from exc
            if exc.sqlstate == UNDEFINED_COLUMN:
                continue  # an older table appeared meanwhile (another release created it): look again
            raise
    _, has_token, _ = yield from inspect(names, timeout)
    return has_token


DEFAULT_HISTORY_RETENTION = 30 * 24 * 3600.0
"""How long the history keeps a hold once it ended, unless told otherwise: 30 days."""


def create_history(names: Names, timeout: float, retention: float | None, *, exists: bool) -> Flow[None]:
    """The history table unless it ``exists`` (safe to race); with ``retention``, set it (None: leave it, or 30 days).

    An existing history is not touched unless a retention is given: its
    DDL would take locks every holder's statements need.
    """
    give_up_at = now() + max(timeout, 30.0)
    if not exists:
        statement = _sql.create_history(names, DEFAULT_HISTORY_RETENTION if retention is None else retention)
        action = f"creation of the history of table {names.table_name}"
        yield from _change_schema(statement, timeout, action, give_up_at)
    elif retention is not None:
        action = f"change of the retention of the history of table {names.table_name}"
        yield from _change_schema(_sql.history_retention(names, retention), timeout, action, give_up_at)


def inspect(names: Names, timeout: float) -> Flow[tuple[bool, bool, bool]]:
    """Whether the table exists, whether it has a token column, and whether it has a history."""
    reply = yield Execute(_sql.inspect_table(names), {}, timeout, f"inspection of table {names.table_name}")
    assert reply.row is not None
    exists, has_token, has_history = reply.row
    return bool(exists), bool(has_token), bool(has_history)


def migrate(
    names: Names, timeout: float, *, history: bool = False, history_retention: float | None = None
) -> Flow[bool]:
    """Add the token column, its sequence and its unique index to an existing table; idempotent.

    Online: each step is a catalog change that takes the table's lock for an
    instant, and waits at most a short ``lock_timeout`` for it (so it never
    queues behind a long transaction with holders' heartbeats queued behind
    it); a step that could not get the lock is retried until ``timeout``.
    Safe when many instances run it at once. Returns True if anything changed.
    """
    exists, has_token, has_history = yield from inspect(names, timeout)
    if not exists:
        raise SchemaError(
            f"the lock table {names.table_name} does not exist: create it with create_schema() "
            "(it then has tokens already)"
        )
    give_up_at = now() + max(timeout, 30.0)
    for step in _sql.migrate_steps(names):
        yield from _change_schema(step, timeout, f"migration of table {names.table_name}: {step.what}", give_up_at)
    if history:
        yield from create_history(names, timeout, history_retention, exists=has_history)
    return not has_token or (history and not has_history)


def _change_schema(statement: Statement, timeout: float, action: str, give_up_at: float) -> Flow[None]:
    """One idempotent change of the schema, retried while its table is busy (or another instance makes it too).

    Each try waits 50 ms at most for the table's lock, so the holders'
    statements queued behind it wait no longer; the pause between tries
    grows to a second, so that they mostly find the table free.
    """
    pause = 0.05
    while True:
        try:
            yield Execute(statement, {}, timeout, action)
            return
        except DatabaseError as exc:
            retry = exc.sqlstate in _CONCURRENT_CREATE or exc.sqlstate == _LOCK_NOT_AVAILABLE or exc.transient
            if not retry or now() >= give_up_at:
                if exc.sqlstate == PRIVILEGE:
                    raise SchemaError(
                        f"{action} failed: only the table's owner may change it ({_server_words(exc)}); "
                        "run it as that role",
                        sqlstate=exc.sqlstate,
                    ) from exc
                raise
            yield Pause(min(pause, max(0.0, give_up_at - now())))
            pause = min(pause * 2, 1.0)


def holders(
    names: Names,
    lock_names: frozenset[str] | None,
    timeout: float,
    *,
    alert_threshold: float,
    stale_threshold: float,
) -> Flow[list[Any]]:
    """Every held lock (or those named) with its holder and ages by the server's clock: one query."""
    statements: Statements = yield Shape(names, timeout)
    reply = yield Execute(
        statements.holders,
        {"lock_names": None if lock_names is None else sorted(lock_names)},
        timeout,
        f"read of the lock table {names.table_name}",
    )
    return observe(reply.rows, alert_threshold=alert_threshold, stale_threshold=stale_threshold)


def read_history(
    names: Names,
    timeout: float,
    *,
    lock_name: str | None,
    since: datetime | None,
    since_seconds: float | None,
    limit: int,
) -> Flow[list[tuple[Any, ...]]]:
    """Holds from the history, newest first. Raises `SchemaError` if the table keeps none."""
    statements: Statements = yield Shape(names, timeout)
    if statements.history is None:
        # Added since this client looked (by another process, say)?
        statements = yield Shape(names, timeout, fresh=True)
    if statements.history is None:
        raise SchemaError(
            f"the lock table {names.table_name} keeps no history: add one with "
            "LockTable.migrate(history=True) (or 'postgres-mutex migrate --history')"
        )
    reply = yield Execute(
        statements.history,
        {"lock_name": lock_name, "since": since, "since_seconds": since_seconds, "limit": limit},
        timeout,
        f"read of the history of table {names.table_name}",
    )
    return list(reply.rows)


def force_release(names: Names, lock_name: str, timeout: float) -> Flow[tuple[str, float, int | None] | None]:
    """Delete a lock's row whoever holds it; (holder, seconds since its heartbeat, token), or None if free.

    A row a fenced transaction holds locked is waited for up to ``timeout``,
    in brief waits with the connection free between them, so that the
    heartbeats of the same client (a holder in this process) go on meanwhile.
    """
    statements: Statements = yield Shape(names, timeout)
    action = f"forced release of lock {lock_name!r}"
    deadline = now() + timeout
    while True:
        left = max(deadline - now(), _LEAST_TRY)
        try:
            reply: Result = yield Execute(
                statements.force_release,
                {
                    "lock_name": lock_name,
                    "channel": names.channel(lock_name),
                    "ended_how": "force_released",
                    "alert_seconds": None,  # the table does not know the holders' thresholds
                    # At most half the statement's time, so the lock wait, not the
                    # statement's own deadline, is what ends a try behind a locked row.
                    "lock_timeout_ms": max(1, int(min(_BRIEF_WAIT, left / 2) * 1000)),
                },
                left,
                action,
            )
            break
        except DatabaseError as exc:
            # CANCELLED too: the server's deadline for the statement can still end
            # a try that waited on the row (a slow server, the last try's sliver).
            if exc.sqlstate not in (LOCK_NOT_AVAILABLE, CANCELLED):
                raise
            if deadline - now() <= 0:
                raise OperationTimeout(
                    f"{action} did not finish within operation_timeout ({timeout:g}s): another session kept the "
                    "lock's row locked (the holder's fenced transaction, or SELECT ... FOR UPDATE); nothing was "
                    "deleted",
                    transient=True,
                    sqlstate=exc.sqlstate,
                ) from exc
            if not (yield Pause(_FORCED_RELEASE_PAUSE)):
                raise DatabaseError(
                    f"{action} stopped: the client was closed while the lock's row was locked by another "
                    "session; nothing was deleted",
                    transient=False,
                    sqlstate=exc.sqlstate,
                ) from exc
    if reply.row is None:
        return None
    holder, age, token, _ = reply.row
    return str(holder), float(age), None if token is None else int(token)


def _server_words(exc: DatabaseError) -> str:
    cause = exc.__cause__
    diag = getattr(cause, "diag", None)
    primary = getattr(diag, "message_primary", None)
    return str(primary) if primary else str(exc)
