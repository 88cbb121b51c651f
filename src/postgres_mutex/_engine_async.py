"""The engine that runs the flows on PostgreSQL for one client, on one event loop.

Written once, here, with async primitives; ``_engine.py`` (the engine of sync
code, on threads) is generated from it by ``tools/async_to_sync.py`` and CI
checks the two never drift apart. What differs between a task and a thread
lives in ``_acompat.py``.

An engine owns, in dsn mode, at most two connections: one for statements
(acquire, heartbeat, release, clean-up, admin), used by one caller at a time
with heartbeats first in line, and one that LISTENs for releases on behalf of
every waiter of the client. In pool mode it borrows one pooled connection per
statement and never listens. One background worker renews every hold the
engine acquired, one statement per heartbeat interval, and deletes rows that
unanswered statements may have left; one more worker runs the listener. No
thread or task per lock.

Every statement runs under a deadline that shuts the socket down if it passes,
so a silent network cannot hold anything past its timeout, and the server
gets the same deadline as ``statement_timeout``, so nothing the client gave up
on goes on running there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import pq

from . import _flows as flows
from . import _sql
from ._acompat import (
    ACancelled,
    AEvent,
    AGate,
    AWaker,
    AWorker,
    aacquire_lock,
    asleep,
    ato_the_end,
    auncancellable,
    current_owner,
)
from ._clock import MAX_SLICE, now
from ._connections import Session, closed_while_idle, discard, unusable
from ._rules import READ_ONLY, SHAPE_CHANGED, classify_failure
from ._settings import retry_pause
from ._sql import Names, Statements
from ._state import LEASE_EXPIRED, RELEASED_ELSEWHERE, HeartbeatGroup, Hold, LockState, Phase
from ._watchdog import Cutter
from .errors import DatabaseError, LockNotHeldError, MutexError, OperationTimeout, SchemaError

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

    from .client import MutexClient

logger = logging.getLogger("postgres_mutex")

T = TypeVar("T")

# What a failing psycopg call can raise: its own errors (pool errors derive
# from them) and OS errors from a socket the watchdog shut down.
_FAILURES = (psycopg.Error, OSError)

# The longest wait for the server to take a cancel request for an interrupted statement.
_CANCEL_TIMEOUT = 1.0

# A connection idle for longer than this is checked before use: did the server close it?
_IDLE_CHECK = 0.5

# How long the heartbeat worker stays once nothing is held: locks come and go
# in bursts, and a thread started per acquire would cost more than the lock.
_WORKER_LINGER = 10.0

# How long the listener keeps its connection once nobody waits: waiters come
# in bursts, and each new connection costs the first waiter of a burst a moment.
_LISTENER_LINGER = 10.0

# A listener that fails this many times in a row is a fault to report (one
# lost connection is a failover or a restart, and waiters poll through it);
# while it goes on failing, the report repeats at most every _LISTENER_REPORT_EVERY.
_LISTENER_FAILURES_REPORTED = 3
_LISTENER_REPORT_EVERY = 60.0

# The server's share of a statement's deadline: it cancels the statement a
# little before the client would cut the connection, so a statement stuck
# behind a row lock ends with a clean error and the connection survives.
_SERVER_SHARE = 0.9

# On a direct connection the server's deadline is the session's. A statement
# goes prepared under it if it fits the statement's own server deadline: never
# later (a millisecond of rounding aside), and not below this share of it,
# which would cut the statement short for no reason.
_SESSION_TIMEOUT_FLOOR = 0.5

# The least a statement gets once the exit's budget is nearly spent: enough for
# a release on a database that answers, too little to hold the exit up.
_LAST_STATEMENT = 0.05


class AsyncEngine:
    """Runs flows for one client on one event loop: its connections, heartbeats, listener and clean-ups."""

    def __init__(self, client: MutexClient, *, dsn: str | None, pool: AsyncConnectionPool[Any] | None) -> None:
        self.client = client
        self._source: _OwnConnection | _PooledConnection
        if dsn is not None:
            self._source = _OwnConnection(dsn, client._connect_kwargs("postgres-mutex"))
            self._listener: _Listener | None = _Listener(self, dsn, client._connect_kwargs("postgres-mutex listener"))
        else:
            assert pool is not None
            self._source = _PooledConnection(pool)
            self._listener = None
        self._gate = AGate()
        self.groups: dict[object, HeartbeatGroup] = {}
        self._cleanups: list[flows.Cleanup] = []
        self._wake = AEvent()
        self._worker: AWorker | None = None
        self.closed = False
        self.deadline: float | None = None
        """When set (by the release at interpreter exit), no statement waits past it."""

    # -- running flows -----------------------------------------------------------

    async def run(self, flow: flows.Flow[T]) -> T:
        """Drive ``flow`` to its end, performing each step it asks for."""
        steps = _Steps(self)
        reply: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    op = flow.send(reply) if error is None else flow.throw(error)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                reply, error = None, None
                try:
                    reply = steps.perform_now(op)
                    if reply is _WAITS:
                        reply = await steps.perform(op)
                except BaseException as exc:  # handed to the flow, which decides
                    error = exc
        finally:
            steps.finish()

    async def execute(self, op: flows.Execute) -> flows.Result:
        if self.deadline is not None:
            # At exit: no statement may outlast the exit's budget.
            op = dataclasses.replace(op, timeout=max(min(op.timeout, self.deadline - now()), _LAST_STATEMENT))
        if op.guard is None:
            return await self._send(op)
        # A clean-up of any row carrying our id must never cross an acquire of
        # the same Mutex: the acquire waits for it, and a superseded one is dropped.
        await aacquire_lock(op.guard.lock.cleanup_sending)
        try:
            if op.guard.superseded:
                raise flows.CleanupSuperseded
            return await self._send(op)
        finally:
            op.guard.lock.cleanup_sending.release()

    async def _send(self, op: flows.Execute) -> flows.Result:
        source = self._source
        connect_retryable = source.connected_before
        sent = False
        conn: psycopg.AsyncConnection[Any] | None = None
        cutter: Cutter | None = None
        lost = True
        try:
            asked_at = now()
            async with self._gate.turn(op.urgent), source.connection(op.timeout, asked_at) as (conn, cutter):
                sent = True
                ticket = cutter.arm(op.timeout)
                try:
                    return await auncancellable(
                        _statement(conn, op, source.session, source.cursor),
                        functools.partial(_interrupt, conn, cutter, op.timeout),
                    )
                except _FAILURES as exc:
                    # As the statement left it, before the connection is put away.
                    lost = conn.closed or conn.broken
                    sqlstate = getattr(exc, "sqlstate", None)
                    if sqlstate == READ_ONLY:
                        # On a read-only node (a standby after a failover): only a
                        # new connection can reach the primary.
                        source.replace()
                    elif sqlstate in SHAPE_CHANGED:
                        # A table or column the statements name is gone (the history
                        # dropped, say): inspect the table again before the next one.
                        self.client._shapes.pop(op.statement.table, None)
                    raise
                except BaseException:
                    # Interrupted mid-statement: a signal handler's exception (a job
                    # runner's timeout, SIGTERM), or a cancelled task.
                    await _interrupt(conn, cutter, op.timeout)
                    raise
                finally:
                    cutter.disarm(ticket)
        except _FAILURES as exc:
            error = classify_failure(
                exc,
                action=op.action,
                table=op.statement.table,
                sent=sent,
                timed_out=cutter is not None and cutter.fired,
                connection_lost=lost,
                connect_retryable=connect_retryable,
                redact=self.client._redact,
                timeout=op.timeout,
            )
            shown = self.client._shown_cause(exc)
            if shown is not None:
                raise error from shown
        # psycopg's error held a secret: raised out here, where it is not even
        # the error's __context__ (which `from None` would merely hide).
        raise error

    async def shape(self, names: Names, timeout: float, *, fresh: bool = False) -> Statements:
        """The statements for this table's shape; the table is inspected once per client, or again if ``fresh``."""
        statements = None if fresh else self.client._shapes.get(names.table_name)
        if statements is None:
            op = flows.Execute(_sql.inspect_table(names), {}, timeout, f"inspection of table {names.table_name}")
            row = (await self.execute(op)).row
            assert row is not None
            exists, has_token, has_history = row
            if not exists:
                raise SchemaError(
                    f"the lock table {names.table_name} does not exist; call create_schema() or create it "
                    "as the README shows (names are case-sensitive)",
                    sqlstate="42P01",
                )
            statements = Statements(names, _sql.TableShape(tokens=bool(has_token), history=bool(has_history)))
            with self.client._state_lock:
                # Compared with what the client knew, under its lock: its engines
                # and flows that find the history gone at once say so only once.
                self.client._shapes[names.table_name] = statements
                known = names.table_name in self.client._with_history
                if has_history:
                    self.client._with_history.add(names.table_name)
                else:
                    self.client._with_history.discard(names.table_name)
            if known and not has_history:
                logger.warning(
                    "the history of lock table %s (%s) is gone, dropped while its locks were in use: "
                    "holds go on without a history; create_schema(history=True) makes a new one",
                    names.table_name,
                    names.history_name,
                )
        return statements

    # -- holds and their heartbeats ------------------------------------------------

    def keep(self, hold: Hold) -> None:
        """Renew ``hold`` from now on, with the other holds of its table and interval."""
        lock = hold.lock
        # One statement for the holds that share a table, an interval and what their heartbeats report.
        key = (lock.names.table_name, lock.timing.heartbeat_interval, lock.timing.alert_threshold, id(lock.tracing))
        with self.client._state_lock:
            group = self.groups.get(key)
            new_group = group is None
            if group is None:
                group = self.groups[key] = HeartbeatGroup(key, lock.timing.heartbeat_interval, lock.tracing)
            group.holds[hold] = None
            hold.group = group
            self._start_worker()
        self.client._lease_added(hold.lease_deadline)
        if new_group:
            self._wake.set()  # its first heartbeat may be due before the worker would look again

    def schedule(self, cleanup: flows.Cleanup) -> None:
        """Delete a row that may remain, in the background, as soon as the database answers."""
        with self.client._state_lock:
            closed = self.closed
            if not closed:
                self._cleanups.append(cleanup)
                self._start_worker()
        if closed:
            self.client._adopt_cleanup(cleanup)
        else:
            self._wake.set()

    def has_cleanups(self) -> bool:
        return bool(self._cleanups)

    def take_cleanups(self) -> list[flows.Cleanup]:
        with self.client._state_lock:
            pending, self._cleanups = self._cleanups, []
            return pending

    def _start_worker(self) -> None:
        # Under the state lock: the worker decides to end under it too. One
        # that could not start (at interpreter exit) is tried again next time.
        if (self._worker is None or not self._worker.running) and not self.closed:
            self._worker = AWorker(self._background, name="postgres-mutex-heartbeat")

    async def _background(self) -> None:
        """Renew the holds and delete left rows until there is nothing left to do."""
        idle_since: float | None = None
        try:
            while True:
                self._wake.clear()
                with self.client._state_lock:
                    busy = any(group.holds for group in self.groups.values()) or bool(self._cleanups)
                    idle_since = None if busy else idle_since if idle_since is not None else now()
                    if self.closed or (idle_since is not None and now() - idle_since >= _WORKER_LINGER):
                        # Nothing to renew or delete for a while: end until there is.
                        self._worker = None
                        return
                    groups = list(self.groups.values())
                    cleanups = list(self._cleanups)
                for group in groups:
                    if group.next_beat <= now():
                        await self._beat(group)
                for cleanup in cleanups:
                    if cleanup.due <= now():
                        await self._clean(cleanup)
                wake_at = min(
                    [group.next_beat for group in self.groups.values()]
                    + [cleanup.due for cleanup in self._cleanups]
                    + [now() + MAX_SLICE]
                )
                if wake_at > now():
                    await self._wake.wait(min(wake_at - now(), MAX_SLICE))
        except (ACancelled, GeneratorExit):
            # The event loop is shutting down, or closed with this task pending (it
            # is then destroyed): its holds end with it (the exit releases them).
            with self.client._state_lock:
                self._worker = None
            raise
        except BaseException:
            # Never die silently: the leases of the holds then run out, and
            # the client's event thread declares them lost on time.
            logger.exception("postgres-mutex heartbeat worker failed")
            with self.client._state_lock:
                self._worker = None
            raise

    async def _beat(self, group: HeartbeatGroup) -> None:
        with self.client._state_lock:
            holds = group.live()
            if not holds:
                if not group.holds:
                    self.groups.pop(group.key, None)
                group.next_beat = now() + group.interval
                return
        timeout = min(hold.lock.timing.operation_timeout for hold in holds)
        try:
            statements = await self.shape(holds[0].lock.names, timeout)
            beat = await self.run(flows.heartbeat(holds, statements, group.tracing, timeout))
        except DatabaseError as exc:  # the inspection failed
            beat = flows.Beat([], [], 0.0, exc)
        if beat.error is not None:
            error = beat.error
            if flows.died_while_idle(error) and not group.quiet_retry:
                # The server closed the connection while it was idle: not a
                # failure of the holder's, and worth no alert. Again, at once.
                logger.debug("%s; retrying at once on a new connection", error)
                group.quiet_retry = True
                group.next_beat = now()
                return
            group.quiet_retry = False
            group.next_beat = now() + retry_pause(group.interval)
            self.client._post(_failed(holds, error))
            return
        group.quiet_retry = False
        # From when the statement was sent: the interval is kept whatever the statement took.
        group.next_beat = beat.sent_at + group.interval
        if beat.busy:
            group.next_beat = min(group.next_beat, now() + retry_pause(group.interval))
            self.client._post(_failed(beat.busy, None))
        self.client._post(_renewed(beat))

    async def _clean(self, cleanup: flows.Cleanup) -> None:
        lock = cleanup.lock
        try:
            done = await self.run(flows.clean_up(cleanup))
            retry_at = cleanup.settled_at
        except flows.CleanupSuperseded:
            done, retry_at = True, now()
        except DatabaseError as exc:
            lock.events.row_may_remain(exc)
            # A failure that will not pass (a closed pool, a revoked privilege): give up;
            # the row is reclaimable after stale_threshold anyway.
            done, retry_at = not exc.transient, now() + lock.timing.poll_interval
        with self.client._state_lock:
            if done or now() >= cleanup.give_up_at:
                with contextlib.suppress(ValueError):
                    self._cleanups.remove(cleanup)
            else:
                cleanup.due = max(retry_at, now())

    # -- listening for releases ------------------------------------------------------

    @property
    def listener(self) -> _Listener | None:
        return self._listener

    # -- shutting down -----------------------------------------------------------

    async def close(self) -> None:
        """Stop the workers and close the engine's connections (never a pool); pending clean-ups go to the client."""
        with self.client._state_lock:
            self.closed = True
            worker, self._worker = self._worker, None
        self._wake.set()
        if worker is not None:
            await worker.join(self.client.operation_timeout + 1.0)
        if self._listener is not None:
            await self._listener.close()
        for cleanup in self.take_cleanups():
            self.client._adopt_cleanup(cleanup)
        await self._source.close()

    def close_connections(self) -> None:
        """Nothing is held or waited on: close the statement connection (the next statement opens one)."""
        self._source.abandon()

    def abandon(self) -> None:
        """The engine's event loop is gone: close its connections without it."""
        self.closed = True
        if self._listener is not None:
            self._listener.abandon()
        self._source.abandon()


def _failed(holds: list[Hold], error: DatabaseError | None) -> Any:
    """Report failed heartbeats: the statement's error, or (None) each row locked by another session."""

    def report() -> None:
        for index, hold in enumerate(holds):
            hold.lock.events.heartbeat_failed(error or flows.busy_error(hold), log=error is None or index == 0)

    return report


def _renewed(beat: flows.Beat) -> Any:
    def report() -> None:
        for hold in beat.renewed:
            hold.lock.events.heartbeat_renewed(beat.latency)
        for hold, error in beat.lost:
            hold.lock.events.lost(error)

    return report


async def _interrupt(conn: psycopg.AsyncConnection[Any], cutter: Cutter, timeout: float) -> None:
    """Stop a statement the caller gave up on: on the server first, then on the socket.

    Left alone, it could go on waiting on the server (behind another session's
    row lock, say) and land later: an orphan row, or a lock taken by nobody.
    A cancel request (bounded, and skipped when the network is known dead)
    stops it there; the connection is then cut and replaced either way.
    """
    if not cutter.fired and conn.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
        with contextlib.suppress(Exception):
            await conn.cancel_safe(timeout=min(_CANCEL_TIMEOUT, timeout))
    cutter.cut()


async def _statement(
    conn: psycopg.AsyncConnection[Any],
    op: flows.Execute,
    session: Session | None,
    cursor: psycopg.AsyncCursor[Any] | None,
) -> flows.Result:
    timeout_ms = max(1, int(op.timeout * _SERVER_SHARE * 1000))
    bare = op.statement.bare
    settling = False
    if session is not None and bare is not None:
        kept = session.timeout_ms
        if session.direct and kept is not None and timeout_ms * _SESSION_TIMEOUT_FLOOR <= kept <= timeout_ms + 1:
            return await _prepared(cursor or conn.cursor(), op, bare, session)
        # A connection's first lock statement asks whether it reaches PostgreSQL
        # directly and, if so, sets the session up; a statement whose deadline the
        # session's does not fit sets it again. Either way in the statement's own
        # message, which carries its settings for its transaction: no extra round trip.
        settling = session.direct is not False
    text = op.statement.text
    if settling:
        text += "; " + _sql.session_setup(conn.info.backend_pid, timeout_ms)
    params = {**op.params, "_server_timeout_ms": timeout_ms}
    cursor = psycopg.AsyncClientCursor(conn)
    sent_at = now()
    await cursor.execute(text, params)
    if settling and session is not None:
        results = [await _result(cursor, sent_at)]
        while cursor.nextset():
            results.append(await _result(cursor, sent_at))
        answer, result = results[-1], results[-2]
        session.direct = answer.rows[0][0] is True
        session.timeout_ms = timeout_ms if session.direct else None
        return result
    # The settings that precede the statement answer first: its own result is the last.
    while cursor.nextset():
        pass
    return await _result(cursor, sent_at)


async def _prepared(cursor: psycopg.AsyncCursor[Any], op: flows.Execute, bare: str, session: Session) -> flows.Result:
    """The statement alone, prepared, on a direct connection whose session carries its settings."""
    sent_at = now()
    try:
        # Prepared on its first use on this connection (one more round trip, once).
        await cursor.execute(bare, op.params, prepare=True)
    except psycopg.errors.FeatureNotSupported:
        # "cached plan must not change result type": a column changed type since
        # the statement was prepared (a table made again, a wider instance_id).
        # Refused before it ran: it runs again unprepared, and the connection is
        # replaced after it (psycopg before 3.3 would go on using its prepared
        # statements even after a DEALLOCATE ALL); a new one prepares afresh.
        session.retired = True
        sent_at = now()
        await cursor.execute(bare, op.params, prepare=False)
    return await _result(cursor, sent_at)


async def _result(cursor: psycopg.AsyncCursor[Any], sent_at: float) -> flows.Result:
    result = cursor.pgresult
    rows = await cursor.fetchall() if result is not None and result.status == pq.ExecStatus.TUPLES_OK else []
    return flows.Result(cursor.rowcount, tuple(tuple(row) for row in rows), sent_at)


_WAITS = object()
"""What `_Steps.perform_now` returns for a step that must be awaited."""


class _Steps:
    """Performs the steps of one flow run; remembers what the run subscribed to."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._subscription: _Subscription | None = None

    def perform_now(self, op: flows.Op) -> Any:
        """Perform ``op`` if it needs no waiting (most steps of a cycle); else return `_WAITS`."""
        engine = self._engine
        if isinstance(op, flows.Execute):
            return _WAITS
        if isinstance(op, flows.Shape):
            statements = None if op.fresh else engine.client._shapes.get(op.names.table_name)
            return _WAITS if statements is None else statements
        if isinstance(op, flows.Settle):
            if not op.lock.cleanup_sending.acquire(blocking=False):
                return _WAITS  # a clean-up of this Mutex's row is being sent
            op.lock.cleanup_sending.release()
            return None
        if isinstance(op, flows.Keep):
            engine.keep(op.hold)
            return None
        if isinstance(op, flows.Forget):
            engine.client._forget(op.hold)
            return None
        if isinstance(op, flows.Tell):
            lock, error = op.lock, op.error
            engine.client._post(lambda: lock.events.lost(error))
            return None
        if isinstance(op, flows.Schedule):
            engine.schedule(op.cleanup)
            return None
        if isinstance(op, flows.StopListening):
            self.finish()
            return None
        return _WAITS

    async def perform(self, op: flows.Op) -> Any:
        """Perform a step that waits: a statement, an inspection, a pause, a wait for a release."""
        engine = self._engine
        if isinstance(op, flows.Execute):
            return await engine.execute(op)
        if isinstance(op, flows.Shape):
            return await engine.shape(op.names, op.timeout, fresh=op.fresh)
        if isinstance(op, flows.Pause):
            await asleep(op.seconds)
            return not engine.closed
        if isinstance(op, flows.Settle):
            await aacquire_lock(op.lock.cleanup_sending)
            op.lock.cleanup_sending.release()
            return None
        if isinstance(op, flows.Listen):
            listener = engine.listener
            if listener is None:
                return False
            self._subscription = listener.subscribe(op.channel)
            return await self._subscription.confirmed.wait(op.timeout)
        assert isinstance(op, flows.WaitForRelease)
        subscription = self._subscription
        # A release wakes the wait, and so does a stop (an election's), set from any thread.
        wake = AEvent() if subscription is None else subscription.released
        with contextlib.nullcontext() if op.stop is None else op.stop.waking(wake.set):
            await wake.wait(op.seconds)
        wake.clear()
        return None

    def finish(self) -> None:
        subscription, self._subscription = self._subscription, None
        listener = self._engine.listener
        if subscription is not None and listener is not None:
            listener.unsubscribe(subscription)


# -- where statements get a connection ------------------------------------------------


class _OwnConnection:
    """The engine's own statement connection, opened on first use and replaced when it breaks."""

    def __init__(self, dsn: str, connect_kwargs: dict[str, Any]) -> None:
        self._dsn = dsn
        self._kwargs = connect_kwargs
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._cutter: Cutter | None = None
        self._used_at = 0.0
        self._replace = False
        self._timeout = 0.0
        self._asked_at = 0.0
        self._connect_failed: tuple[float, BaseException] | None = None
        """When the last connect failed, and how (None once one succeeds)."""
        self._in_use: tuple[psycopg.AsyncConnection[Any], Cutter]
        self.connected_before = False
        self.session: Session | None = None
        """The session of the connection in use (None before the first connect)."""
        self.cursor: psycopg.AsyncCursor[Any] | None = None
        """The connection's cursor for its prepared statements: reused, since making one
        per statement is a measurable share of a lock cycle."""

    def replace(self) -> None:
        """Drop the connection in use once the statement is over."""
        self._replace = True

    def connection(self, timeout: float, asked_at: float) -> _OwnConnection:
        """The connection for one statement, as an ``async with`` block: dropped after it if it broke.

        Itself, not a generator-based context manager (one is entered per
        statement); the gate lets one statement at a time in. A statement
        that asked (at ``asked_at``) while another was connecting, and saw
        that connect fail, fails with it rather than wait out a second one:
        its bound stays one connect, however many statements queue behind.
        """
        self._timeout = timeout
        self._asked_at = asked_at
        return self

    async def __aenter__(self) -> tuple[psycopg.AsyncConnection[Any], Cutter]:
        conn, cutter = await self._open(self._timeout)
        self._replace = False
        self._in_use = conn, cutter
        return conn, cutter

    async def __aexit__(self, *exc_info: object) -> None:
        conn, cutter = self._in_use
        self._used_at = now()
        if cutter.fired or self._replace or unusable(conn) or (self.session is not None and self.session.retired):
            self._drop()

    async def _open(self, timeout: float) -> tuple[psycopg.AsyncConnection[Any], Cutter]:
        # A connection used a moment ago was not closed for idling; one that sat
        # idle may have been (idle_session_timeout, a restart, a proxy).
        if self._conn is not None and now() - self._used_at > _IDLE_CHECK and closed_while_idle(self._conn):
            logger.debug("the server closed the library's idle connection; opening a new one")
            self._drop()
        if self._conn is None or self._cutter is None:
            failed = self._connect_failed
            if failed is not None and failed[0] >= self._asked_at:
                raise failed[1]
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._dsn, autocommit=True, **{**self._kwargs, **_connect_within(self._kwargs, timeout)}
                )
            except _FAILURES as exc:
                self._connect_failed = now(), exc
                raise
            self._connect_failed = None
            self._conn, self._cutter = conn, Cutter(conn.fileno())
            self.session = Session()
            self.cursor = conn.cursor()
            self.connected_before = True
        return self._conn, self._cutter

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        cutter, self._cutter = self._cutter, None
        self.cursor = None
        if cutter is not None:
            cutter.close()
        if conn is not None:
            discard(conn)

    async def close(self) -> None:
        self._drop()

    def abandon(self) -> None:
        self._drop()


def _connect_within(kwargs: dict[str, Any], timeout: float) -> dict[str, Any]:
    """A connect made for a statement waits no longer than that statement may (libpq's floor: 2 s)."""
    if "connect_timeout" not in kwargs:
        return {}  # the DSN (or PGCONNECT_TIMEOUT) sets it: the user's choice wins
    return {"connect_timeout": max(2, math.ceil(min(timeout, kwargs["connect_timeout"])))}


class _PooledConnection:
    """A connection borrowed from the user's pool for one statement, handed back as it was found."""

    session = None
    """The pool's connections belong to the application: the library sets nothing on their sessions."""
    cursor = None

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self._pool = pool
        self._replace = False
        self.connected_before = False

    def replace(self) -> None:
        """Hand the connection in use back closed, so the pool replaces it."""
        self._replace = True

    @contextlib.asynccontextmanager
    async def connection(
        self, timeout: float, asked_at: float
    ) -> AsyncIterator[tuple[psycopg.AsyncConnection[Any], Cutter]]:
        # ``asked_at`` is the own connection's concern: the pool connects on its own schedule.
        async with self._pool.connection(timeout=timeout) as conn:
            self.connected_before = True
            cutter = Cutter(conn.fileno())
            autocommit = conn.autocommit
            self._replace = False
            try:
                if not autocommit:
                    await conn.set_autocommit(True)
                yield conn, cutter
            finally:
                cutter.close()
                if cutter.fired or self._replace or unusable(conn):
                    # The pool must not hand it out again: it sees it closed and replaces it.
                    discard(conn)
                elif not autocommit:
                    await conn.set_autocommit(False)

    async def close(self) -> None:
        """The pool belongs to the application: nothing to close."""

    def abandon(self) -> None:
        pass


# -- the listener ------------------------------------------------------------------------


class _Subscription:
    """One waiter's interest in one lock's releases."""

    __slots__ = ("channel", "confirmed", "released")

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.confirmed = AEvent()
        """Set once the listener LISTENs on the channel: a release from then on is heard."""
        self.released = AEvent()
        """Set when a release is announced on the channel (or may have been missed)."""


class _Listener:
    """One LISTENing connection for every waiter of the engine; a release wakes only its lock's waiters."""

    def __init__(self, engine: AsyncEngine, dsn: str, connect_kwargs: dict[str, Any]) -> None:
        self._engine = engine
        self._dsn = dsn
        self._kwargs = connect_kwargs
        self._subscriptions: dict[str, set[_Subscription]] = {}
        self._waker = AWaker()
        self._worker: AWorker | None = None
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._listening: set[str] = set()
        self._closed = False

    def subscribe(self, channel: str) -> _Subscription:
        subscription = _Subscription(channel)
        with self._engine.client._state_lock:
            self._subscriptions.setdefault(channel, set()).add(subscription)
            if (self._worker is None or not self._worker.running) and not self._closed:
                self._worker = AWorker(self._run, name="postgres-mutex-listener")
        self._waker.wake()
        return subscription

    def unsubscribe(self, subscription: _Subscription) -> None:
        with self._engine.client._state_lock:
            waiting = self._subscriptions.get(subscription.channel)
            if waiting is not None:
                waiting.discard(subscription)
                if not waiting:
                    del self._subscriptions[subscription.channel]
        self._waker.wake()

    @property
    def channels(self) -> frozenset[str]:
        """The channels waited on right now."""
        with self._engine.client._state_lock:
            return frozenset(self._subscriptions)

    @property
    def listening(self) -> frozenset[str]:
        """The channels the connection LISTENs on right now (UNLISTEN follows the last waiter shortly)."""
        return frozenset(self._listening)

    def _released(self, channel: str) -> None:
        with self._engine.client._state_lock:
            waiting = list(self._subscriptions.get(channel, ()))
        for subscription in waiting:
            subscription.released.set()

    def _wake_everyone(self) -> None:
        # The connection was lost: a release may have gone unheard. Every waiter retries now.
        with self._engine.client._state_lock:
            waiting = [sub for subs in self._subscriptions.values() for sub in subs]
        for subscription in waiting:
            subscription.released.set()

    async def _run(self) -> None:
        listening = self._listening
        cutter: Cutter | None = None
        failures = 0
        reported_at: float | None = None
        idle_since: float | None = None
        try:
            while not self._closed:
                with self._engine.client._state_lock:
                    wanted = set(self._subscriptions)
                    if wanted or listening:
                        idle_since = None
                    elif idle_since is None:
                        idle_since = now()
                    elif now() - idle_since >= _LISTENER_LINGER:
                        # Nobody has waited for a while: close the connection until someone does.
                        self._worker = None
                        return
                try:
                    if self._conn is None or cutter is None:
                        self._conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True, **self._kwargs)
                        self._conn.add_notify_handler(lambda notify: self._released(notify.channel))
                        cutter = Cutter(self._conn.fileno())
                        listening.clear()
                        if failures:
                            self._wake_everyone()
                    conn = self._conn
                    for channel in sorted(wanted - listening):
                        await self._execute(conn, cutter, _sql.listen(channel))
                        listening.add(channel)
                    for channel in sorted(listening - wanted):
                        await self._execute(conn, cutter, _sql.unlisten(channel))
                        listening.discard(channel)
                    self._confirm(listening)
                    failures, reported_at = 0, None
                    if await self._waker.wait_readable(conn.fileno(), MAX_SLICE):
                        self._drain(conn)
                except _FAILURES as exc:
                    failures += 1
                    reason = self._engine.client._redact(str(exc))
                    persistent = failures >= _LISTENER_FAILURES_REPORTED and (
                        reported_at is None or now() - reported_at >= _LISTENER_REPORT_EVERY
                    )
                    if persistent:
                        reported_at = now()
                        logger.warning(
                            "the release listener lost its connection (%s), %d times in a row; waiters poll "
                            "every poll_interval meanwhile, so a release reaches them later",
                            reason,
                            failures,
                        )
                    else:
                        logger.debug("the release listener lost its connection (%s); waiters poll meanwhile", reason)
                    if cutter is not None:
                        cutter.close()
                    cutter = None
                    self._drop()
                    self._wake_everyone()
                    # Not a busy loop: a pause that grows, up to a few seconds.
                    await asleep(min(0.05 * 2**failures, 5.0))
        except BaseException:
            # Ended by something unexpected (or the loop's shutdown): the next waiter starts a new one.
            with self._engine.client._state_lock:
                self._worker = None
            raise
        finally:
            if cutter is not None:
                cutter.close()
            self._drop()

    async def _execute(self, conn: psycopg.AsyncConnection[Any], cutter: Cutter, text: str) -> None:
        timeout = self._engine.client.operation_timeout
        ticket = cutter.arm(timeout)
        try:
            # Never prepared (psycopg prepares a statement it has run five times): behind a
            # transaction-mode pooler a prepared statement would stay on a server connection
            # other clients share, and collide with theirs.
            await auncancellable(
                conn.execute(text, prepare=False), functools.partial(_interrupt, conn, cutter, timeout)
            )
        finally:
            cutter.disarm(ticket)

    def _confirm(self, listening: set[str]) -> None:
        with self._engine.client._state_lock:
            heard = [sub for channel in listening for sub in self._subscriptions.get(channel, ())]
        for subscription in heard:
            subscription.confirmed.set()

    def _drain(self, conn: psycopg.AsyncConnection[Any]) -> None:
        pgconn = conn.pgconn
        pgconn.consume_input()
        while (notify := pgconn.notifies()) is not None:
            self._released(notify.relname.decode(errors="replace"))
        if conn.broken or pgconn.status != pq.ConnStatus.OK:
            raise psycopg.OperationalError("the listener's connection was closed")

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            discard(conn)

    async def close(self) -> None:
        self._closed = True
        self._waker.wake()
        with self._engine.client._state_lock:
            worker = self._worker
        if worker is not None:
            await worker.join(self._engine.client.operation_timeout + 1.0)
        self._drop()
        self._waker.close()

    def abandon(self) -> None:
        self._closed = True
        self._drop()


# -- what acquire() and acquire_async() return ---------------------------------------------


class AsyncAcquisition:
    """Acquire on entering the block, release on leaving it; enter it once.

    Entering yields whether the lock was acquired (a blocking acquire that
    runs out of time raises `LockAcquisitionTimeout` instead, so the body
    never runs unlocked). Leaving releases the lock, whichever way the block
    ends; if the lock was lost meanwhile (or released from another thread or
    task while the block ran), a normal exit raises `LockNotHeldError`. An
    acquisition that is entered and never left keeps the lock until
    ``release()``.
    """

    def __init__(
        self,
        client: MutexClient,
        lock: LockState,
        *,
        blocking: bool,
        timeout: float | None,
        stop: flows.StopSignal | None = None,
    ) -> None:
        self._client = client
        self._lock = lock
        self._blocking = blocking
        self._timeout = timeout
        self._stop = stop
        self._entered = False
        self._hold: Hold | None = None

    async def __aenter__(self) -> bool:
        if self._entered:
            raise MutexError("this acquisition was entered already: call acquire() again for another one")
        self._entered = True
        self._client._check_process(self._lock)
        engine = self._client._get_engine_async()
        flow = flows.acquire(
            self._lock,
            self._lock.tracing,
            blocking=self._blocking,
            timeout=self._timeout,
            owner=current_owner(),
            stop=self._stop,
        )
        self._hold = await engine.run(flow)
        return self._hold is not None

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        hold = self._hold
        if hold is None:
            return
        lock = self._lock
        if lock.hold is hold and lock.phase is Phase.HOLDING:
            engine = self._client._get_engine_async()
            # Run to its end even if this task is cancelled again meanwhile: no row left behind.
            if exc_type is None:
                await ato_the_end(engine.run(flows.release(lock, lock.tracing, caller=current_owner())))
                return
            try:
                await ato_the_end(engine.run(flows.release(lock, lock.tracing, caller=current_owner())))
            except MutexError as error:
                # The block's own exception is what the caller must see.
                logger.warning("while leaving the block after an error: %s", error)
            return
        if exc_type is None and hold.reason in (RELEASED_ELSEWHERE, LEASE_EXPIRED):
            raise hold.error()


async def fence_async(lock: LockState, conn: psycopg.AsyncConnection[Any]) -> int:
    """Check, in the caller's open transaction on ``conn``, that this hold is still the lock's current one.

    One round trip on the caller's connection; nothing of the library's is
    opened. On success the row is share-locked until that transaction ends,
    so no other instance can take the lock over meanwhile; returns the token.
    Within one ``operation_timeout``, else `OperationTimeout` (the caller's
    connection is then closed, and its transaction rolled back).
    """
    hold = lock.require_held()
    if hold.token is None:
        raise SchemaError(
            f"lock {lock.lock_name!r} was acquired without a fencing token: the lock table "
            f"{lock.names.table_name} has no token column. Run LockTable.migrate() "
            "(or 'postgres-mutex migrate'); the lock's next acquire gets a token"
        )
    if conn.info.transaction_status == pq.TransactionStatus.IDLE and conn.autocommit:
        raise ValueError(
            "fence() needs an open transaction on conn: call it inside 'with conn.transaction():' "
            "(or with autocommit off), before the writes it protects"
        )
    params = {
        "lock_name": lock.lock_name,
        "instance_id": lock.instance_id,
        "acquired_at": hold.acquired_at,
        "token": hold.token,
    }
    # Bounded like every statement, though on the caller's connection: past the
    # deadline its socket is shut down, so the server ends the session and
    # rolls the transaction back; nothing it wrote can commit after that.
    timeout = lock.timing.operation_timeout
    cutter = Cutter(conn.fileno())
    ticket = cutter.arm(timeout)
    try:
        cursor = conn.cursor()
        await cursor.execute(lock.names.fence, params, prepare=False)
        row = await cursor.fetchone()
    except _FAILURES as exc:
        if not cutter.fired:
            raise
        raise OperationTimeout(
            f"fencing lock {lock.lock_name!r} did not finish within operation_timeout ({timeout:g}s): "
            "the connection was closed, and the server rolls its transaction back; "
            "nothing the transaction wrote is committed",
            transient=True,
            outcome_unknown=True,
        ) from exc
    finally:
        cutter.disarm(ticket)
        cutter.close()
    if row is None or row[0] is None:
        holder = None if row is None else row[1]
        now_held = f"it is now held by {holder}" if holder else "it is not held by anyone now"
        raise LockNotHeldError(
            f"lock {lock.lock_name!r} changed hands: the hold with token {hold.token} is no longer current "
            f"({now_held}); roll back the writes of this transaction",
            lock_name=lock.lock_name,
            instance_id=lock.instance_id,
            reason=FENCE_REJECTED,
        )
    return int(row[0])


FENCE_REJECTED = "fenced out: the lock changed hands (reclaimed, force-released, or its row was lost)"
