"""The decisions of the lock, without I/O: shared by the sync and async paths.

What an acquire's result row means (`_state.outcome`), when a contender should alert
(`_state.alerts`) and what a database failure means for the lock (`_state.failures`) are decided
there and nowhere else, and this module names them all, for the engine and the watcher; what the
holders query's rows say (`observe`, with the query's flow, `holders`) is decided here. The flows
import each from its own module, so that the lock's state needs none of the statements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING

from .._observe.hooks import LockObservation
from .alerts import AlertGate, WatchAlerts
from .failures import (
    CANCELLED,
    LOCK_NOT_AVAILABLE,
    PRIVILEGE,
    READ_ONLY,
    SERIALIZATION_FAILURE,
    SHAPE_CHANGED,
    UNDEFINED_COLUMN,
    classify_failure,
)
from .outcome import AcquireResult, Outcome, PermitReply, interpret_acquire, read_acquire
from .rows import row_of, rw_row_name
from .steps import Execute, Flow, Shape

if TYPE_CHECKING:
    from .._sql import Names, Statements

__all__ = [
    "CANCELLED",
    "LOCK_NOT_AVAILABLE",
    "PRIVILEGE",
    "READ_ONLY",
    "SERIALIZATION_FAILURE",
    "SHAPE_CHANGED",
    "UNDEFINED_COLUMN",
    "AcquireResult",
    "AlertGate",
    "Outcome",
    "PermitReply",
    "WatchAlerts",
    "classify_failure",
    "holders",
    "interpret_acquire",
    "observe",
    "read_acquire",
    "rw_row_name",
]


def holders(
    names: Names,
    lock_names: frozenset[str] | None,
    timeout: float,
    *,
    alert_threshold: float,
    stale_threshold: float,
) -> Flow[list[LockObservation]]:
    """Every held lock (or those named) with its holder and ages by the server's clock: one query."""
    statements: Statements = yield Shape(names, timeout)
    reply = yield Execute(
        statements.holders,
        {"lock_names": None if lock_names is None else sorted(lock_names)},
        timeout,
        f"read of the lock table {names.table_name}",
    )
    seen = observe(reply.rows, alert_threshold=alert_threshold, stale_threshold=stale_threshold)
    rwlocks = sorted({held.rwlock for held in seen if held.rwlock is not None})
    if not rwlocks or statements.writers_waiting is None:
        return seen
    gates = yield Execute(
        statements.writers_waiting, {"rwlocks": rwlocks}, timeout, f"read of the lock table {names.table_name}"
    )
    waiting = {str(row[0]) for row in gates.rows}
    return [held if held.rwlock is None else replace(held, writer_waiting=held.rwlock in waiting) for held in seen]


def observe(
    rows: Sequence[Sequence[object]], *, alert_threshold: float, stale_threshold: float
) -> list[LockObservation]:
    """Turn the holders query's rows into observations, with the thresholds applied."""
    observations = []
    for lock_name, holder, age, held_for, _acquired_at, token, session_alive, reclaim_after, *more in rows:
        writer_waits, held_until = (*more, None)[:2]
        heartbeat_age = float(age)  # type: ignore[arg-type]
        seconds_held = float(held_for)  # type: ignore[arg-type]
        if isinstance(held_until, datetime):
            # Released before its minimum hold ended: nobody heartbeats it, and it is no longer held for
            # anything (its row's stamps are the minimum's end). Not silent, not reclaimable: kept.
            heartbeat_age = seconds_held = 0.0
        after = None if reclaim_after is None else float(reclaim_after)  # type: ignore[arg-type]
        disconnected = session_alive is False and after is not None and heartbeat_age >= after
        row = row_of(str(lock_name))  # a permit's, or a read/write lock's holder's
        observations.append(
            LockObservation(
                lock_name=str(lock_name),
                holder=str(holder),
                seconds_since_heartbeat=heartbeat_age,
                seconds_held=seconds_held,
                alerting=heartbeat_age >= alert_threshold,
                reclaimable=heartbeat_age >= stale_threshold or disconnected,
                token=None if token is None else int(token),  # type: ignore[call-overload]
                session_alive=None if session_alive is None else bool(session_alive),
                reclaim_disconnected_after=after,
                semaphore=row.semaphore,
                permit=row.permit,
                rwlock=row.rwlock,
                mode=row.mode,
                writer_waiting=None if row.mode is None or writer_waits is None else bool(writer_waits),
                held_until=held_until if isinstance(held_until, datetime) else None,
            )
        )
    return observations
