"""What ``acquire_async()`` returns, and the fence a hold puts in the caller's own transaction.

`AsyncAcquisition` is the ``async with`` block: acquire on entering, release
on leaving, whichever way the block ends. `fence_async` checks, in one round
trip on the caller's connection, that a hold is still the lock's current one.
"""

from __future__ import annotations

# async-only
import asyncio

# end async-only
import logging
from collections.abc import Callable
from datetime import datetime
from logging import DEBUG
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from .._base.acompat import ato_the_end, current_owner
from .._base.clock import now
from .._base.connections import FAILURES
from .._base.watchdog import Cutter
from .._observe.tracing import NO_SPAN, NO_SPAN_CONTEXT
from .._state import flows, steps
from .._state.locks import LEASE_EXPIRED, RELEASED_ELSEWHERE, Hold, HoldStatus, LockState, Phase
from .._state.outcome import AcquireResult, Outcome, interpret_acquire
from ..errors import DatabaseError, LockNotHeldError, MutexError, OperationTimeout, SchemaError, phrase

if TYPE_CHECKING:
    from .engine_async import AsyncEngine

logger = logging.getLogger("postgres_mutex")


class AsyncAcquisition:
    """Acquire on entering the block, release on leaving it; enter it once.

    Entering yields whether the lock was acquired (a blocking acquire that
    runs out of time raises `LockAcquisitionTimeout` instead, so the body
    never runs unlocked). Leaving releases the lock, whichever way the block
    ends; if the lock was lost meanwhile (or released elsewhere in the process
    while the block ran), a normal exit raises `LockNotHeldError`. An
    acquisition that is entered and never left keeps the lock until
    ``release()``.

    Made by `Mutex.acquire_async`, not by hand: its ``engine`` gives the
    engine each step runs on (refusing, with the error the user sees, for a
    closed client or a forked child).
    """

    def __init__(
        self,
        engine: Callable[[], AsyncEngine],
        lock: LockState,
        *,
        blocking: bool,
        timeout: float | None,
        stop: steps.StopSignal | None = None,
        hold_at_least: float | None = None,
    ) -> None:
        self._engine = engine
        self._lock = lock
        self._blocking = blocking
        self._timeout = timeout
        self._stop = stop
        self._hold_at_least = hold_at_least
        self._entered = False
        self._hold: Hold | None = None
        self._engine_in_use: AsyncEngine | None = None
        """The engine the block was entered on, resolved once: its release runs there too."""
        self._acquirer = object()
        """Names this acquire to the lock's state, which ends it for nobody else."""

    async def __aenter__(self) -> bool:
        if self._entered:
            raise MutexError("this acquisition was entered already: call acquire() again for another one")
        self._entered = True
        # The engine of the lock's last acquire, while it stays open (and serves this loop): resolved
        # once, not per acquire. Else resolved anew, refusing as the user must be refused (a closed
        # client; a forked child, whose locks forget it: `LockState.reset_after_fork`).
        lock = self._lock
        # async-only
        engine = lock.async_engine
        if engine is None or engine.closed or engine.host.closed or engine.loop is not asyncio.get_running_loop():
            engine = lock.async_engine = self._engine()
        # end async-only
        # sync-only
        # engine = lock.engine
        # if engine is None or engine.closed or engine.host.closed:
        #     engine = lock.engine = self._engine()
        # end sync-only
        self._engine_in_use = engine
        # The acquire: its first attempt in plain calls, the flow (`flows.acquire`) for anything but a win.
        # An uncontended acquire is one statement, and the flow's steps would cost more than its round
        # trip; whatever else happens (the lock busy, a failure, a clean-up of ours on the wire, a table
        # not inspected yet, a span that records, a semaphore or a read/write lock, an election's stop, a
        # minimum hold, whose table's shape is checked first) is the flow's, which takes the attempt over
        # where it stands. Here rather than in a method of its own: a call per acquire is a measurable
        # share of a lock cycle.
        try:
            owner = current_owner()
            statements = engine.host.shapes.get(lock.names.table_name)
            if (
                statements is None
                or not lock.kind.direct
                or self._stop is not None
                or engine.deadline is not None
                or self._hold_at_least is not None
                or not lock.tracing.silent()
                or (self._blocking and lock.gave_way_at is not None)
            ):
                self._hold = await engine.run(self._flow(owner, None))
                return self._hold is not None
            generation = lock.begin_acquire(self._acquirer)
            started = now()
            flowed = False
            outcome = "cancelled"
            result: AcquireResult | None = None
            attempts = 0
            try:
                # `flows.budget` and `flows.statement_timeout`, their common case inline: a non-blocking
                # acquire's first statement (or a wait with no limit's) gets one operation_timeout.
                timeout = lock.timing.operation_timeout
                if self._blocking and self._timeout is not None:
                    timeout = flows.statement_timeout(lock, started + self._timeout)
                if lock.cleanup_sender is not None:  # a clean-up of ours may be on the wire
                    flowed = True
                    self._hold = await engine.run(
                        self._flow(owner, flows.FirstAttempt(generation, started, statements, timeout, False, None))
                    )
                    return self._hold is not None
                if lock.timing.reclaim_disconnected_after is not None and not statements.shape.sessions:
                    lock.events.sessions_unnamed(lock.names.table_name)
                kind = lock.kind
                plain = statements.acquire_plain
                if plain is not None and lock.timing.reclaim_disconnected_after is None and not kind.queues:
                    # No session to name and no minimum hold: the statement that binds only what it reads.
                    statement, params = plain, lock.plain_acquire_params
                elif not kind.queues:
                    statement, params = statements.acquire, lock.params()
                elif kind.migrated(statements):
                    # A fair lock's: its attempt also queues it, under this acquire's name, if it does not win.
                    statement, params = kind.acquire_statement(statements, lock.lock_name), lock.params()
                    params["wait_id"] = flows.wait_id(lock, generation)
                    if engine.listener is not None:  # its process's slot, if registered there (`_sql.fair.at_slot`)
                        params["wait_id"] = engine.listener.in_line_as(lock.channel, str(params["wait_id"]))
                else:
                    # Its table may have been migrated since it was inspected: the flow looks again.
                    flowed = True
                    self._hold = await engine.run(
                        self._flow(owner, flows.FirstAttempt(generation, started, statements, timeout, False, None))
                    )
                    return self._hold is not None
                possible_before = lock.attempt_sent()
                attempts = 1
                reply: steps.Result | DatabaseError
                try:
                    reply = await engine.send(statement, params, timeout, lock.acquire_action)
                except DatabaseError as exc:
                    reply = exc
                except BaseException:
                    # Interrupted mid-statement (cancelled, a signal's exception): it may still land.
                    lock.attempt_unanswered(timeout)
                    raise
                if isinstance(reply, steps.Result):
                    # A direct kind's reply: a mutex's five columns (`read_acquire` without a count),
                    # ``(inserted, holder, heartbeat_age, acquired_at, token)``.
                    row = reply.rows[0] if reply.rows else None
                    if (
                        row is not None
                        and len(row) == 5
                        and row[0] is True
                        and type(row[3]) is datetime
                        and (row[4] is None or (type(row[4]) is int and statements.shape.tokens))
                        and lock.events.quiet
                    ):
                        # Inserted, and no hook to tell: read in place, as `interpret_acquire` reads it
                        # (`Outcome.ACQUIRED`), without making its result.
                        hold = lock.won(
                            acquired_at=row[3],
                            token=row[4],
                            sent_at=reply.sent_at,
                            owner=owner,
                            span_context=NO_SPAN_CONTEXT,
                            plain=True,
                        )
                        if logger.isEnabledFor(DEBUG):  # its log line (`LockEvents.acquired`)
                            lock.events.acquired(
                                NO_SPAN,
                                AcquireResult(Outcome.ACQUIRED, None, None, row[3], row[4]),
                                expected_own_row=possible_before,
                            )
                        engine.keep(hold)
                        outcome = "acquired"
                        self._hold = hold
                        return True
                    result = interpret_acquire(row, lock.instance_id)
                    # A reply that won carries its acquired_at (a contended one never does).
                    if result.acquired_at is not None and (statements.shape.tokens or result.token is None):
                        hold = lock.won(
                            acquired_at=result.acquired_at,
                            token=result.token,
                            sent_at=reply.sent_at,
                            owner=owner,
                            span_context=NO_SPAN_CONTEXT,
                            plain=True,
                        )
                        events = lock.events
                        if not events.quiet or result.outcome is not Outcome.ACQUIRED or logger.isEnabledFor(DEBUG):
                            # Else skipped as `LockEvents.acquired` would skip it: no hook, no span, no log line.
                            events.acquired(NO_SPAN, result, expected_own_row=possible_before)
                        engine.keep(hold)
                        outcome = "reclaimed" if result.outcome is Outcome.RECLAIMED else "acquired"
                        self._hold = hold
                        return True
                flowed = True
                first = flows.FirstAttempt(generation, started, statements, timeout, possible_before, reply)
                self._hold = await engine.run(self._flow(owner, first))
                return self._hold is not None
            except Exception:
                outcome = "error"
                raise
            finally:
                if not flowed and not lock.events.quiet:  # else `acquire_ended` tells nobody
                    lock.events.acquire_ended(
                        NO_SPAN,
                        outcome,
                        attempts=attempts,
                        waited=now() - started,
                        holder=None if result is None else result.holder,
                    )
        except BaseException:
            # Raised before the block got the hold, wherever it landed (a signal handler's exception
            # after the acquire returned, say): the block will never release it.
            self._hold = None
            await engine.run(flows.abandon(self._lock, self._acquirer))
            raise

    def _flow(self, owner: object, first: flows.FirstAttempt | None) -> steps.Flow[Hold | None]:
        return flows.acquire(
            self._lock,
            self._lock.tracing,
            blocking=self._blocking,
            timeout=self._timeout,
            owner=owner,
            acquirer=self._acquirer,
            stop=self._stop,
            first=first,
            hold_at_least=self._hold_at_least,
        )

    def __bool__(self) -> bool:
        # Truthy, as every object is by default, it would let `if mutex.acquire():` run its body unlocked.
        raise TypeError(
            "an acquisition takes the lock when its block is entered, and is not a bool: "
            "write `async with mutex.acquire_async() as acquired:`"  # sync: "write `with mutex.acquire() as acquired:`"
        )

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        hold = self._hold
        if hold is None:
            return
        lock = self._lock
        if lock.hold is hold and lock.phase is Phase.HOLDING:
            engine = self._engine_in_use
            if engine is None or engine.closed:
                engine = self._engine()  # refuses as it would have at entry (a closed client, say)
            # Run to its end even if the caller is cancelled again meanwhile: no row left behind.
            if exc_type is None:
                # async-only
                await ato_the_end(_release(engine, lock, current_owner()))
                # end async-only
                # sync-only
                # _release(engine, lock, current_owner())  # a thread runs it to its end as it is
                # end sync-only
                return
            try:
                await ato_the_end(_release(engine, lock, current_owner()))
            except MutexError as error:
                # The block's own exception is what the caller must see.
                logger.warning("while leaving the block after an error: %s", error)
            return
        if exc_type is None and hold.reason in (RELEASED_ELSEWHERE, LEASE_EXPIRED):
            raise hold.error()


async def _release(engine: AsyncEngine, lock: LockState, caller: object) -> bool:
    """The release: its statement in plain calls, the flow (`flows.release`) for anything but a row deleted.

    Whatever else happens (the hold lost or its lease run out, a failure, the
    row gone, a span that records, a semaphore or a read/write lock, the
    process exiting) is the flow's, which takes the release over where it
    stands. An exception raised into it, wherever it lands, leaves the row to
    the background, as the flow would.
    """
    statements = engine.host.shapes.get(lock.names.table_name)
    kind = lock.kind
    if statements is None or not kind.direct or engine.deadline is not None or not lock.tracing.silent():
        return await engine.run(flows.release(lock, lock.tracing, caller=caller))
    releaser = object()
    settled = False  # the row's fate is known: deleted, gone, or the flow's to settle
    flowed = False
    try:
        hold = lock.begin_release(caller, releaser)
        if hold is None or hold.status is not HoldStatus.ENDED:
            flowed = True
            return await engine.run(flows.release(lock, lock.tracing, caller=caller, began=(hold, releaser)))
        engine.host.session.forget(hold)
        plain = statements.release_plain
        if plain is not None and hold.plain and not kind.queues:
            # No minimum hold to keep the row for: a DELETE of it, binding only what it reads.
            statement, params = (
                plain,
                {
                    "lock_name": hold.row_name,
                    "instance_id": lock.instance_id,
                    "acquired_at": hold.acquired_at,
                    "channel": lock.channel,
                },
            )
        else:
            statement, params = kind.release_statement(statements), lock.params()
        listener = engine.listener
        # The release wakes a waiter of another process, not this one's lingering registration.
        params["own_slot"] = None if listener is None else listener.releasing(lock.channel)
        try:
            result = await engine.send(statement, params, lock.timing.operation_timeout, lock.release_action)
        except DatabaseError as exc:
            flowed = True
            return await engine.run(flows.release(lock, lock.tracing, caller=caller, began=(hold, releaser), first=exc))
        settled = True
        if result.rowcount <= 0:
            flowed = True
            return await engine.run(
                flows.release(lock, lock.tracing, caller=caller, began=(hold, releaser), first=result)
            )
        if listener is not None and result.rows and not kind.queues:
            # The channel it notified: a slot's (`_sql.wake`) if it woke another process's waiter.
            lock.released_and_woke(result.rows[0][0], result.sent_at)
        events = lock.events
        if not events.quiet or logger.isEnabledFor(DEBUG):  # else `released` tells nobody
            events.released(NO_SPAN, deleted=True)
        return True
    finally:
        # Whichever way it ended, and wherever an exception landed: the hold it began to release
        # (None once the flow, if it ran, ended the release itself).
        begun = lock.end_release(releaser)
        if begun is not None and not settled:
            # Interrupted before the row's fate was known: it may remain. Delete it later.
            engine.host.session.forget(begun)
            engine.schedule(flows.scoped_cleanup(lock, begun))
        if not flowed and (lock.stray_row_possible or now() < lock.stray_row_may_land_until):
            # An unanswered acquire of ours may still land: sweep after it no longer can.
            engine.schedule(flows.stray_row_cleanup(lock, lock.generation))


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
            phrase(
                "lock {lock!r} was acquired without a fencing token: the lock table {table} has no token column. "
                "Run {LockTable.migrate()}; the lock's next acquire gets a token",
                lock=lock.lock_name,
                table=lock.names.table_name,
            )
        )
    if conn.info.transaction_status == pq.TransactionStatus.IDLE and conn.autocommit:
        raise ValueError(
            "fence() needs an open transaction on conn: call it inside 'with conn.transaction():' "
            "(or with autocommit off), before the writes it protects"
        )
    params = {
        "lock_name": hold.row_name,
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
        # The caller's connection may read rows as dicts (row_factory=dict_row): this row is read by position.
        cursor = conn.cursor(row_factory=tuple_row)
        await cursor.execute(lock.names.fence, params, prepare=False)
        row = await cursor.fetchone()
    except FAILURES as exc:
        if not cutter.fired:
            raise
        raise OperationTimeout(
            f"fencing {lock.kind} {lock.lock_name!r} did not finish within operation_timeout ({timeout:g}s): "
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
            f"{lock.kind} {lock.lock_name!r} changed hands: the hold with token {hold.token} is no longer current "
            f"({now_held}); roll back the writes of this transaction",
            lock_name=lock.lock_name,
            instance_id=lock.instance_id,
            reason=FENCE_REJECTED,
        )
    return int(row[0])


FENCE_REJECTED = "fenced out: the lock changed hands (reclaimed, force-released, or its row was lost)"
