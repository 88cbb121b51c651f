"""The I/O shells that carry out a flow's steps: one sync, one async.

They are deliberately thin and parallel: each step (`Execute`, `Pause`,
`WaitForRelease`) maps to a handful of psycopg calls, and what the results
mean is decided by the flow (`_flows`), never here. Every statement runs
under a `Deadline`, so a silent network cannot hold it past its timeout.

Statements are never prepared: an unnamed statement is parsed, bound and
executed in one round trip, always (psycopg would otherwise spend an extra
round trip preparing it on its sixth use), and works behind pgbouncer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from ._connections import AsyncConnections, SyncConnections
from ._flows import CleanupSuperseded, Execute, Flow, Op, Pause, Result, StopListening, WaitForRelease
from ._rules import READ_ONLY, classify_failure
from ._watchdog import Deadline
from .errors import DatabaseError

logger = logging.getLogger("postgres_mutex")

T = TypeVar("T")

# What a failing psycopg call can raise: its own errors (pool errors derive
# from them) and OS errors from a socket the watchdog shut down.
_FAILURES = (psycopg.Error, OSError)


class _Failures:
    """Turns a failed step into the `DatabaseError` a flow sees; shared by both runners."""

    def __init__(self, *, table: str, redact: Callable[[str], str]) -> None:
        self._table = table
        self._redact = redact

    def translate(
        self,
        exc: BaseException,
        op: Execute,
        *,
        sent: bool,
        deadline: Deadline | None,
        conn: psycopg.BaseConnection[Any] | None,
        connect_retryable: bool,
    ) -> DatabaseError:
        error = classify_failure(
            exc,
            action=op.action,
            table=self._table,
            sent=sent,
            timed_out=deadline is not None and deadline.fired,
            connection_lost=conn is None or conn.closed or conn.broken,
            connect_retryable=connect_retryable,
            redact=self._redact,
        )
        return error

    def redact(self, text: str) -> str:
        return self._redact(text)

    def shown_cause(self, exc: BaseException) -> BaseException | None:
        """psycopg's error, to chain for the traceback, unless its text held a secret."""
        return None if self._redact(str(exc)) != str(exc) else exc


def _result(cursor: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], rows: list[Any]) -> Result:
    return Result(cursor.rowcount, tuple(tuple(row) for row in rows))


class SyncRunner:
    """Runs flows on a sync connection source. ``stop`` ends `Pause` steps early."""

    def __init__(self, conns: SyncConnections, failures: _Failures, stop: threading.Event | None = None) -> None:
        self._conns = conns
        self._failures = failures
        self._stop = stop

    def run(self, flow: Flow[T]) -> T:
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = flow.send(reply) if error is None else flow.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply, error = None, None
            try:
                reply = self._perform(op)
            except BaseException as exc:  # handed to the flow, which decides
                error = exc

    def _perform(self, op: Op) -> Any:
        if isinstance(op, Execute):
            return self._execute(op)
        if isinstance(op, Pause):
            if self._stop is None:
                time.sleep(op.seconds)
                return True
            return not self._stop.wait(op.seconds)
        if isinstance(op, WaitForRelease):
            return self._wait_for_release(op)
        return self._stop_listening(op)

    def _execute(self, op: Execute) -> Result:
        if op.guard is None:
            return self._execute_now(op)
        with op.guard.lock:
            if op.guard.superseded:
                raise CleanupSuperseded
            return self._execute_now(op)

    def _execute_now(self, op: Execute) -> Result:
        conns = self._conns
        retryable = conns.connected_before
        sent, deadline, used = False, None, None
        try:
            with conns.connection(op.timeout) as conn:
                used, sent = conn, True
                try:
                    with Deadline(conn.fileno(), op.timeout) as deadline:
                        cursor = conn.execute(op.query, op.params, prepare=False)
                        result = _result(cursor, cursor.fetchall() if cursor.description else [])
                except _FAILURES as exc:
                    _discard_if_unusable(conn, deadline, exc)
                    raise
                _discard_if_unusable(conn, deadline, None)
                return result
        except _FAILURES as exc:
            error = self._failures.translate(
                exc, op, sent=sent, deadline=deadline, conn=used, connect_retryable=retryable
            )
            raise error from self._failures.shown_cause(exc)

    def _wait_for_release(self, op: WaitForRelease) -> None:
        started = time.monotonic()
        conns = self._conns
        try:
            if not conns.can_listen:
                time.sleep(op.seconds)
            elif op.channel not in conns.listening:
                # Start listening and return at once: the flow re-checks the
                # lock, so a release in between cannot be missed.
                self._execute(_listen_step(op.listen, op.statement_timeout))
                conns.listening.add(op.channel)
            else:
                conns.wait_for_notification(op.seconds)
        except (DatabaseError, *_FAILURES) as exc:
            # Waiting is an optimisation: on any failure, fall back to polling.
            logger.debug("waiting for a release notification failed: %s", self._failures.redact(str(exc)))
            time.sleep(max(0.0, op.seconds - (time.monotonic() - started)))

    def _stop_listening(self, op: StopListening) -> None:
        if op.channel not in self._conns.listening:
            return
        self._conns.listening.discard(op.channel)
        try:
            self._execute(_listen_step(op.unlisten, op.statement_timeout))
        except DatabaseError as exc:
            logger.debug("UNLISTEN failed: %s", exc)


class AsyncRunner:
    """Runs flows on an async connection source. ``stop`` ends `Pause` steps early."""

    def __init__(self, conns: AsyncConnections, failures: _Failures, stop: asyncio.Event | None = None) -> None:
        self._conns = conns
        self._failures = failures
        self._stop = stop

    async def run(self, flow: Flow[T]) -> T:
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = flow.send(reply) if error is None else flow.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply, error = None, None
            try:
                reply = await self._perform(op)
            except BaseException as exc:  # handed to the flow, which decides
                error = exc

    async def _perform(self, op: Op) -> Any:
        if isinstance(op, Execute):
            return await self._execute(op)
        if isinstance(op, Pause):
            if self._stop is None:
                await asyncio.sleep(op.seconds)
                return True
            try:
                await asyncio.wait_for(self._stop.wait(), op.seconds)
            except TimeoutError:
                return True
            return False
        if isinstance(op, WaitForRelease):
            return await self._wait_for_release(op)
        return await self._stop_listening(op)

    async def _execute(self, op: Execute) -> Result:
        if op.guard is None:
            return await self._execute_now(op)
        await acquire_without_blocking(op.guard.lock)
        try:
            if op.guard.superseded:
                raise CleanupSuperseded
            return await self._execute_now(op)
        finally:
            op.guard.lock.release()

    async def _execute_now(self, op: Execute) -> Result:
        conns = self._conns
        retryable = conns.connected_before
        sent, deadline, used = False, None, None
        try:
            async with conns.connection(op.timeout) as conn:
                used, sent = conn, True
                try:
                    with Deadline(conn.fileno(), op.timeout) as deadline:
                        statement = asyncio.ensure_future(self._statement(conn, op))
                        statement.add_done_callback(_retrieve)
                        try:
                            result = await asyncio.shield(statement)
                        except asyncio.CancelledError:
                            # Cancelled by the caller: end the statement now, rather
                            # than let psycopg attempt a server-side cancel over what
                            # may be a dead network. The flow treats it as unanswered.
                            deadline.fire()
                            await asyncio.wait([statement])
                            raise
                except _FAILURES as exc:
                    _discard_if_unusable(conn, deadline, exc)
                    raise
                _discard_if_unusable(conn, deadline, None)
                return result
        except _FAILURES as exc:
            error = self._failures.translate(
                exc, op, sent=sent, deadline=deadline, conn=used, connect_retryable=retryable
            )
            raise error from self._failures.shown_cause(exc)

    @staticmethod
    async def _statement(conn: psycopg.AsyncConnection[Any], op: Execute) -> Result:
        cursor = await conn.execute(op.query, op.params, prepare=False)
        return _result(cursor, await cursor.fetchall() if cursor.description else [])

    async def _wait_for_release(self, op: WaitForRelease) -> None:
        started = time.monotonic()
        conns = self._conns
        try:
            if not conns.can_listen:
                await asyncio.sleep(op.seconds)
            elif op.channel not in conns.listening:
                await self._execute(_listen_step(op.listen, op.statement_timeout))
                conns.listening.add(op.channel)
            else:
                await conns.wait_for_notification(op.seconds)
        except (DatabaseError, *_FAILURES) as exc:
            logger.debug("waiting for a release notification failed: %s", self._failures.redact(str(exc)))
            await asyncio.sleep(max(0.0, op.seconds - (time.monotonic() - started)))

    async def _stop_listening(self, op: StopListening) -> None:
        if op.channel not in self._conns.listening:
            return
        self._conns.listening.discard(op.channel)
        try:
            await self._execute(_listen_step(op.unlisten, op.statement_timeout))
        except DatabaseError as exc:
            logger.debug("UNLISTEN failed: %s", exc)


def _listen_step(statement: sql.Composed, timeout: float) -> Execute:
    return Execute(statement, {}, timeout, "LISTEN/UNLISTEN for release notifications")


def _discard_if_unusable(
    conn: psycopg.BaseConnection[Any], deadline: Deadline | None, exc: BaseException | None
) -> None:
    """Close a connection that must not serve another statement.

    Its socket was shut down by the deadline (even if the reply made it), or
    it sits on a read-only standby after a failover. `pgconn.finish` rather
    than `close`: a pool configured with ``close_returns`` would take a closed
    connection back twice.
    """
    fired = deadline is not None and deadline.fired
    if fired or getattr(exc, "sqlstate", None) == READ_ONLY:
        conn.pgconn.finish()


async def acquire_without_blocking(lock: threading.Lock) -> None:
    """Take a thread lock from async code without blocking the event loop.

    The lock is shared between threads and event loops, and its holder may be
    a task on this very loop: polling is the one way that never deadlocks.
    Holders keep it for one statement at most, acquires for an instant.
    """
    while not lock.acquire(blocking=False):  # noqa: ASYNC110 - a thread lock; see the docstring
        await asyncio.sleep(0.01)


def _retrieve(task: asyncio.Future[Any]) -> None:
    # Mark an abandoned statement's outcome as seen, so asyncio does not log it.
    if not task.cancelled():
        task.exception()
