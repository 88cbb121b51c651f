"""The decisions of the lock, without I/O: shared by the sync and async paths.

What an acquire's result row means, when a contender should alert, and what
a database failure means for the lock are decided here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import psycopg

from .._observe.hooks import LockObservation
from .._sql import SEPARATOR, row_of
from ..errors import DatabaseError, OperationTimeout, SchemaError, phrase
from ..metric_names import RECLAIM_REASONS

if TYPE_CHECKING:
    from .settings import Timing


class Outcome(enum.Enum):
    ACQUIRED = "acquired"
    """No row existed: ours was inserted."""
    RECLAIMED = "reclaimed"
    """Another instance's row was past ``stale_threshold``: we took it over."""
    REACQUIRED = "reacquired"
    """The row already carried our instance_id: we took it back."""
    CONTENDED = "contended"
    """Another instance holds the lock."""

    @property
    def acquired(self) -> bool:
        return self is not Outcome.CONTENDED


@dataclass(frozen=True, slots=True)
class AcquireResult:
    outcome: Outcome
    holder: str | None
    """Contended: the current holder. Reclaimed: the previous holder."""
    heartbeat_age: float | None
    """Seconds since the (previous) holder's last heartbeat, by the server's clock."""
    acquired_at: datetime | None = None
    """When acquired: the new row's ``acquired_at``, which identifies this hold."""
    token: int | None = None
    """When acquired on a table with tokens: this acquisition's fencing token."""
    holder_mode: str | None = None
    """For a read/write lock: the mode of ``holder``'s row (``"read"`` or ``"write"``)."""


def interpret_acquire(row: Sequence[object] | None, instance_id: str) -> AcquireResult:
    """Read the acquire statement's single row: ``(inserted, holder, heartbeat_age, acquired_at, token)``.

    ``inserted`` is NULL when the INSERT neither inserted nor took over the
    row: the lock is held by someone else. ``holder`` and ``heartbeat_age``
    come from the statement's snapshot; they are NULL when the row appeared
    after the snapshot was taken.
    """
    if row is None or len(row) != 5:
        raise ValueError(f"unexpected acquire result {row!r}")
    inserted, holder, age, acquired_at, token = row
    holder_id = None if holder is None else str(holder)
    heartbeat_age = None if age is None else float(age)  # type: ignore[arg-type]
    if inserted is None:
        return AcquireResult(Outcome.CONTENDED, holder_id, heartbeat_age)
    if not isinstance(acquired_at, datetime) or not (token is None or isinstance(token, int)):
        raise ValueError(f"unexpected acquire result {row!r}")
    if inserted:
        # A holder seen in the snapshot released in the meantime: a plain acquire.
        return AcquireResult(Outcome.ACQUIRED, None, None, acquired_at, token)
    if holder_id == instance_id or holder_id is None:
        return AcquireResult(Outcome.REACQUIRED, instance_id, heartbeat_age, acquired_at, token)
    return AcquireResult(Outcome.RECLAIMED, holder_id, heartbeat_age, acquired_at, token)


@dataclass(frozen=True, slots=True)
class PermitReply:
    """What a semaphore's acquire statement (`_sql.permits.acquire_permit`) said."""

    result: AcquireResult
    row_name: str | None
    """The ``lock_name`` of the permit row won (None if none was)."""
    stored_permits: int | None
    """The semaphore's N in the table: None if another session was declaring it at that moment."""
    held: int
    """How many permits were held in the statement's snapshot."""

    def retry_at_once(self, permits: int | None) -> bool:
        """Nothing won, yet there is reason to try again without waiting: the semaphore was being declared, or
        another contender won the free permit this one chose while others were free."""
        if permits is None or self.result.outcome.acquired:
            return False
        return self.stored_permits is None or (self.stored_permits == permits and self.held < permits - 1)


def read_acquire(
    row: Sequence[object] | None, instance_id: str, permits: int | None, *, wide: bool = False
) -> PermitReply:
    """Read a mutex's acquire row (`interpret_acquire`) or, with ``permits`` (or ``wide``: a read/write lock's), the
    same five columns, then the row's ``lock_name``, the stored N (for a read/write lock: 1 to try again at once)
    and how many rows were held; a read/write lock's, then the mode of the holder shown."""
    if permits is None and not wide:
        return PermitReply(interpret_acquire(row, instance_id), None, None, 0)
    if row is None or len(row) != (9 if wide else 8):
        raise ValueError(f"unexpected acquire result {row!r}")
    result = interpret_acquire(row[:5], instance_id)
    if wide and isinstance(row[8], str):
        result = dataclasses.replace(result, holder_mode=row[8])
    row_name, stored, held = row[5:8]
    if result.outcome.acquired and not isinstance(row_name, str):
        raise ValueError(f"unexpected acquire result {row!r}")
    return PermitReply(
        result,
        row_name if isinstance(row_name, str) else None,
        None if stored is None else int(stored),  # type: ignore[call-overload]
        int(held),  # type: ignore[call-overload]
    )


STALE, DISCONNECTED = RECLAIM_REASONS
"""Why a row was taken over from another instance: silent past ``stale_threshold``; or its holder opted in
to ``reclaim_disconnected_after``, its database session had ended and its heartbeat was older than that."""


def reclaim_reason(result: AcquireResult, stale_threshold: float) -> str:
    """Why ``result`` (a reclaim) took the row: a heartbeat younger than ``stale_threshold`` in the statement's
    snapshot can only have been reclaimed for a disconnected session (a row only gets younger meanwhile)."""
    age = result.heartbeat_age
    return DISCONNECTED if age is not None and age < stale_threshold else STALE


class AlertGate:
    """Decides when a silent holder is worth an alert: once per stale episode.

    An episode starts when a holder's heartbeat age reaches ``threshold`` and
    ends when it heartbeats again (age below threshold) or the holder changes,
    so a waiter polling every half second alerts once, not twice a second.
    """

    def __init__(self, threshold: float) -> None:
        self._threshold = threshold
        self._alerted_holder: str | None = None
        # Shared by a Mutex's contender path and its watcher.
        self._lock = threading.Lock()

    def should_alert(self, holder: str | None, heartbeat_age: float | None) -> bool:
        with self._lock:
            if holder is None or heartbeat_age is None or heartbeat_age < self._threshold:
                self._alerted_holder = None
                return False
            if holder == self._alerted_holder:
                return False
            self._alerted_holder = holder
            return True


class WatchAlerts:
    """One `AlertGate` per watched lock; a lock that turns free starts afresh.

    A Mutex that watches its own lock shares its gate, so a contender's alert
    and the watcher's count as one per episode.
    """

    def __init__(self, threshold: float, shared: dict[str, AlertGate] | None = None) -> None:
        self._threshold = threshold
        self._shared = dict(shared or {})
        self._gates: dict[str, AlertGate] = dict(self._shared)

    def should_alert(self, lock_name: str, holder: str, heartbeat_age: float) -> bool:
        gate = self._gates.get(lock_name)
        if gate is None:
            gate = self._gates[lock_name] = AlertGate(self._threshold)
        return gate.should_alert(holder, heartbeat_age)

    def held_now(self, lock_names: set[str]) -> None:
        """Forget the episodes of locks that are no longer held."""
        for name in list(self._gates):
            if name not in lock_names:
                if name in self._shared:
                    self._gates[name].should_alert(None, None)
                else:
                    del self._gates[name]


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


# A read-only transaction: after a failover the connection may have landed on
# a standby. Only a new connection can reach the new primary.
READ_ONLY = "25006"
# The server cancelled the statement: our own per-statement statement_timeout,
# or an administrator's pg_cancel_backend. Rolled back either way.
CANCELLED = "57014"
# The role may not do what the statement needs.
PRIVILEGE = "42501"
UNDEFINED_COLUMN = "42703"
UNDEFINED_TABLE = "42P01"
SHAPE_CHANGED = frozenset({UNDEFINED_TABLE, UNDEFINED_COLUMN})
"""A statement named a table or column that is not there: the table changed since it was inspected."""
SERIALIZATION_FAILURE = "40001"
FOREIGN_KEY_VIOLATION = "23503"
UNIQUE_VIOLATION = "23505"
DEADLOCK_DETECTED = "40P01"
RW_LOST_RACE = frozenset({FOREIGN_KEY_VIOLATION, UNIQUE_VIOLATION, DEADLOCK_DETECTED})
"""What ends a read/write lock's attempt that lost a race (`_sql.rwlocks`): the statement was refused whole,
so nothing was written. A deadlock is one of them: a reader removing a dead writer locks its row, then the
gate; a writer taking that row over locks the gate, then the row; the server ends one of the two."""
"""A permit row named its semaphore with a number of permits that an administrator changed meanwhile."""
LOCK_NOT_AVAILABLE = "55P03"
"""A row lock not had within ``lock_timeout``: another session holds the row locked."""

# SQLSTATE classes that describe the moment, not the statement: connection
# exceptions, insufficient resources, operator intervention (shutdown,
# restart, cancel), transaction rollback.
_TRANSIENT_CLASSES = frozenset({"08", "53", "57", "40"})
_TRANSIENT_STATES = frozenset({LOCK_NOT_AVAILABLE, "58000", "58030", READ_ONLY})
_MISSING_TABLE_STATES = frozenset({"42P01", "3F000"})


def classify_failure(
    exc: BaseException,
    *,
    action: str,
    table: str,
    sent: bool,
    timed_out: bool,
    connection_lost: bool,
    connect_retryable: bool,
    redact: Callable[[str], str],
    timeout: float | None = None,
) -> DatabaseError:
    """Turn a psycopg failure into the `DatabaseError` the lock logic acts on.

    ``sent``: the statement may have reached the server. ``timed_out``: the
    client's own deadline (``timeout`` seconds) cut the operation off.
    ``connection_lost``: the connection is no longer usable.
    ``connect_retryable``: a failure to connect is worth retrying (this client
    has connected before, so the DSN and credentials work). ``redact`` masks
    secrets in the message.
    """
    # The server's primary message, on one line: no SQL excerpt, no caret.
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    detail = redact(" ".join(str(primary or exc).split()) or type(exc).__name__)
    if "failed to resolve host None" in detail and os.environ.get("PGHOST"):
        # psycopg names a host it was given by PGHOST, not by the DSN, as None.
        detail = detail.replace("host None", f"host {os.environ['PGHOST']!r} (from PGHOST)", 1)
    sqlstate = getattr(exc, "sqlstate", None) if isinstance(exc, psycopg.Error) else None
    # The server answered with an error and the connection survived: the
    # statement was rolled back, so its outcome is known.
    unknown = sent and (timed_out or connection_lost or sqlstate is None)
    within = "" if timeout is None else f" ({timeout:g}s)"
    said = {"action": action, "within": within, "detail": detail}

    error: DatabaseError
    if type(exc).__module__ == "psycopg_pool" and type(exc).__name__ == "PoolClosed":
        # The application closed its pool: nothing to wait out.
        error = DatabaseError(f"{action} failed: the connection pool is closed ({detail})", transient=False)
    elif type(exc).__module__ == "psycopg_pool":
        # No pooled connection in time (PoolTimeout, TooManyRequests): a busy pool, not a bad DSN.
        error = DatabaseError(f"{action} failed: no pooled connection available ({detail})", transient=True)
    elif timed_out:
        # The client cut its own statement off: libpq's words ("server closed
        # the connection unexpectedly") would blame the server.
        error = OperationTimeout(
            phrase("{action} got no reply within {operation_timeout}{within}; the connection was closed", **said),
            transient=True,
            outcome_unknown=unknown,
        )
    elif sqlstate == CANCELLED:
        error = OperationTimeout(
            phrase(
                "{action} did not finish within {operation_timeout}{within} on the server and was cancelled "
                "there ({detail}); something held the lock row",
                **said,
            ),
            transient=True,
            sqlstate=sqlstate,
        )
    elif sqlstate in _MISSING_TABLE_STATES:
        error = SchemaError(
            phrase(
                "{action} failed: the lock table {table} does not exist ({detail}); "
                "{call create_schema()} or create it as the README shows",
                **said,
                table=table,
            ),
            sqlstate=sqlstate,
        )
    elif sqlstate == PRIVILEGE:
        error = SchemaError(f"{action} failed: {_privilege_needed(table, detail)}", sqlstate=sqlstate)
    elif not sent and sqlstate is None:
        error = DatabaseError(
            f"{action} failed: could not connect to PostgreSQL ({detail})",
            transient=connect_retryable,
        )
    else:
        transient = (
            connection_lost or sqlstate is None or sqlstate[:2] in _TRANSIENT_CLASSES or sqlstate in _TRANSIENT_STATES
        )
        error = DatabaseError(
            f"{action} failed: {detail}", transient=transient, outcome_unknown=unknown, sqlstate=sqlstate
        )
    return error


_REFUSED = re.compile(r"permission denied for (table|sequence|schema) (\S+)")
_GRANTS = {
    "_history": "SELECT, INSERT, UPDATE, DELETE",
    "_semaphores": "SELECT, INSERT (and UPDATE, to change a semaphore's permits)",
    "_rwlocks": "SELECT, INSERT, UPDATE",
}
"""The privileges the README grants on each of the lock table's companions, by their suffix."""


def _privilege_needed(table: str, detail: str) -> str:
    """What the server refused, by the name it gave (the lock table, a companion, the sequence, the schema), and the
    grant that the README's Permissions section gives on it."""
    refused = _REFUSED.search(detail)
    schema, _, base = table.rpartition(".")
    if refused is not None:
        kind, name = refused.group(1), refused.group(2).strip('"')
        if kind == "schema":
            return f"the role may not use schema {name} ({detail}); grant USAGE on schema {name}"
        qualified = f"{schema}.{name}" if schema else name
        if kind == "sequence":
            return f"the role may not use sequence {qualified} ({detail}); grant USAGE on it, as the README shows"
        suffix = name[len(base) :] if name.startswith(base) else None
        if suffix:  # a companion of the lock table (the lock table itself is said below)
            grant = _GRANTS.get(suffix)
            if grant is not None:
                return f"the role may not use table {qualified} ({detail}); grant {grant} on it, as the README shows"
    return (
        f"the role may not use the lock table {table} ({detail}); grant SELECT, INSERT, UPDATE, DELETE on it "
        "(and USAGE on its token sequence, if it has one) as the README shows"
    )


def rw_row_name(lock_name: str, instance_id: str, mode: str) -> str:
    """The ``lock_name`` of a read/write lock's row (`_sql.rwlocks`): one writer's, or each reader's own.

    A reader's carries a digest of its instance id: distinct per holder, and short enough to fit.
    """
    if mode == "write":
        return f"{lock_name}{SEPARATOR}w"
    return f"{lock_name}{SEPARATOR}r{hashlib.sha256(instance_id.encode()).hexdigest()[:12]}"


def writer_claim_seconds(timing: Timing) -> float:
    """How long a waiting writer's claim keeps new readers out without being renewed.

    A blocking writer renews it at every attempt, at least every ``poll_interval``; an attempt may take
    up to ``operation_timeout``. Twice the one plus the other leaves room for one late attempt.
    """
    return 2 * timing.poll_interval + timing.operation_timeout
