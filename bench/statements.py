"""The library's own acquire and release statements, sent raw with plain psycopg.

The texts come from `postgres_mutex._sql.Statements` for the bench's table in
its current shape (with fencing tokens, as `create_schema` makes it). The
*bare* form is the statement alone, as an application would write it, and as
the library sends it on a connection of its own that reaches PostgreSQL
directly (prepared on its first use there). Behind a pooler, or on a pool's
connections, the library sends the *prefixed* form instead: ``SET LOCAL
statement_timeout ...; SET LOCAL transaction_isolation ...;`` then the
statement, with `psycopg.ClientCursor` (simple query protocol, parameters
bound on the client), never prepared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from postgres_mutex._sql import CURRENT, Names, Statements

SERVER_TIMEOUT_MS = 4500
"""What the library binds as ``statement_timeout`` for the default operation timeout (5 s x 0.9)."""

STALE_SECONDS = 600.0
"""The default stale_threshold, bound as the library binds it."""


@dataclass(frozen=True)
class LibraryStatements:
    acquire_prefixed: str
    release_prefixed: str
    acquire: str
    release: str
    channel: str


def library_statements(table: str, lock_name: str) -> LibraryStatements:
    names = Names(table)
    # The table as `LockTable.create` makes it, with the functions of the common acquire and release.
    statements = Statements(names, dataclasses.replace(CURRENT, functions=True))
    # What a Mutex without a minimum hold or reclaim_disconnected_after sends: the plain pair.
    sent_acquire = statements.acquire_plain or statements.acquire
    sent_release = statements.release_plain or statements.release
    acquire, release = sent_acquire.bare, sent_release.bare
    if acquire is None or release is None:
        raise RuntimeError("the library's acquire and release are no longer preparable statements")
    return LibraryStatements(sent_acquire.text, sent_release.text, acquire, release, names.channel(lock_name))


def params(texts: LibraryStatements, lock_name: str, instance_id: str, *, prefixed: bool) -> dict[str, Any]:
    """The parameters the library binds for acquire and release (``acquired_at`` comes from the acquire)."""
    bound: dict[str, Any] = {
        "lock_name": lock_name,
        "instance_id": instance_id,
        "stale_seconds": STALE_SECONDS,
        "channel": texts.channel,
        "own_slot": None,
        # As the library binds them for a Mutex without reclaim_disconnected_after.
        "reclaim_seconds": None,
        "_session_key": None,
        "_backend_pid": 0,
        "hold_seconds": None,  # and without a minimum hold
    }
    if prefixed:
        bound["_server_timeout_ms"] = SERVER_TIMEOUT_MS
    return bound


class RawCycle:
    """acquire + release of one lock as two raw statements on one autocommit connection.

    ``prefixed``: the library's exact text, on a `psycopg.ClientCursor`, every
    result set read as the library reads them. Otherwise the bare statements
    on a plain cursor: ``prepare=None`` is psycopg's default (prepared on the
    server after a few executions), ``prepare=False`` never prepares.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        table: str,
        lock_name: str,
        *,
        prefixed: bool,
        prepare: bool | None = None,
    ) -> None:
        self._conn = conn
        self._texts = library_statements(table, lock_name)
        self._prefixed = prefixed
        self._prepare = prepare
        self._params = params(self._texts, lock_name, f"{lock_name}-instance", prefixed=prefixed)

    def __call__(self) -> None:
        acquired_at = self.acquire()
        if acquired_at is None:
            raise RuntimeError("the raw acquire did not acquire")
        self.release(acquired_at)

    def acquire(self) -> datetime | None:
        """The acquire statement; the hold's ``acquired_at`` if it acquired, else None."""
        if self._prefixed:
            row = client_statement(self._conn, self._texts.acquire_prefixed, self._params)
        else:
            row = self._conn.execute(self._texts.acquire, self._params, prepare=self._prepare).fetchone()
        if row is None or not row[0]:
            return None
        acquired_at: datetime = row[3]
        return acquired_at

    def release(self, acquired_at: datetime) -> None:
        bound = {**self._params, "acquired_at": acquired_at}
        if self._prefixed:
            row = client_statement(self._conn, self._texts.release_prefixed, bound)
        else:
            row = self._conn.execute(self._texts.release, bound, prepare=self._prepare).fetchone()
        # The release's result has one row (its pg_notify) per row deleted.
        if row is None:
            raise RuntimeError("the raw release deleted nothing")


def client_statement(conn: psycopg.Connection[Any], text: str, bound: dict[str, Any]) -> tuple[Any, ...] | None:
    """As the library sends a statement: client-side binding, one message; the first row of the last result."""
    cursor = psycopg.ClientCursor(conn)
    cursor.execute(text, bound)
    while cursor.nextset():
        pass
    rows = cursor.fetchall() if cursor.description else []
    return tuple(rows[0]) if rows else None


class AsyncRawCycle:
    """`RawCycle` on an `AsyncConnection`: the async cycle's baseline."""

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        table: str,
        lock_name: str,
        *,
        prefixed: bool,
        prepare: bool | None = None,
    ) -> None:
        self._conn = conn
        self._texts = library_statements(table, lock_name)
        self._prefixed = prefixed
        self._prepare = prepare
        self._params = params(self._texts, lock_name, f"{lock_name}-instance", prefixed=prefixed)

    async def __call__(self) -> None:
        if self._prefixed:
            row = await _aclient_statement(self._conn, self._texts.acquire_prefixed, self._params)
        else:
            cursor = await self._conn.execute(self._texts.acquire, self._params, prepare=self._prepare)
            row = await cursor.fetchone()
        if row is None or not row[0]:
            raise RuntimeError(f"the raw acquire did not acquire: {row}")
        bound = {**self._params, "acquired_at": row[3]}
        if self._prefixed:
            row = await _aclient_statement(self._conn, self._texts.release_prefixed, bound)
        else:
            row = await (await self._conn.execute(self._texts.release, bound, prepare=self._prepare)).fetchone()
        if row is None:
            raise RuntimeError("the raw release deleted nothing")


async def _aclient_statement(
    conn: psycopg.AsyncConnection[Any], text: str, bound: dict[str, Any]
) -> tuple[Any, ...] | None:
    cursor = psycopg.AsyncClientCursor(conn)
    await cursor.execute(text, bound)
    while cursor.nextset():
        pass
    rows = await cursor.fetchall() if cursor.description else []
    return tuple(rows[0]) if rows else None


def insert_delete(table: str) -> tuple[sql.Composed, sql.Composed]:
    """A plain INSERT of a lock row and its DELETE: the floor under any row lock on the table."""
    ident = sql.Identifier(table)
    insert = sql.SQL(
        "INSERT INTO {} (lock_name, instance_id, last_heartbeat, acquired_at) VALUES (%s, %s, now(), now())"
    ).format(ident)
    delete = sql.SQL("DELETE FROM {} WHERE locked = 1 AND lock_name = %s").format(ident)
    return insert, delete
