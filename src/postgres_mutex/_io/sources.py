# Generated from sources_async.py by tools/async_to_sync.py: do not edit.
# Change the async module and run `python tools/async_to_sync.py`.
"""Where an engine's statements get a connection: its own (dsn mode) or a pool's.

In dsn mode the engine opens its statement connection on first use, checks
one that sat idle before using it (the server may have closed it), and
replaces one that broke or whose statement was cut off. In pool mode it
borrows one pooled connection per statement and gives it back, or discards
it when it broke.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .._base.clock import now
from .._base.connections import BAD, FAILURES, IDLE, ServerSession, closed_while_idle, discard, unusable
from .._base.watchdog import Cutter
from .._sql.statement import end_session_left_behind

if TYPE_CHECKING:
    from collections.abc import Iterator

    from psycopg_pool import ConnectionPool

logger = logging.getLogger("postgres_mutex")

# A connection idle for longer than this is checked before use: did the server close it?
_IDLE_CHECK = 0.5


class _CutSessions:
    """The server processes of connections cut off mid-statement, ended before the next statement is sent.

    A statement given up on (cut at its deadline, or by an exception raised
    into it) may sit unread on the server, which runs it whenever it reads it:
    its ``statement_timeout`` counts only from then. An acquire read after
    the next acquire of the same holder would take that hold's row over (it
    carries the same ``instance_id``); one read after the background deleted
    what it may have left would leave a row nobody heartbeats. So the next
    connection ends that process first (`_sql.end_session_left_behind`): once
    it has ended, nothing it was sent can run. Only on a direct connection:
    behind a pooler the statement lands or not, and a row it takes over is a
    hold reported lost at its release, never a second holder.
    """

    __slots__ = ("_left",)

    def __init__(self) -> None:
        self._left: list[tuple[int, float]] = []

    def note(self, backend_pid: int) -> None:
        """A statement of the connection given ``backend_pid`` was cut off. (Read at connect: libpq
        forgets it once the connection failed.)"""
        self._left.append((backend_pid, now()))

    def end(self, conn: psycopg.Connection[Any], cutter: Cutter, timeout: float) -> None:
        """End those processes from ``conn``, within ``timeout``; failing to (a missing privilege) is no error."""
        # Each is forgotten only once ended (or found not ours to end): an exception raised
        # into this (a signal handler's) leaves the rest to the next connection. All of them
        # within one ``timeout``: the connection's turn allows this one bound (see `Gate`).
        deadline = now() + timeout
        while self._left and (left := deadline - now()) > 0:
            entry = self._left[0]
            pid, cut_at = entry
            ticket = cutter.arm(left)
            try:
                conn.execute(
                    end_session_left_behind(pid, conn.info.backend_pid, now() - cut_at, max(1, int(left * 500)))
                )
                self._forget(entry)
            except FAILURES as exc:
                if cutter.fired or unusable(conn):
                    raise
                self._forget(entry)
                logger.debug("could not end the server process %s of a connection cut off mid-statement: %s", pid, exc)
            finally:
                cutter.disarm(ticket)

    def _forget(self, entry: tuple[int, float]) -> None:
        # Not contextlib.suppress: its Python frames are where a signal's exception could land.
        try:  # noqa: SIM105
            self._left.remove(entry)
        except ValueError:
            pass  # forgotten meanwhile by another connection's clean-up


class OwnConnection:
    """The engine's own statement connection, opened on first use and replaced when it breaks."""

    def __init__(self, dsn: str, connect_kwargs: dict[str, Any]) -> None:
        self._dsn = dsn
        self._kwargs = connect_kwargs
        self._longest_connect = _longest_connect(dsn, connect_kwargs)
        self._conn: psycopg.Connection[Any] | None = None
        self._cutter: Cutter | None = None
        self._used_at = 0.0
        self._replace = False
        self.timeout = 0.0
        """The bound of the statement about to enter (``with`` the source itself), set by the engine."""
        self.asked_at = 0.0
        """When that statement asked for the connection, set with ``timeout``."""
        self._connect_failed: tuple[float, BaseException] | None = None
        """When the last connect failed, and how (None once one succeeds)."""
        self._in_use: tuple[psycopg.Connection[Any], Cutter]
        self._backend_pid = 0
        self._cut_sessions = _CutSessions()
        self.connected_before = False
        self.session: ServerSession | None = None
        """The session of the connection in use (None before the first connect)."""
        self.cursor: psycopg.RawCursor[Any] | None = None
        """The connection's cursor for its prepared statements: reused, since making one
        per statement is a measurable share of a lock cycle."""

    def replace(self) -> None:
        """Drop the connection in use once the statement is over."""
        self._replace = True

    # The connection for one statement, as an ``with`` block on the source itself, its
    # ``timeout`` and ``asked_at`` set first (no call per statement to make a block): dropped after it
    # if it broke. The gate lets one statement at a time in. A statement that asked (at
    # ``asked_at``) while another was connecting, and saw that connect fail, fails with it rather
    # than wait out a second one: its bound stays one connect, however many statements queue behind.

    def __enter__(self) -> tuple[psycopg.Connection[Any], Cutter]:
        conn, cutter = self._conn, self._cutter
        if conn is None or cutter is None or now() - self._used_at > _IDLE_CHECK:
            conn, cutter = self._open(self.timeout)
        self._replace = False
        self._in_use = conn, cutter
        return conn, cutter

    def __exit__(self, *exc_info: object) -> None:
        conn, cutter = self._in_use
        self._used_at = now()
        if cutter.fired:
            self._cut_sessions.note(self._backend_pid)
        # `unusable`, inline: read after every statement.
        pgconn = conn.pgconn
        if (
            cutter.fired
            or self._replace
            or pgconn.status == BAD
            or pgconn.transaction_status != IDLE
            or (self.session is not None and self.session.retired)
        ):
            self._drop()

    def _open(self, timeout: float) -> tuple[psycopg.Connection[Any], Cutter]:
        # A connection used a moment ago was not closed for idling; one that sat
        # idle may have been (idle_session_timeout, a restart, a proxy).
        if self._conn is not None and now() - self._used_at > _IDLE_CHECK and closed_while_idle(self._conn):
            logger.debug("the server closed the library's idle connection; opening a new one")
            self._drop()
        if self._conn is None or self._cutter is None:
            failed = self._connect_failed
            if failed is not None and failed[0] >= self.asked_at:
                raise failed[1]
            try:
                conn = psycopg.Connection.connect(
                    self._dsn, autocommit=True, **{**self._kwargs, **_connect_within(self._longest_connect, timeout)}
                )
            except FAILURES as exc:
                self._connect_failed = now(), exc
                raise
            self._connect_failed = None
            self._conn, self._cutter = conn, Cutter(conn.fileno())
            self._backend_pid = conn.info.backend_pid
            self.session = ServerSession(self._backend_pid)
            self.cursor = psycopg.RawCursor(conn)
            self.connected_before = True
            try:
                self._cut_sessions.end(conn, self._cutter, timeout)
            except BaseException:
                self._drop()
                raise
        return self._conn, self._cutter

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        cutter, self._cutter = self._cutter, None
        self.cursor = None
        if cutter is not None:
            cutter.close()
        if conn is not None:
            discard(conn)

    def close(self) -> None:
        self._drop()

    def abandon(self) -> None:
        self._drop()


def _longest_connect(dsn: str, kwargs: dict[str, Any]) -> float:
    """The longest a connect may wait as the user configured it (the library's default if silent).

    libpq reads ``connect_timeout`` from the keywords, then the DSN, then
    ``PGCONNECT_TIMEOUT``; zero or none means no limit.
    """
    given = kwargs.get("connect_timeout") or conninfo_to_dict(dsn).get("connect_timeout")
    given = given or os.environ.get("PGCONNECT_TIMEOUT")
    try:
        seconds = float(given) if given else 0.0
    except ValueError:
        return math.inf  # libpq rejects it at connect, in its own words
    return seconds if seconds > 0 else math.inf


def _connect_within(longest: float, timeout: float) -> dict[str, Any]:
    """A connect made for a statement waits no longer than that statement may (libpq's floor: 2 s).

    The user's ``connect_timeout`` bounds it too, but a longer one (or none)
    must not hold an acquire past its deadline.
    """
    return {"connect_timeout": max(2, math.ceil(min(timeout, longest)))}


class PooledConnection:
    """A connection borrowed from the user's pool for one statement, handed back as it was found."""

    session = None
    """The pool's connections belong to the application: the library sets nothing on their sessions."""
    cursor = None

    def __init__(self, pool: ConnectionPool[Any]) -> None:
        self._pool = pool
        self._replace = False
        self._cut_sessions = _CutSessions()
        self.connected_before = False
        self.timeout = 0.0
        """The bound of the statement about to enter (``with`` the source itself), set by the engine."""
        self.asked_at = 0.0
        """When it asked: the own connection's concern (the pool connects on its own schedule)."""
        self._borrowed: contextlib.AbstractContextManager[tuple[psycopg.Connection[Any], Cutter]] | None = None

    def replace(self) -> None:
        """Hand the connection in use back closed, so the pool replaces it."""
        self._replace = True

    def __enter__(self) -> tuple[psycopg.Connection[Any], Cutter]:
        """A pooled connection for one statement (of ``timeout``), as the own connection is entered."""
        self._borrowed = self._borrow(self.timeout)
        return self._borrowed.__enter__()

    def __exit__(self, *exc_info: Any) -> bool | None:
        borrowed, self._borrowed = self._borrowed, None
        assert borrowed is not None
        return borrowed.__exit__(*exc_info)

    @contextlib.contextmanager
    def _borrow(self, timeout: float) -> Iterator[tuple[psycopg.Connection[Any], Cutter]]:
        with self._pool.connection(timeout=timeout) as conn:
            self.connected_before = True
            cutter = Cutter(conn.fileno())
            backend_pid = conn.info.backend_pid
            autocommit = conn.autocommit
            self._replace = False
            try:
                if not autocommit:
                    conn.set_autocommit(True)
                self._cut_sessions.end(conn, cutter, timeout)
                yield conn, cutter
            finally:
                if cutter.fired:
                    self._cut_sessions.note(backend_pid)
                cutter.close()
                if cutter.fired or self._replace or unusable(conn):
                    # The pool must not hand it out again: it sees it closed and replaces it.
                    discard(conn)
                elif not autocommit:
                    conn.set_autocommit(False)

    def close(self) -> None:
        """The pool belongs to the application: nothing to close."""

    def abandon(self) -> None:
        pass
