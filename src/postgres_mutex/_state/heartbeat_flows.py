"""The heartbeat's flows: one statement renewing many holds, and a holder's own heartbeat now.

A heartbeat statement carries the holds of one group, at most `BATCH` of
them (`batches`); what it finds for each (renewed, lost, its row locked by
another session) is reported through the holds' `LockEvents`, from the
client's event thread. Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from .._base.clock import now
from .._observe.tracing import AttributeValue, Tracing, mark_error, set_outcome
from ..errors import DatabaseError, LockNotHeldError
from .failures import SHAPE_CHANGED
from .locks import ROW_GONE, Facts, Hold, LockState
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
    revision: int | None = None
    """The lease's revision, where the statement renewed the lease too (None: it did not, or it lapsed)."""
    kept: list[int] | None = None
    """Where the statement renewed the lease too: the tokens it was to detach but could not (their rows locked by
    another session), to send again."""


@dataclass
class LeaseRenewal:
    """The lease a heartbeat statement renews as well (`_sql.leases.renewal`): its key, the tokens of the rows no
    longer renewed that it detaches, and how old it may be for the renewal to land (`lease_within`)."""

    key: int
    detach: list[int]
    within: float


def heartbeat(
    holds: list[Hold],
    statements: Statements,
    tracing: Tracing,
    timeout: float,
    lease_key: int | None = None,
    renewal: LeaseRenewal | None = None,
) -> Flow[Beat]:
    """Renew ``holds`` (one table, one engine, at most `BATCH`) with one statement, each scoped to its hold.

    A hold whose row is gone (deleted or taken over) is lost; the others are
    renewed from the moment the statement was sent. A row another session
    has locked is skipped, then tried once more by a statement that waits for
    it briefly (a contender's acquire locks the row for an instant): if it is
    still locked, that hold is busy, and tried again soon. A table that
    changed shape since it was inspected (its history dropped) is inspected
    again and the statement sent as the table is now: that is no failure. A
    failure of the statement renews nothing: the caller retries until the
    leases run out. ``lease_key``: the rows renewed follow that lease from now
    on (`follows_lease` holds only, on a table `renew_lease` works on). ``renewal``: the same statement renews
    that lease (`renew_lease`), whose revision the beat then carries, and the rows of ``holds``, which already
    follow it and whose own heartbeat is due, by themselves.
    """
    attributes: dict[str, AttributeValue] = {"postgres_mutex.locks": len(holds)}
    if len(holds) == 1:
        attributes.update(holds[0].lock.span_attributes())
    links = [hold.span_context for hold in holds[:32]]
    with tracing.span("postgres_mutex.heartbeat", attributes, links=links) as span:
        action = holds[0].lock.describe("heartbeat") if len(holds) == 1 else f"heartbeat of {len(holds)} locks"
        beat = Beat([], [], 0.0)
        by_token, renew, renew_waiting = _heartbeat_statements(holds, statements, lease_key)
        if renewal is not None and statements.renew_lease_with_rows is not None:
            by_token, renew = True, statements.renew_lease_with_rows
        else:
            renewal = None
        revised, revised_waiting = _revised(statements, lease_key, renewal)
        pending, waiting, reshaped = holds, False, False
        while pending:
            statement = renew_waiting if waiting else renew
            params = _heartbeat_params(pending, tokens=by_token)
            params["lease_key"] = lease_key
            if lease_key is not None:
                params["within"] = lease_within(holds, timeout)
            if renewal is not None and not waiting:
                params.update(lease_key=renewal.key, detach=renewal.detach, within=renewal.within)
            params["alert_seconds"] = holds[0].lock.timing.alert_threshold
            params["lock_timeout_ms"] = max(1, int(min(BRIEF_WAIT, timeout / 2) * 1000))
            try:
                reply = yield Execute(statement, params, timeout, action, urgent=True)
            except DatabaseError as exc:
                if exc.sqlstate in SHAPE_CHANGED and not reshaped:
                    # Rejected before it ran (at parse time): nothing renewed, safe to send again.
                    reshaped = True
                    statements = yield Shape(holds[0].lock.names, timeout, fresh=True, urgent=True)
                    if statements.heartbeat_leased is None:
                        lease_key = None
                    by_token, renew, renew_waiting = _heartbeat_statements(holds, statements, lease_key)
                    if renewal is not None and statements.renew_lease_with_rows is not None:
                        by_token, renew = True, statements.renew_lease_with_rows
                    else:
                        renewal = None
                    revised, revised_waiting = _revised(statements, lease_key, renewal)
                    continue
                if not waiting:
                    set_outcome(span, "failed")
                    return Beat([], [], 0.0, exc)
                beat.busy.extend(pending)  # still locked after a brief wait
                break
            sent_at = reply.sent_at
            if not beat.sent_at:
                beat.sent_at, beat.latency = sent_at, now() - sent_at
            rows = reply.rows
            if renewal is not None and not waiting:
                if rows:
                    beat.kept = list(rows[0][-1])
                rows = [row[:-1] for row in rows]
            if revised_waiting if waiting else revised:
                if rows and not waiting:
                    beat.revision = rows[0][-1]
                rows = [row[:-1] for row in rows]
            answers = {tuple(row[:-2]): (row[-2], row[-1]) for row in rows}
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


def _revised(statements: Statements, lease_key: int | None, renewal: LeaseRenewal | None) -> tuple[bool, bool]:
    """Whether the answer of the first statement, and of its waiting twin, ends with the lease's revision: where
    it renews the lease, or points its rows at it (the twin of the latter does too)."""
    leased = lease_key is not None and statements.heartbeat_leased is not None
    return renewal is not None or leased, leased


def _heartbeat_statements(
    holds: list[Hold], statements: Statements, lease_key: int | None
) -> tuple[bool, Statement, Statement]:
    """Whether ``holds`` are renewed by token, and the statement (and its waiting twin) that does it."""
    if lease_key is not None and statements.heartbeat_leased is not None:
        return (True, *statements.heartbeat_leased)
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


# -- the lease -------------------------------------------------------------------


def follows_lease(hold: Hold) -> bool:
    """Whether ``hold``'s row may follow its group's lease (`_sql.leases`) on a table that has leases.

    A mutex's row (fair or not) with a token, held without a minimum hold and
    without ``reclaim_disconnected_after``: an opted-in holder's heartbeat
    writes its session's key into its row at every renewal (a new one after a
    reconnection), and a permit's or a read/write lock's row is taken over by
    statements that judge the row's own heartbeat (`LockKind.follows_lease`).
    """
    lock = hold.lock
    return (
        hold.plain
        and hold.token is not None
        and lock.kind.follows_lease
        and lock.timing.reclaim_disconnected_after is None
        and hold.row_name == lock.lock_name
    )


def lease_within(holds: list[Hold], timeout: float) -> float:
    """How old the lease may be for its renewal to land: the shortest stale threshold of ``holds``, less the
    statement's deadline and a second (`_sql.leases`: a contender's snapshot then always sees the renewal)."""
    return min(hold.lock.timing.stale_threshold for hold in holds) - timeout - 1.0


def own_heartbeat_period(hold: Hold) -> float:
    """How often a row that follows a lease has its own heartbeat renewed all the same: a third of its holder's
    lease (``stale_threshold`` less an interval).

    Its holder trusts it for its lease after the last renewal of the row's
    own heartbeat, not the lease's: a reader that judges the row's own
    heartbeat alone (0.1.0, or a role not granted the leases) then never takes
    it while its holder trusts it, even from a holder frozen meanwhile. Every
    third of the lease, the trust never runs out (nor two thirds of it, which
    is warned of) while heartbeats succeed.
    """
    timing = hold.lock.timing
    return (timing.stale_threshold - timing.heartbeat_interval) / 3


LEASE_FROM = 16
"""The fewest holds of a heartbeat group that follow a lease (`fit`).

Fewer are renewed row by row every interval, exactly as on a table without
leases: a statement renewing a few rows costs the server about what one
renewing the lease does (its cost is the statement's, not the rows'), so a
lease would spare nothing, while it would make each row's own heartbeat, the
heartbeat a 0.1.0 reader and the holder's own trust go by, three times as
old and rarer. From this many on, the rows' work is what the server spends
(tens of microseconds each), and the lease's one row spares most of it.
"""


def facts(hold: Hold) -> Facts:
    """`Facts` of ``hold``: read once, as it is kept (`_state.locks.HeartbeatGroup.add`)."""
    lock = hold.lock
    timing = lock.timing
    period = own_heartbeat_period(hold) if follows_lease(hold) else -1.0
    return timing.operation_timeout, period, timing.stale_threshold, lock.events.quiet


def fit(counts: Mapping[Facts, int], interval: float, timeout: float) -> float | None:
    """How old the lease of holds may be for its renewal to land (`lease_within` of those that follow it), if
    they may follow a lease: at least `LEASE_FROM` of them may (`follows_lease`), its renewal is not refused
    before their next heartbeat, and their own heartbeats (`own_heartbeat_period`) come at least two intervals
    apart. Else None: the lease would only add a statement, and their rows are renewed one by one, as without
    it. ``counts``: how many holds have each `Facts` (a group keeps them as its holds come and go, so a round
    over thousands of holds reads a few entries, not every hold)."""
    following = 0
    shortest = math.inf
    for (_, period, stale, _), count in counts.items():
        if period < 0:
            continue
        if period < 2 * interval:
            return None
        following += count
        shortest = min(shortest, stale)
    within = shortest - timeout - 1.0
    return within if following >= LEASE_FROM and within > 2 * interval else None


def renew_lease(
    holds: list[Hold],
    detach: list[int],
    statements: Statements,
    lease_key: int,
    timeout: float,
    within: float | None = None,
) -> Flow[tuple[int | None, list[int], float]]:
    """Detach the rows of ``detach`` (tokens) from the lease, and renew the lease for ``holds``; ``within``: how
    old it may be for the renewal to land, if the caller knows (`fit`), else `lease_within` of ``holds``.

    Returns the lease's revision (None: it lapsed, or was never made, and
    nothing was renewed), the tokens of ``detach`` whose rows another session
    held locked (not detached: to send again), and when the statement was
    sent. Raises
    `DatabaseError` if the statement failed. Nothing is told here, and no
    hold's trust is extended: a holder trusts each lock from the last renewal
    of its row's own heartbeat (`own_heartbeat_period`), what a reader that
    knows nothing of leases judges. The caller counts the holds renewed, for
    contenders and watchers and as a heartbeat of each to the hooks and the
    metrics, only if the revision is the one it last saw, else renews their
    rows one by one. With rows due, the lease is renewed by their heartbeat's
    statement instead (`heartbeat`'s ``renewal``).
    """
    statement = statements.renew_lease
    assert statement is not None
    if within is None:
        within = lease_within(holds, timeout) if holds else 0.0
    params: dict[str, object] = {"lease_key": lease_key, "detach": detach, "within": within}
    action = f"heartbeat of {len(holds)} locks by their lease"
    reply = yield Execute(statement, params, timeout, action, urgent=True)
    row = reply.row
    if row is None:
        return None, list(detach), reply.sent_at
    return row[0], list(row[1]), reply.sent_at


def end_lease(detach: list[int], statements: Statements, lease_key: int, timeout: float) -> Flow[None]:
    """Delete a lease whose group holds nothing any more, detaching the rows of ``detach`` (tokens) that still
    follow it (`_sql.leases.end`). Raises `DatabaseError` if the statement failed."""
    statement = statements.end_lease
    assert statement is not None
    yield Execute(statement, {"lease_key": lease_key, "detach": detach}, timeout, "end of a lease", urgent=True)


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
