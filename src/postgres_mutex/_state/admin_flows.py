"""The table's flows: create, migrate, inspect, read holders and history, force a release.

What `LockTable` and the command line do, as flows an engine performs; like
the lock flows, they do no I/O and own their retries and deadlines.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

from .. import _sql
from .._base.clock import now
from .._observe.hooks import LockObservation
from .._sql import Names, Statement, Statements, TableShape
from ..errors import DatabaseError, OperationTimeout, SchemaError, phrase
from .failures import CANCELLED, LOCK_NOT_AVAILABLE, PRIVILEGE, SERIALIZATION_FAILURE, UNDEFINED_COLUMN
from .rows import SEPARATOR, row_of, rw_row_name
from .steps import BRIEF_WAIT, Execute, Flow, Pause, Result, Shape

logger = logging.getLogger("postgres_mutex")

T = TypeVar("T")


# -- the table itself ------------------------------------------------------------------

# Errors two sessions creating the same objects at once can get: the loser
# sees the winner's catalog rows once it commits; one more try sees them exist.
_CONCURRENT_CREATE = frozenset({"23505", "42P07", "42710", "42723"})

# Between a forced release's tries: the client's other statements (heartbeats) go first.
_FORCED_RELEASE_PAUSE = 0.02
# The least time a forced release's last try gets: enough for a delete on a
# database that answers, never more than a sliver past the deadline.
_LEAST_TRY = 0.05


def create_table(
    names: Names, timeout: float, *, history: bool = False, history_retention: float | None = None
) -> Flow[bool]:
    """CREATE the lock table (with its token column) IF NOT EXISTS, safe when many instances start at once.

    With ``history``, the history table too. Returns True if the table has a
    token column. A table that already exists is left as it is (see `migrate`
    to add tokens, or the history, to one).
    """
    action = f"creation of table {names.table_name}"
    for attempt in range(1, 4):
        exists, shape = yield from inspect(names, timeout)
        if exists:
            if history:
                yield from create_history(names, timeout, history_retention, exists=shape.history)
            return shape.tokens
        try:
            yield Execute(_sql.create_table(names), {}, timeout, action)
            yield Execute(_sql.create_functions(names), {}, timeout, action)
            if history:
                yield from create_history(names, timeout, history_retention, exists=shape.history)
            return True
        except DatabaseError as exc:
            if exc.sqlstate in _CONCURRENT_CREATE and attempt < 3:
                continue
            if exc.sqlstate == PRIVILEGE:
                raise SchemaError(
                    phrase(
                        "{action} failed: the role may not create it ({detail}). Create the table once "
                        "as a privileged role (see the README's Permissions section), grant this role "
                        "SELECT, INSERT, UPDATE, DELETE on it and USAGE on its sequence, and skip {create_schema()}",
                        action=action,
                        detail=_server_words(exc),
                    ),
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
    _, shape = yield from inspect(names, timeout)
    return shape.tokens


def create_integration_tables(tables: dict[str, str], timeout: float) -> Flow[None]:
    """Each framework integration's table (``{integration: table name}``) unless it exists; safe to race.

    Existence is asked first: ``CREATE TABLE IF NOT EXISTS`` needs CREATE on
    the schema even when the table is there, and a role without it must be
    able to run this where the tables were made.
    """
    for integration, table in tables.items():
        lookup = f"lookup of table {table}"
        for attempt in range(1, 4):
            reply = yield Execute(_sql.integration_table_exists(table), {}, timeout, lookup)
            if reply.row is not None and reply.row[0]:
                break
            try:
                yield Execute(
                    _sql.create_integration_table(integration, table), {}, timeout, f"creation of table {table}"
                )
                break
            except DatabaseError as exc:
                if exc.sqlstate in _CONCURRENT_CREATE and attempt < 3:
                    continue
                if exc.sqlstate == PRIVILEGE:
                    raise SchemaError(
                        phrase(
                            "creation of table {table} failed: the role may not create it ({detail}). Create it "
                            "once as a privileged role with {" + _CREATE_TERMS[integration] + "}, then grant the "
                            "role that uses it {grants} on it (see the README's Permissions section)",
                            table=table,
                            detail=_server_words(exc),
                            grants=_sql.GRANTS[integration],
                        ),
                        sqlstate=exc.sqlstate,
                    ) from exc
                raise


def with_integration_tables(flow: Flow[T], tables: dict[str, str], timeout: float) -> Flow[T]:
    """``flow`` (the lock table's creation or migration), then the integrations' ``tables``."""
    result = yield from flow
    yield from create_integration_tables(tables, timeout)
    return result


_CREATE_TERMS = {
    "celery_beat": "LockTable.create(celery_beat=True)",
    "apscheduler": "LockTable.create(apscheduler=True)",
}
"""The terms naming the call that makes each integration's table (the command line names its flag)."""


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


def inspect(names: Names, timeout: float) -> Flow[tuple[bool, TableShape]]:
    """Whether the table exists, and its shape: a token column, a history, the session columns, semaphores."""
    reply = yield Execute(_sql.inspect_table(names), {}, timeout, f"lookup of table {names.table_name}")
    assert reply.row is not None
    return TableShape.inspected(reply.row)


def migrate(
    names: Names, timeout: float, *, history: bool = False, history_retention: float | None = None
) -> Flow[bool]:
    """Add the token column, its sequence and its unique index, and the session columns, to an existing table;
    idempotent.

    Online: each step is a catalog change that takes the table's lock for an
    instant, and waits at most a short ``lock_timeout`` for it (so it never
    queues behind a long transaction with holders' heartbeats queued behind
    it); a step that could not get the lock is retried until ``timeout``.
    Safe when many instances run it at once. Returns True if anything changed.
    """
    exists, shape = yield from inspect(names, timeout)
    if not exists:
        raise SchemaError(
            phrase(
                "the lock table {table} does not exist: create it with {create_schema()} (it then has tokens already)",
                table=names.table_name,
            )
        )
    give_up_at = now() + max(timeout, 30.0)
    complete = shape.tokens and shape.sessions and shape.semaphores and shape.rwlocks and shape.holds and shape.fair
    if complete:
        history_asked = history and (not shape.history or history_retention is not None)
        room = yield Execute(_sql.pages_have_room(names), {}, timeout, f"lookup of table {names.table_name}")
        if not history_asked and room.row is not None and room.row[0]:
            # Nothing to change in the table: found by reading the catalog, which any role may, not by changes only
            # the owner may make. Its functions, if it was made before them, by a role that may.
            return False if shape.functions_made else (yield from _create_functions(names, timeout, give_up_at))
    for step in _sql.migrate_steps(names):
        yield from _change_schema(step, timeout, f"migration of table {names.table_name}: {step.what}", give_up_at)
    made = False if shape.functions_made else (yield from _create_functions(names, timeout, give_up_at))
    if history:
        yield from create_history(names, timeout, history_retention, exists=shape.history)
    return not complete or made or (history and not shape.history)


def _create_functions(names: Names, timeout: float, give_up_at: float) -> Flow[bool]:
    """Make the table's functions (`_sql.functions`); True if made. A role that may not (no CREATE on the schema)
    is told so, once per migration, and the table is used through its statements, as before them: they decide
    the same, only at more cost to the server."""
    statement = _sql.create_functions(names)
    try:
        yield from _change_schema(
            statement, timeout, f"migration of table {names.table_name}: {statement.what}", give_up_at
        )
    except DatabaseError as exc:  # a SchemaError among them, naming the table's owner: the server's words instead
        if exc.sqlstate != PRIVILEGE:
            raise
        refused = exc.__cause__ if isinstance(exc.__cause__, DatabaseError) else exc
        logger.warning(
            "migration of table %s: its functions could not be made (%s); locks use its statements, which cost "
            "the server more: run the migration as a role that may create in its schema",
            names.table_name,
            _server_words(refused),
        )
        return False
    return True


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
            retry = exc.sqlstate in _CONCURRENT_CREATE or exc.sqlstate == LOCK_NOT_AVAILABLE or exc.transient
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


# -- who holds what ----------------------------------------------------------------------


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
            phrase(
                "the lock table {table} keeps no history: add one with {LockTable.migrate(history=True)}",
                table=names.table_name,
            )
        )
    reply = yield Execute(
        statements.history,
        {
            # A lock's name reads the holds of its every row; a row's own name (a permit's, a reader's), its own.
            "family": None if lock_name is None else lock_name.partition(SEPARATOR)[0],
            "row": lock_name if lock_name is not None and SEPARATOR in lock_name else None,
            "since": since,
            "since_seconds": since_seconds,
            "limit": limit,
        },
        timeout,
        f"read of the history of table {names.table_name}",
    )
    return list(reply.rows)


def force_release(
    names: Names,
    lock_name: str,
    timeout: float,
    *,
    permit: int | None = None,
    writer: bool = False,
    reader: str | None = None,
) -> Flow[tuple[str, float, int | None] | None]:
    """Delete a lock's row whoever holds it; (holder, seconds since its heartbeat, token), or None if free.

    With ``permit``, ``lock_name`` is a semaphore's: the row is that permit's,
    and the release wakes the semaphore's waiters. With ``writer``, or
    ``reader`` (an instance id), it is a read/write lock's: the row is its
    writer's, or that reader's, and the release wakes the lock's waiters.
    A row a fenced transaction holds locked is waited for (`_while_rows_locked`).
    """
    statements: Statements = yield Shape(names, timeout)
    channel = names.channel(lock_name)
    action = f"forced release of lock {lock_name!r}"
    if permit is not None:
        channel = names.channel(lock_name, "semaphore")
        action = f"forced release of permit {permit} of semaphore {lock_name!r}"
        lock_name = f"{lock_name}{SEPARATOR}{permit}"
    elif writer or reader is not None:
        channel = names.channel(lock_name, "read/write lock")
        if writer:
            action = f"forced release of the writer of read/write lock {lock_name!r}"
            lock_name = rw_row_name(lock_name, "", "write")
        else:
            action = f"forced release of reader {reader!r} of read/write lock {lock_name!r}"
            lock_name = rw_row_name(lock_name, reader or "", "read")
    reply = yield from _while_rows_locked(
        statements.force_release,
        {
            "lock_name": lock_name,
            "channel": channel,
            "own_slot": None,
            "ended_how": "force_released",
            "alert_seconds": None,  # the table does not know the holders' thresholds
        },
        timeout,
        action,
        given_up="another session kept the lock's row locked (the holder's fenced transaction, or SELECT ... "
        "FOR UPDATE); nothing was deleted",
    )
    if reply.row is None:
        return None
    holder, age, token, _ = reply.row
    return str(holder), float(age), None if token is None else int(token)


_CHECK_VIOLATION = "23514"


def set_permits(names: Names, semaphore: str, count: int, timeout: float) -> Flow[tuple[int | None, int]]:
    """Change a semaphore's N to ``count`` (`_sql.semaphores.set_permits`); (the previous N or None, holders released).

    Sent again (`_while_rows_locked`) while a row it must change is locked, or
    while a row taken with the old N meanwhile makes the check refuse the change.
    """
    statements: Statements = yield Shape(names, timeout)
    if statements.set_permits is None:
        statements = yield Shape(names, timeout, fresh=True)  # migrated since this client looked?
    if statements.set_permits is None:
        raise SchemaError(
            phrase(
                "the lock table {table} has no semaphores' table and columns: run {LockTable.migrate()} once",
                table=names.table_name,
            )
        )
    action = f"change of the permits of semaphore {semaphore!r}"
    reply = yield from _while_rows_locked(
        statements.set_permits,
        {
            "semaphore": semaphore,
            "permits": count,
            "channel": names.channel(semaphore, "semaphore"),
            "own_slot": None,
            "ended_how": "force_released",
            "alert_seconds": None,
        },
        timeout,
        action,
        given_up="its rows stayed locked by another session (a holder's fenced transaction), or the semaphore "
        "kept being taken with the old number; nothing was changed",
        also=(_CHECK_VIOLATION, SERIALIZATION_FAILURE),
    )
    assert reply.row is not None
    previous, released, _, _ = reply.row
    return (None if previous is None else int(previous)), int(released)


def _while_rows_locked(
    statement: Statement,
    params: dict[str, object],
    timeout: float,
    action: str,
    *,
    given_up: str,
    also: tuple[str, ...] = (),
) -> Flow[Result]:
    """Send ``statement`` again, in brief tries, while a row it must change is locked, until ``timeout``.

    A try waits on the row at most half its time, so the lock wait, not the
    statement's own deadline, is what ends it; between tries the connection is
    free, so the heartbeats of the same client (a holder in this process) go on.
    ``also`` names the other failures worth another try; ``given_up`` says why
    the last one failed.
    """
    deadline = now() + timeout
    while True:
        left = max(deadline - now(), _LEAST_TRY)
        try:
            wait_ms = max(1, int(min(BRIEF_WAIT, left / 2) * 1000))
            result: Result = yield Execute(statement, {**params, "lock_timeout_ms": wait_ms}, left, action)
            return result
        except DatabaseError as exc:
            # CANCELLED too: the server's deadline for the statement can still end
            # a try that waited on the row (a slow server, the last try's sliver).
            if exc.sqlstate not in (LOCK_NOT_AVAILABLE, CANCELLED, *also):
                raise
            if deadline - now() <= 0:
                raise OperationTimeout(
                    f"{action} did not finish within operation_timeout ({timeout:g}s): {given_up}",
                    transient=True,
                    sqlstate=exc.sqlstate,
                ) from exc
            if not (yield Pause(_FORCED_RELEASE_PAUSE)):
                raise DatabaseError(
                    f"{action} stopped: the client was closed while another session held its rows locked; "
                    "nothing was done",
                    transient=False,
                    sqlstate=exc.sqlstate,
                ) from exc


def _server_words(exc: DatabaseError) -> str:
    cause = exc.__cause__
    diag = getattr(cause, "diag", None)
    primary = getattr(diag, "message_primary", None)
    return str(primary) if primary else str(exc)
