# Generated from engine_async.py by tools/async_to_sync.py: do not edit.
# Change the async module and run `python tools/async_to_sync.py`.
"""The engine that runs the flows on PostgreSQL for one client's callers.

An engine owns, in dsn mode, at most two connections: one for statements
(acquire, heartbeat, release, clean-up, admin), used by one caller at a time
with heartbeats first in line, and one that LISTENs for releases on behalf of
every waiter of the client. In pool mode it borrows one pooled connection per
statement and never listens. One background worker renews every hold the
engine acquired, one statement per heartbeat interval, and deletes rows that
unanswered statements may have left; one more worker runs the listener.
Nothing is started per lock.

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
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from .. import _sql
from .._base.acompat import Event, Gate, sleep
from .._base.clock import now
from .._base.connections import FAILURES, ServerSession
from .._base.watchdog import STORE_ARMS, Cutter
from .._sql import Names, Statements
from .._state import steps
from .._state.failures import READ_ONLY, SHAPE_CHANGED, classify_failure
from .._state.locks import HeartbeatGroup, Hold
from ..errors import DatabaseError, SchemaError, phrase
from .interrupt import interrupt
from .listener import Listener, Subscription
from .sources import OwnConnection, PooledConnection

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

    from .heartbeat import HeartbeatWorker
    from .host import EngineHost

logger = logging.getLogger("postgres_mutex")

T = TypeVar("T")

# The server's share of a statement's deadline: it cancels the statement a
# little before the client would cut the connection, so a statement stuck
# behind a row lock ends with a clean error and the connection survives. The
# client keeps at least _CLIENT_MARGIN (half the deadline, for the shortest):
# a tenth of a short deadline is too little for the server's error to arrive
# on a busy machine before the client's cut.
_SERVER_SHARE = 0.9
_CLIENT_MARGIN = 0.05

# On a direct connection the server's deadline is the session's. A statement
# goes prepared under it if it fits the statement's own server deadline: never
# later (a millisecond of rounding aside), and not below this share of it,
# which would cut the statement short for no reason. One with a much shorter
# deadline carries its own, for its transaction, and leaves the session's.
_SESSION_TIMEOUT_FLOOR = 0.5

# The least a statement gets once the exit's budget is nearly spent: enough for
# a release on a database that answers, too little to hold the exit up.
_LAST_STATEMENT = 0.05


class Engine:
    """Runs the flows of one client's callers: their connections, heartbeats, listener and clean-ups.

    Its host (the client's core) hands it what runs its heartbeats and clean-ups (``heartbeats``, which
    makes `_io.heartbeat`'s worker for it): the worker drives the engine, and the engine only
    hands it holds and clean-ups, so neither is built on the other.
    """

    def __init__(
        self,
        host: EngineHost,
        *,
        dsn: str | None,
        pool: ConnectionPool[Any] | None,
        heartbeats: Callable[[Engine], HeartbeatWorker],
    ) -> None:
        self.host = host
        self._source: OwnConnection | PooledConnection
        if dsn is not None:
            self._source = OwnConnection(dsn, host.connect_kwargs("postgres-mutex"))
            self._listener: Listener | None = Listener(host, dsn, host.connect_kwargs("postgres-mutex listener"))
        else:
            assert pool is not None
            self._source = PooledConnection(pool)
            self._listener = None
        self._gate = Gate()
        self.closed = False
        self._pooled = False
        self._heartbeats = heartbeats(self)
        self.keep: Callable[[Hold], None] = self._heartbeats.keep
        """Renew a hold from now on, with the other holds of its table and interval: the worker's own
        method, called with no step of ours between (once per acquire)."""
        self.deadline: float | None = None
        """When set (by the release at interpreter exit), no statement waits past it."""

    # -- running flows -----------------------------------------------------------

    def run(self, flow: steps.Flow[T]) -> T:
        """Drive ``flow`` to its end, performing each step it asks for.

        Whatever is raised while the flow waits for a step, the step's own
        failure or an exception a signal handler raised anywhere in this loop,
        is handed to the flow, which decides: the flow is never left suspended
        with a step's result it did not see (a lock won, say).
        """
        steps = _Steps(self)
        reply: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    while True:
                        if error is None:
                            op = flow.send(reply)
                        else:
                            thrown, error = error, None
                            op = flow.throw(thrown)
                        reply = None
                        reply = steps.perform_now(op)
                        if reply is _WAITS:
                            reply = steps.perform(op)
                except StopIteration as done:  # only the flow raises it: it returned
                    return done.value  # type: ignore[no-any-return]
                except BaseException as exc:
                    if flow.gi_frame is None:  # type: ignore[attr-defined]
                        raise  # the flow ended with it
                    error = exc  # handed to the flow, which decides
        finally:
            steps.finish()
            if flow.gi_frame is not None:  # type: ignore[attr-defined]
                # Left waiting for a step (an exception landed as the loop turned): it ends
                # without more steps; whoever called this undoes what it began (`abandon`).
                flow.close()

    def execute(self, op: steps.Execute) -> steps.Result:
        timeout = op.timeout
        if self.deadline is not None:
            # At exit: no statement may outlast the exit's budget.
            timeout = max(min(timeout, self.deadline - now()), _LAST_STATEMENT)
        cleanup = op.stray_row
        if cleanup is None:
            return self.send(op.statement, op.params, timeout, op.action, op.urgent)
        # A clean-up of any row carrying our id must never cross an acquire of the same
        # Mutex: it takes its turn as it is sent (`send`), and gives it back once answered.
        # Cut off, it keeps the turn until it can no longer land.
        try:
            result = self.send(op.statement, op.params, timeout, op.action, op.urgent, op)
        except DatabaseError as exc:
            if not exc.outcome_unknown:
                cleanup.lock.give_back_cleanup_turn(op)
            raise
        cleanup.lock.give_back_cleanup_turn(op)
        return result

    def send(
        self,
        statement: _sql.Statement,
        params: Mapping[str, object],
        timeout: float,
        action: str,
        urgent: bool = False,
        cleanup_op: steps.Execute | None = None,
    ) -> steps.Result:
        """Run ``statement`` as it is: no exit budget applied, no clean-up turn taken (`execute` does both).

        For a statement that needs neither (an acquire's or a release's, while the process is not
        exiting), sent with its parts rather than an `steps.Execute`: one object fewer per statement.
        ``cleanup_op``: the clean-up of a stray row this statement is (`steps.Execute.stray_row`).
        """
        source = self._source
        connect_retryable = source.connected_before
        sent = False
        conn: psycopg.Connection[Any] | None = None
        cutter: Cutter | None = None
        lost = True
        try:
            asked_at = now()
            try:
                # Inside the try: a signal handler's exception landing as the turn is taken, or just
                # after, still has it given back (`leave` gives back this thread's turn, if it has one).
                self._gate.enter(urgent, timeout)
                source.timeout, source.asked_at = timeout, asked_at
                with source as (conn, cutter):
                    if cleanup_op is not None:
                        cleanup = cleanup_op.stray_row
                        assert cleanup is not None
                        if not cleanup.lock.take_cleanup_turn(cleanup.generation, cleanup_op, timeout):
                            raise steps.CleanupSuperseded  # an acquire began while it waited for the connection
                    sent = True
                    try:
                        if cutter.stores_arm and timeout >= STORE_ARMS:
                            cutter.until = now() + timeout  # armed: the watchdog looks before it is due
                        else:
                            cutter.arm(timeout)
                        pass
                        session, numbered = source.session, statement.numbered
                        if session is not None and numbered is not None and session.direct:
                            # The common statement, inline rather than in `_statement` (a call per
                            # statement is a measurable share of a lock cycle): alone, prepared, on a
                            # direct connection whose session carries its settings, if its deadline fits
                            # theirs: never later (a millisecond of rounding aside), nor much earlier.
                            timeout_ms = _SERVER_MS.get(timeout)
                            if timeout_ms is None:
                                timeout_ms = _server_ms(timeout)
                            kept = session.timeout_ms
                            if kept is not None and timeout_ms * _SESSION_TIMEOUT_FLOOR <= kept <= timeout_ms + 1:
                                cursor = source.cursor or psycopg.RawCursor(conn)
                                if statement.marks:
                                    params = {
                                        **params,
                                        "_session_key": session.key,
                                        "_backend_pid": session.backend_pid,
                                    }
                                values = [params[name] for name in statement.names]
                                sent_at = now()
                                try:
                                    # Prepared on its first use on this connection (one more round trip, once).
                                    cursor.execute(numbered, values, prepare=True)
                                except psycopg.errors.FeatureNotSupported:
                                    return _unprepared(cursor, values, numbered, session)
                                # `_result`, inline.
                                pgresult = cursor.pgresult
                                if pgresult is None or pgresult.status != _TUPLES_OK:
                                    return _new_result(steps.Result, (cursor.rowcount, (), sent_at))
                                rows = tuple(cursor.fetchall())
                                return _new_result(steps.Result, (cursor.rowcount, rows, sent_at))
                        work = _statement(conn, statement, params, timeout, action, session)
                        return work
                    except FAILURES as exc:
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
                            self.host.shapes.forget(statement.table)
                        raise
                    except BaseException:
                        # Interrupted mid-statement: a signal handler's exception (a job
                        # runner's timeout, SIGTERM), or the caller was cancelled.
                        interrupt(conn, cutter, timeout)
                        raise
                    finally:
                        # Whatever was armed, even if an exception landed before its ticket was kept
                        # (disarmed whole: one statement at a time runs on a connection).
                        with cutter.lock:
                            cutter.until = math.inf
            finally:
                self._gate.leave()
        except FAILURES as exc:
            error = classify_failure(
                exc,
                action=action,
                table=statement.table,
                sent=sent,
                timed_out=cutter is not None and cutter.fired,
                connection_lost=lost,
                connect_retryable=connect_retryable,
                redact=self.host.redactor.redact,
                timeout=timeout,
            )
            shown = self.host.redactor.shown_cause(exc)
            if shown is not None:
                raise error from shown
        # psycopg's error held a secret: raised out here, where it is not even
        # the error's __context__ (which `from None` would merely hide).
        raise error

    @property
    def behind_pooler(self) -> bool:
        """Whether a connection of this engine was found to go through a pooler (PgBouncer): once found, for good
        (a new connection to the same DSN goes through it too, and is asked again only by its first acquire). An
        application's pool (``pool=``, ``async_pool=``) is never asked, and may go through one: taken as if it
        did."""
        if isinstance(self._source, PooledConnection):
            return True
        if not self._pooled:
            session = self._source.session
            self._pooled = session is not None and session.direct is False
        return self._pooled

    def shape(self, names: Names, timeout: float, *, fresh: bool = False, urgent: bool = False) -> Statements:
        """The statements for this table's shape; the table is inspected once per client, or again if ``fresh``."""
        statements = None if fresh else self.host.shapes.get(names.table_name)
        if statements is None:
            action = f"lookup of table {names.table_name}"
            op = steps.Execute(_sql.inspect_table(names), {}, timeout, action, urgent)
            row = (self.execute(op)).row
            assert row is not None
            exists, shape = _sql.TableShape.inspected(row)
            if not exists:
                raise SchemaError(
                    phrase(
                        "the lock table {table} does not exist; {call create_schema()} or create it "
                        "as the README shows (names are case-sensitive)",
                        table=names.table_name,
                    ),
                    sqlstate="42P01",
                )
            statements = Statements(names, shape)
            # Told once per client: its engines and flows that find the history gone at once share it.
            if self.host.shapes.learn(statements):
                logger.warning(
                    "the history of lock table %s (%s) is gone, dropped while its locks were in use: "
                    "holds go on without a history; create_schema(history=True) makes a new one",
                    names.table_name,
                    names.history_name,
                )
        return statements

    # -- holds and their heartbeats (the worker's) --------------------------------------

    @property
    def groups(self) -> dict[object, HeartbeatGroup]:
        """The engine's heartbeat groups (the session's record of them)."""
        return self._heartbeats.groups

    def schedule(self, cleanup: steps.Cleanup) -> None:
        """Delete a row that may remain, in the background, as soon as the database answers."""
        self._heartbeats.schedule(cleanup)

    def has_cleanups(self) -> bool:
        return self._heartbeats.has_cleanups()

    def take_cleanups(self) -> list[steps.Cleanup]:
        return self._heartbeats.take_cleanups()

    # -- listening for releases ------------------------------------------------------

    @property
    def listener(self) -> Listener | None:
        return self._listener

    # -- shutting down -----------------------------------------------------------

    def close(self) -> None:
        """Stop the workers and close the engine's connections (never a pool); pending clean-ups go to the client."""
        with self.host.state_lock:
            self.closed = True
        self._heartbeats.stop()
        if self._listener is not None:
            self._listener.close()
        for cleanup in self.take_cleanups():
            self.host.adopt_cleanup(cleanup)
        self._source.close()

    def close_connections(self) -> None:
        """Nothing is held or waited on: close the statement connection (the next statement opens one).

        Not while a statement uses it or waits for it (a Mutex made meanwhile, say): the client is
        not idle then, and a connection is never closed under a statement.
        """
        if self._gate.try_enter():
            try:
                self._source.abandon()
            finally:
                self._gate.leave()

    def abandon(self) -> None:
        """Close the connections without waiting on anything: nothing will run this engine again."""
        self.closed = True
        if self._listener is not None:
            self._listener.abandon()
        self._source.abandon()


def _statement(
    conn: psycopg.Connection[Any],
    statement: _sql.Statement,
    params: Mapping[str, object],
    timeout: float,
    action: str,
    session: ServerSession | None,
) -> steps.Result:
    """A statement `Engine.send` does not send prepared itself: with its settings, bound on the client."""
    # How long the server may run it: less than the client's ``timeout``, by a margin
    # (`_server_ms`), read from what the same deadline gave before: a few deadlines recur.
    timeout_ms = _SERVER_MS.get(timeout)
    if timeout_ms is None:
        timeout_ms = _server_ms(timeout)
    bound = params
    if statement.marks:
        # The session key of this connection (none for a pool's: its sessions are the application's),
        # and the process id it was given, which tells a direct connection from a pooler's.
        if session is None:
            bound = {**bound, "_session_key": None, "_backend_pid": conn.info.backend_pid}
        else:
            bound = {**bound, "_session_key": session.key, "_backend_pid": session.backend_pid}
    settling = lengthening = False
    if session is not None and statement.bare is not None and session.direct is not False:
        # A connection's first lock statement asks whether it reaches PostgreSQL
        # directly and, if so, sets the session up; a statement whose deadline is much
        # longer than the session's sets it again. Either way in the statement's own
        # message, which carries its settings for its transaction: no extra round trip.
        # One whose deadline is shorter (a blocking acquire's counts down) sets it only
        # if the longest deadline still fits it; else it leaves the session's alone: the
        # next statement, with the usual deadline, fits it still and goes prepared, where
        # setting it back would send that one unprepared too.
        kept, longest = session.timeout_ms, session.longest_ms
        lengthening = kept is None or longest is None or kept < timeout_ms * _SESSION_TIMEOUT_FLOOR
        settling = lengthening or (longest is not None and longest * _SESSION_TIMEOUT_FLOOR <= timeout_ms)
    text = statement.text
    if settling:
        text += "; " + _sql.session_setup(conn.info.backend_pid, timeout_ms)
    bound = {**bound, "_server_timeout_ms": timeout_ms}
    # Rows as tuples whatever the row factory of a pool's connections (dict_row, say).
    cursor = psycopg.ClientCursor(conn, row_factory=tuple_row)
    sent_at = now()
    cursor.execute(text, bound)
    if settling and session is not None:
        results = [_result(cursor, sent_at)]
        while cursor.nextset():
            results.append(_result(cursor, sent_at))
        answer, result = results[-1], results[-2]
        session.direct = answer.rows[0][0] is True
        session.timeout_ms = timeout_ms if session.direct else None
        if lengthening:
            session.longest_ms = session.timeout_ms
        _tell_pooler(action, params, session)
        return result
    if session is not None and session.direct is False:
        _tell_pooler(action, params, session)
    # The settings that precede the statement answer first: its own result is the last.
    while cursor.nextset():
        pass
    return _result(cursor, sent_at)


def _server_ms(timeout: float) -> int:
    """The server's deadline (``statement_timeout``, in ms) for a statement the client gives ``timeout`` seconds."""
    timeout_ms = max(1, int((timeout - max(timeout * (1 - _SERVER_SHARE), min(_CLIENT_MARGIN, timeout / 2))) * 1000))
    if len(_SERVER_MS) >= _SERVER_MS_KEPT:
        # Filled by the one-off values of deadlines that count down (blocking acquires): start
        # again, so the recurring ones (each client's operation_timeout) are found again.
        _SERVER_MS.clear()
    _SERVER_MS[timeout] = timeout_ms
    return timeout_ms


_SERVER_MS: dict[float, int] = {}
_SERVER_MS_KEPT = 64


def _tell_pooler(action: str, params: Mapping[str, object], session: ServerSession) -> None:
    """Say once per connection that a hold with ``reclaim_disconnected_after`` falls back behind a pooler."""
    if session.direct is False and not session.pooler_told and params.get("reclaim_seconds") is not None:
        session.pooler_told = True
        logger.warning(
            "%s: this connection goes through a pooler (PgBouncer?), whose server sessions are not this "
            "process's: reclaim_disconnected_after cannot name one, so the hold is not reclaimed early "
            "(it is reclaimed after stale_threshold, as without the option)",
            action,
        )


def _unprepared(
    cursor: psycopg.RawCursor[Any], values: list[object], numbered: str, session: ServerSession
) -> steps.Result:
    """A prepared statement refused with "cached plan must not change result type": it runs again unprepared.

    A column changed type since the statement was prepared (a table made
    again, a wider instance_id). Refused before it ran: it runs again
    unprepared, and the connection is replaced after it (psycopg before 3.3
    would go on using its prepared statements even after a DEALLOCATE ALL); a
    new one prepares afresh.
    """
    session.retired = True
    sent_at = now()
    cursor.execute(numbered, values, prepare=False)
    return _result(cursor, sent_at)


def _result(cursor: psycopg.Cursor[Any], sent_at: float) -> steps.Result:
    result = cursor.pgresult
    rows = cursor.fetchall() if result is not None and result.status == _TUPLES_OK else ()
    return _new_result(steps.Result, (cursor.rowcount, tuple(rows), sent_at))


_TUPLES_OK = pq.ExecStatus.TUPLES_OK

_new_result = tuple.__new__
"""Makes a `steps.Result` (a named tuple) from its three fields in one C call, where its ``__new__`` is Python."""

_WAITS = object()
"""What `_Steps.perform_now` returns for a step that must wait."""


class _Steps:
    """Performs the steps of one flow run; remembers what the run subscribed to."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._subscription: Subscription | None = None
        self._won = False  # the waiter of the subscription got the lock (its listener stays registered a while)

    def perform_now(self, op: steps.Op) -> Any:
        """Perform ``op`` if it needs no waiting (most steps of a cycle); else return `_WAITS`."""
        engine = self._engine
        if isinstance(op, steps.Execute):
            return _WAITS
        if isinstance(op, steps.Shape):
            statements = None if op.fresh else engine.host.shapes.get(op.names.table_name)
            return _WAITS if statements is None else statements
        if isinstance(op, steps.Keep):
            engine.keep(op.hold)
            self._won = self._subscription is not None
            return None
        if isinstance(op, steps.Forget):
            engine.host.session.forget(op.hold)
            return None
        if isinstance(op, steps.Tell):
            lock, error = op.lock, op.error
            engine.host.session.post(lambda: lock.events.lost(error))
            return None
        if isinstance(op, steps.Schedule):
            engine.schedule(op.cleanup)
            return None
        if isinstance(op, steps.StopListening):
            self.finish()
            return None
        if isinstance(op, steps.Releasing):
            listener = engine.listener
            return None if listener is None else listener.releasing(op.channel) or 0
        return _WAITS

    def perform(self, op: steps.Op) -> Any:
        """Perform a step that waits: a statement, an inspection, a pause, a wait for a release."""
        engine = self._engine
        if isinstance(op, steps.Execute):
            subscription, listener = self._subscription, engine.listener
            if listener is not None and "wait_id" in op.params:  # a fair lock's waiter's attempt
                params = op.params
                wait_id = listener.in_line_as(str(params["channel"]), str(params["wait_id"]))
                op = dataclasses.replace(op, params={**params, "wait_id": wait_id})
            if subscription is None or listener is None:
                return engine.execute(op)
            took_wake = listener.take_wake(subscription)
            try:
                return engine.execute(op)
            except BaseException:
                if took_wake:
                    # The attempt that used a release's wake-up told nothing: another waiter tries instead.
                    listener.wake_one(subscription.channel)
                raise
        if isinstance(op, steps.Shape):
            return engine.shape(op.names, op.timeout, fresh=op.fresh, urgent=op.urgent)
        if isinstance(op, steps.Pause):
            sleep(op.seconds)
            return not engine.closed
        if isinstance(op, steps.Listen):
            listener = engine.listener
            if listener is None:
                return False
            self._subscription = listener.subscribe(op.channel, op.who, op.since, one_hold=op.one_hold)
            if self._subscription.heard:
                return False  # listened on since before the last attempt, and nothing heard: it saw every release
            return self._subscription.confirmed.wait(op.timeout)
        assert isinstance(op, steps.WaitForRelease)
        subscription, listener = self._subscription, engine.listener
        if subscription is None or listener is None:
            # A stop (an election's), set from any thread, ends the wait.
            wake = Event()
            with contextlib.nullcontext() if op.stop is None else op.stop.waking(wake.set):
                wake.wait(op.seconds)
            return None
        # A release wakes the wait, and so does a stop.
        stop = op.stop
        with contextlib.nullcontext() if stop is None else stop.waking(functools.partial(listener.wake, subscription)):
            listener.wait(subscription, op.seconds)
            while op.shared_until is not None and not subscription.released.is_set():
                # Another waiter of this process attempted during the pause: that was this pause's poll.
                left = min(listener.poll_due(subscription, op.seconds), op.shared_until - now())
                if left <= 0:
                    break
                listener.wait(subscription, left)
        handed = listener.take_handed(subscription)
        if handed is not None:
            return handed  # a fair lock handed to this waiter: the flow takes it without an attempt
        # The next attempt clears the wake-up (`Listener.take_wake`): a release announced between
        # this wait's end and that attempt must still end the wait after it.
        return None

    def finish(self) -> None:
        subscription, self._subscription = self._subscription, None
        listener = self._engine.listener
        won, self._won = self._won, False
        if subscription is not None and listener is not None:
            listener.unsubscribe(subscription, holding=won)
            if subscription.woken and not (won and subscription.one_hold):
                # Woken, but leaving without an attempt that used it (acquired meanwhile, stopped,
                # out of time): the freed hold may still be free, so another waiter tries. Not when
                # this waiter took the lock's one hold: that wake-up told of what its attempt saw.
                listener.wake_one(subscription.channel)
