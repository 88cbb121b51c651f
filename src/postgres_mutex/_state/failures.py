"""What a database failure means for the lock: transient or not, its outcome known or not, and in what words.

The SQLSTATEs the flows act on are named here, with `classify_failure`, which turns a psycopg failure
into the `DatabaseError` every path acts on. Nothing here does I/O.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import psycopg

from ..errors import DatabaseError, OperationTimeout, SchemaError, phrase

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
UNDEFINED_FUNCTION = "42883"
SHAPE_CHANGED = frozenset({UNDEFINED_TABLE, UNDEFINED_COLUMN, UNDEFINED_FUNCTION})
"""A statement named a table, a column or one of the table's functions (`_sql.functions`) that is not there: the
table changed since it was inspected."""
SERIALIZATION_FAILURE = "40001"
FOREIGN_KEY_VIOLATION = "23503"
UNIQUE_VIOLATION = "23505"
DEADLOCK_DETECTED = "40P01"
RW_LOST_RACE = frozenset({FOREIGN_KEY_VIOLATION, UNIQUE_VIOLATION, DEADLOCK_DETECTED})
"""What ends a read/write lock's attempt that lost a race (`_sql.rwlocks`): the statement was refused whole,
so nothing was written. A deadlock is one of them: a reader removing a dead writer locks its row, then the
gate; a writer taking that row over locks the gate, then the row; the server ends one of the two."""
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
