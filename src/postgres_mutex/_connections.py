"""Where a Mutex gets its connections: a dedicated one per flavour, or a user's pool.

dsn mode: one connection for sync calls and one for async calls, each opened
lazily, in autocommit (every lock statement is its own transaction: one round
trip), with ``application_name``, TCP keepalives and a connect timeout unless
the DSN or the PG* environment already sets them. A connection that broke is
dropped and the next operation opens a new one, which is how a Mutex rides
out a PostgreSQL restart.

pool mode: a connection is borrowed for one statement and given back; the
pool is never opened, closed or resized here. Borrowed connections run our
statement in autocommit (restored afterwards), so they work behind pgbouncer
in transaction mode. LISTEN is not possible on
a borrowed connection, so waiters poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

# Connections inherited through fork() belong to the parent: closing them in
# the child would end the parent's session, so they are kept, unused.
_INHERITED: list[object] = []

_ENV_FOR_PARAM = {
    "application_name": "PGAPPNAME",
    "connect_timeout": "PGCONNECT_TIMEOUT",
    "tcp_user_timeout": None,
    "keepalives": None,
    "keepalives_idle": None,
    "keepalives_interval": None,
    "keepalives_count": None,
}


def connect_defaults(dsn: str, *, application_name: str, operation_timeout: float) -> dict[str, Any]:
    """Connection parameters a Mutex adds, only where the DSN and environment are silent.

    The DSN itself is passed to psycopg untouched; these are keyword
    parameters, and any the user set (in the DSN or a PG* variable) wins.
    """
    given = conninfo_to_dict(dsn)
    wanted: dict[str, Any] = {
        # Visible in pg_stat_activity next to the holder's row; libpq caps it at 63 bytes.
        "application_name": application_name.encode()[:63].decode(errors="ignore"),
        # libpq's minimum is 2 s; a dead server must not hang a connect for minutes.
        "connect_timeout": max(2, math.ceil(operation_timeout)),
        # Drop a connection whose sent data stays unacknowledged (a real partition).
        "tcp_user_timeout": int(operation_timeout * 1000),
        # Notice a dead peer on an idle connection (a waiter LISTENing, a holder between heartbeats).
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
    }
    return {
        key: value
        for key, value in wanted.items()
        if key not in given and not ((env := _ENV_FOR_PARAM[key]) and os.environ.get(env))
    }


class SyncConnections:
    """The connection source for sync operations (dedicated or pooled)."""

    def __init__(self, *, dsn: str | None, pool: ConnectionPool[Any] | None, connect_kwargs: dict[str, Any]) -> None:
        self._dsn = dsn
        self._pool = pool
        self.connect_kwargs = connect_kwargs
        self._lock = threading.RLock()
        self._conn: psycopg.Connection[Any] | None = None
        self.listening: set[str] = set()
        """Channels the dedicated connection LISTENs on; emptied whenever it is replaced."""
        self.connected_before = False

    @property
    def can_listen(self) -> bool:
        return self._pool is None

    @contextlib.contextmanager
    def connection(self, timeout: float) -> Iterator[psycopg.Connection[Any]]:
        """A connection for one statement; a broken one is dropped on the way out."""
        if self._pool is not None:
            with self._pool.connection(timeout=timeout) as conn:
                self.connected_before = True
                with _autocommit(conn):
                    yield conn
            return
        with self._lock:
            conn = self._open()
            try:
                yield conn
            finally:
                if conn.closed or conn.broken:
                    self._drop()

    def _open(self) -> psycopg.Connection[Any]:
        if self._conn is not None and (self._conn.closed or self._conn.broken):
            self._drop()
        if self._conn is None:
            assert self._dsn is not None
            self._conn = psycopg.Connection.connect(self._dsn, autocommit=True, **self.connect_kwargs)
            self.listening = set()
            self.connected_before = True
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self.listening = set()
        if conn is not None:
            conn.close()

    def wait_for_notification(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a notification on the dedicated connection."""
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed or conn.broken:
                time.sleep(seconds)
                return
            # Let the generator finish by itself (stop_after): leaving it
            # early would keep it holding the connection's lock.
            for _ in conn.notifies(timeout=seconds, stop_after=1):
                pass

    def close(self) -> None:
        with self._lock:
            self._drop()

    def forget_after_fork(self, connect_kwargs: dict[str, Any]) -> None:
        """In a forked child: the parent's session is not ours to use or to close."""
        if self._conn is not None:
            _INHERITED.append(self._conn)
        self._conn, self.listening, self._lock = None, set(), threading.RLock()
        self.connect_kwargs = connect_kwargs


class AsyncConnections:
    """The connection source for async operations (dedicated or pooled)."""

    def __init__(
        self, *, dsn: str | None, pool: AsyncConnectionPool[Any] | None, connect_kwargs: dict[str, Any]
    ) -> None:
        self._dsn = dsn
        self._pool = pool
        self.connect_kwargs = connect_kwargs
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self.listening: set[str] = set()
        self.connected_before = False

    @property
    def can_listen(self) -> bool:
        return self._pool is None

    @contextlib.asynccontextmanager
    async def connection(self, timeout: float) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if self._pool is not None:
            async with self._pool.connection(timeout=timeout) as conn:
                self.connected_before = True
                async with _autocommit_async(conn):
                    yield conn
            return
        async with self._loop_lock():
            conn = await self._open()
            try:
                yield conn
            finally:
                if conn.closed or conn.broken:
                    await self._drop()

    def _loop_lock(self) -> asyncio.Lock:
        # A connection and a lock belong to one event loop; a Mutex reused
        # under a new loop (a second asyncio.run) starts afresh.
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._lock is None:
            if self._conn is not None:
                # Bound to another loop: close it without awaiting that loop.
                self._conn.pgconn.finish()
            self._conn, self._loop, self._lock, self.listening = None, loop, asyncio.Lock(), set()
        return self._lock

    async def _open(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is not None and (self._conn.closed or self._conn.broken):
            await self._drop()
        if self._conn is None:
            assert self._dsn is not None
            self._conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True, **self.connect_kwargs)
            self.listening = set()
            self.connected_before = True
        return self._conn

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self.listening = set()
        if conn is not None:
            await conn.close()

    async def wait_for_notification(self, seconds: float) -> None:
        async with self._loop_lock():
            conn = self._conn
            if conn is None or conn.closed or conn.broken:
                await asyncio.sleep(seconds)
                return
            async for _ in conn.notifies(timeout=seconds, stop_after=1):
                pass

    async def aclose(self) -> None:
        if self._conn is not None and self._loop is asyncio.get_running_loop():
            await self._drop()

    def forget_after_fork(self, connect_kwargs: dict[str, Any]) -> None:
        if self._conn is not None:
            _INHERITED.append(self._conn)
        self._conn, self._loop, self._lock, self.listening = None, None, None, set()
        self.connect_kwargs = connect_kwargs


@contextlib.contextmanager
def _autocommit(conn: psycopg.Connection[Any]) -> Iterator[None]:
    if conn.autocommit:
        yield
        return
    conn.autocommit = True
    try:
        yield
    finally:
        if not (conn.closed or conn.broken):
            conn.autocommit = False


@contextlib.asynccontextmanager
async def _autocommit_async(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[None]:
    if conn.autocommit:
        yield
        return
    await conn.set_autocommit(True)
    try:
        yield
    finally:
        if not (conn.closed or conn.broken):
            await conn.set_autocommit(False)
