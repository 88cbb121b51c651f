"""The heartbeat's flows: one statement renewing many holds, and a holder's own heartbeat now.

A heartbeat statement carries the holds of one group, at most `BATCH` of
them (`batches`); what it finds for each (renewed, lost, its row locked by
another session) is reported through the holds' `LockEvents`, from the
client's event thread. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from .._base.clock import now
from .._observe.tracing import AttributeValue, Tracing, mark_error, set_outcome
from ..errors import DatabaseError, LockNotHeldError
from .failures import SHAPE_CHANGED
from .locks import ROW_GONE, Hold, LockState
from .steps import BRIEF_WAIT, Execute, Flow, Shape, Tell

if TYPE_CHECKING:
    from .._sql import Statement, Statements

T = TypeVar("T")

BATCH = 250
"""The most holds one heartbeat statement renews.

A group with more is renewed by several statements, sent one after another,
each taking its own turn on the client's connection: a lock operation of the
same process that arrives meanwhile waits for one statement of at most this
many holds, never for the renewal of all of them (a statement of 10,000 holds
takes a tenth of a second and more). Each statement still costs one round
trip, so the bound is large enough that the round trips add little to the
work of renewing the rows: about one statement per 250 locks held.
"""


def batches(holds: list[Hold]) -> list[list[Hold]]:
    """``holds`` in the order given, split for heartbeat statements of at most `BATCH` holds each."""
    return [holds[start : start + BATCH] for start in range(0, len(holds), BATCH)]


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
    confirmed: list[tuple[Hold, float]] = field(default_factory=list)
    """Renewed after their doubt was told, with how long they were in doubt."""


def heartbeat(holds: list[Hold], statements: Statements, tracing: Tracing, timeout: float) -> Flow[Beat]:
    """Renew ``holds`` (one table, one engine, at most `BATCH`) with one statement, each scoped to its hold.

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
        attributes.update(holds[0].lock.span_attributes())
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
            params["lock_timeout_ms"] = max(1, int(min(BRIEF_WAIT, timeout / 2) * 1000))
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
                    in_doubt_for = lock.renew(hold, sent_at)
                    if in_doubt_for is not None:
                        beat.renewed.append(hold)
                    if in_doubt_for:
                        beat.confirmed.append((hold, in_doubt_for))
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
        "lock_names": [hold.row_name for hold in holds],
        "instance_ids": [hold.lock.instance_id for hold in holds],
        "acquired_ats": [hold.acquired_at for hold in holds],
    }


def _hold_key(hold: Hold, *, tokens: bool) -> tuple[object, ...]:
    """How the heartbeat statement's answer names a hold: by token, or by lock, instance and stamp."""
    if tokens:
        return (hold.token,)
    return (hold.row_name, hold.lock.instance_id, hold.acquired_at)


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
    lease runs out, or with ``reclaim_disconnected_after`` until its hold is
    in doubt). A hold in doubt is heartbeated too: a heartbeat that finds its
    row still this Mutex's confirms it.
    """
    hold = lock.require_renewable()
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
    for _, seconds in beat.confirmed:
        lock.events.confirmed(seconds)
