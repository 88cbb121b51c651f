"""`Election`: one leader at a time among the replicas of a long-running service.

One lock of the lock table per election, named after it: the leader is the
lock's holder, with the Mutex's heartbeats, lease, fencing tokens, metrics
and spans. `Election.run` campaigns (waits for the lock, woken at once by
the holder's release), calls ``lead(leadership)`` while it leads, releases
the lock when ``lead`` returns, and campaigns again, until `Election.stop`::

    election = Election(dsn, "scheduler")

    def lead(leadership):
        while not leadership.ended.wait(1.0):
            run_due_jobs(token=leadership.token)

    election.run(lead)  # until election.stop(), from a signal handler say

What it promises:

- A term's lock is released only once its ``lead`` has returned, so two
  ``lead`` calls of one election never overlap while their processes keep
  their leases; the tokens of successive terms strictly increase.
- Leadership lost (the lease ran out, or the row was deleted or taken over)
  is told to ``lead`` at once: `Leadership.ended` is set, `ensure_held`
  raises, an async ``lead`` is cancelled. The lease runs out one heartbeat
  interval before anyone may reclaim the lock, so a ``lead`` that returns
  within that interval has stopped before its successor can start.
- ``stop()`` and ``resign()`` hand over at once: ``lead`` is told, the lock
  is released the moment it returns, and the next candidate is woken by that
  release rather than after ``stale_threshold``.

What it cannot promise: a thread cannot be stopped from outside, so a
``lead`` that ignores the news runs on; past ``grace_period`` the election
says so loudly (an error log, the ``election_grace_overrun`` metrics call, an
event on the term's span) but cannot end it. A process paused (GC, SIGSTOP,
a frozen VM) is told nothing until it runs again, and an operator's forced
release lets the next leader start before the old one hears of it. Writes
that must never come from a former leader need fencing: `Leadership.fence`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _steps as steps
from ._clock import now
from ._events import ElectionEvents
from ._metrics import LockObservation, guard
from ._mutex import Mutex, candidacy
from ._relay import Relay
from ._settings import check_name, check_seconds
from ._state import HoldStatus
from ._term import Flag, Leadership, Term, TermPolicy
from ._tracing import INSTANCE_ID, LOCK_NAME
from .errors import DatabaseError, LockNotHeldError, MutexError
from .table import LockTable

if TYPE_CHECKING:
    from opentelemetry.trace import Span, TracerProvider
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from ._acquisition import Acquisition
    from ._acquisition_async import AsyncAcquisition
    from .client import MutexClient

__all__ = ["Election", "Flag", "Leader", "Leadership"]

logger = logging.getLogger("postgres_mutex")

TERM_SPAN = "postgres_mutex.election.term"

_STOPPED = "stop() was called"
_RESIGNED = "resign() was called"

Lead = Callable[["Leadership"], object]
AsyncLead = Callable[["Leadership"], Awaitable[object]]


@dataclass(frozen=True)
class Leader:
    """Who leads an election now, as the lock table says, timed by the server's clock."""

    instance_id: str
    """The leader's id (its `Election.instance_id`)."""
    token: int | None
    """The fencing token of its term (None on a table without tokens)."""
    seconds_held: float
    """How long it has led."""
    seconds_since_heartbeat: float
    """Seconds since its last heartbeat."""
    alerting: bool
    """Silent for ``alert_threshold`` or longer: slow, or dead? (Past ``stale_threshold`` there is no leader.)"""


class Election:
    """A leader election among the processes that run it with the same name, on one lock of the lock table.

    Takes the `Mutex`'s options (connection: ``dsn``, ``pool``,
    ``async_pool`` or ``client``; ``instance_id``, ``table``, the thresholds,
    ``operation_timeout``, ``metrics``, ``tracer_provider``) and three of its own:

    - ``grace_period``: how long ``lead`` may take to return once told to end
      before the election reports an overrun (default: ``heartbeat_interval``,
      the time between a lost lease and the moment another candidate may
      reclaim the lock);
    - ``failure_backoff`` and ``max_failure_backoff``: after ``lead`` raises,
      the candidate waits ``failure_backoff`` seconds before campaigning
      again, doubling after each consecutive failure up to the cap. The
      back-off is this candidate's own: it resigns while it waits, so another
      candidate may lead at once (with N candidates whose ``lead`` keeps
      failing, up to N terms begin per back-off).

    One `run` (or `run_async`) at a time per Election. Raises `TypeError` or
    `ValueError`, naming the argument, on bad input.
    """

    def __init__(
        self,
        dsn: str | None = None,
        name: str | None = None,
        *,
        pool: ConnectionPool[Any] | None = None,
        async_pool: AsyncConnectionPool[Any] | None = None,
        client: MutexClient | None = None,
        instance_id: str | None = None,
        table: str = "mutex_lock",
        heartbeat_interval: float = 10.0,
        alert_threshold: float = 30.0,
        stale_threshold: float = 600.0,
        poll_interval: float = 0.5,
        operation_timeout: float | None = None,
        metrics: object | None = None,
        tracer_provider: TracerProvider | None = None,
        grace_period: float | None = None,
        failure_backoff: float = 1.0,
        max_failure_backoff: float = 60.0,
    ) -> None:
        if name is None:
            raise TypeError("Election() needs a name: Election(dsn, 'scheduler')")
        check_name(name, "name")
        grace = None if grace_period is None else check_seconds(grace_period, "grace_period")
        backoff = check_seconds(failure_backoff, "failure_backoff")
        max_backoff = check_seconds(max_failure_backoff, "max_failure_backoff")
        if max_backoff < backoff:
            raise ValueError(
                f"max_failure_backoff ({max_backoff:g}s) must not be shorter than failure_backoff ({backoff:g}s)"
            )
        self._mutex = Mutex(
            dsn,
            name,
            pool=pool,
            async_pool=async_pool,
            client=client,
            instance_id=instance_id,
            table=table,
            heartbeat_interval=heartbeat_interval,
            alert_threshold=alert_threshold,
            stale_threshold=stale_threshold,
            poll_interval=poll_interval,
            operation_timeout=operation_timeout,
            metrics=metrics,
            tracer_provider=tracer_provider,
            on_lost=self._on_lost,
        )
        self._candidacy = candidacy(self._mutex)
        config = self._mutex.config
        self._grace = config.heartbeat_interval if grace is None else grace
        self._policy = TermPolicy(backoff, max_backoff, rejoin_pause=max(0.25, 2 * config.poll_interval))
        self._table = LockTable(client=self._mutex.client, table=table, operation_timeout=config.operation_timeout)
        self._events = ElectionEvents(
            lock_name=name, instance_id=self._mutex.instance_id, hook=guard(metrics), grace_period=self._grace
        )
        self._stop = steps.StopSignal()
        self._stopped = threading.Event()
        # Set by stop() itself: a plain flag, as a signal handler may set it.
        self._stop_requested = False
        self._relay: Relay | None = None
        self._running = threading.Lock()
        self._term: Term | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._close_when_done = False

    # -- introspection -------------------------------------------------------------

    @property
    def name(self) -> str:
        """The election's name: the name of its lock in the table."""
        return self._mutex.lock_name

    @property
    def instance_id(self) -> str:
        """This candidate's id, as the table (and `leader`) shows it while it leads."""
        return self._mutex.instance_id

    @property
    def grace_period(self) -> float:
        return self._grace

    @property
    def leading(self) -> bool:
        """True while this candidate leads and its term has not been told to end. Never touches the database."""
        term = self._term
        return term is not None and term.leadership.held

    @property
    def leadership(self) -> Leadership | None:
        """The current term, while ``lead`` runs (None otherwise)."""
        term = self._term
        return None if term is None else term.leadership

    @property
    def stopped(self) -> bool:
        """True once `stop` was called: an Election does not campaign again after it."""
        return self._stop_requested

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else "leading" if self.leading else "not leading"
        return f"<Election name={self.name!r} instance_id={self.instance_id!r} {state}>"

    # -- campaigning -----------------------------------------------------------------

    def run(self, lead: Lead) -> None:
        """Campaign, call ``lead(leadership)`` during each term, and campaign again; until `stop`.

        ``lead`` runs in the calling thread. When it returns, the term is
        given up: the lock is released and the candidate campaigns again
        after a short pause (so another candidate, woken by the release,
        takes over first). When it raises, the error is logged and counted,
        the lock released, and the candidate waits ``failure_backoff``
        (doubling, up to ``max_failure_backoff``) before campaigning again.
        When the term must end (lost, `stop`, `resign`), `Leadership.ended`
        is set and ``lead`` must return within ``grace_period``.

        Returns once stopped, at once if it is waiting for the lock, or as
        soon as ``lead`` returns. Raises `DatabaseError` for a failure that
        waiting cannot cure (a missing table, a missing privilege), and
        `MutexError` if this Election is running already. KeyboardInterrupt
        (or any exception a signal handler raises) ends the term, releases
        the lock and propagates.
        """
        if not callable(lead):
            raise TypeError(f"lead must be callable, not {type(lead).__name__}")
        if inspect.iscoroutinefunction(lead):
            raise TypeError("lead is a coroutine function: use 'await election.run_async(lead)'")
        self._enter()
        try:
            self._events.started()
            while not self._stop_requested:
                pause = self._serve(lead)
                if pause is None:
                    break
                if pause > 0:
                    self._stopped.wait(pause)
        finally:
            self._events.stopped()
            self._leave()
            if self._close_when_done:
                self._mutex.close()
            self._running.release()
            self._close_if_asked_meanwhile()

    def _serve(self, lead: Lead) -> float | None:
        """Campaign, then one term; returns the pause before the next campaign, None once stopped."""
        acquisition = self._candidacy.campaign(self._stop)
        if not acquisition.__enter__():
            return None
        if self._stop_requested:  # won just as stop() came: no term
            self._release(acquisition, None)
            return None
        with self._candidacy.lock.tracing.span(TERM_SPAN, self._span_attributes()) as span:
            term = self._begin(span)
            watch = self._watch(term)
            error: BaseException | None = None
            misuse: TypeError | None = None
            try:
                result = lead(term.leadership)
            except BaseException as exc:
                error = exc
                if not isinstance(exc, Exception):
                    term.end("stopped", f"the run was interrupted ({type(exc).__name__})")
            else:
                if inspect.isawaitable(result):
                    _discard(result)
                    misuse = TypeError("lead returned an awaitable: use 'await election.run_async(lead)'")
                    term.end("stopped", "lead is async")
            told = term.ending
            term.finish()
            watch.join()
            self._release(acquisition, term)
            pause = self._conclude(term, told, error)
            if misuse is not None:
                raise misuse
            if error is not None and not isinstance(error, Exception):
                raise error
            return pause

    def _release(self, acquisition: Acquisition, term: Term | None) -> None:
        try:
            acquisition.__exit__(None, None, None)
        except LockNotHeldError as exc:
            if term is not None:
                term.end("lost", f"leadership was lost: {exc.reason}")
        except DatabaseError as exc:
            self._events.release_failed(exc)

    async def run_async(self, lead: AsyncLead) -> None:
        """Async `run`: ``lead`` is a coroutine function, run as a task of its own.

        When the term must end (lost, `stop`, `resign`), that task is
        cancelled and `Leadership.ended` is set; it must finish within
        ``grace_period``. Cancelling the task awaiting `run_async` ends the
        term the same way, releases the lock, and stops campaigning.
        """
        if not callable(lead):
            raise TypeError(f"lead must be callable, not {type(lead).__name__}")
        self._enter()
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        try:
            self._events.started()
            while not self._stop_requested:
                pause = await self._serve_async(lead)
                if pause is None:
                    break
                if pause > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), pause)
        finally:
            self._events.stopped()
            self._leave()
            self._loop = self._wakeup = None
            if self._close_when_done:
                await self._mutex.aclose()
            self._running.release()
            if self._close_when_done and self._running.acquire(blocking=False):
                # close() came after the check above, and found the run still going.
                try:
                    await self._mutex.aclose()
                finally:
                    self._running.release()

    async def _serve_async(self, lead: AsyncLead) -> float | None:
        acquisition = self._candidacy.campaign_async(self._stop)
        if not await acquisition.__aenter__():
            return None
        if self._stop_requested:
            await self._release_async(acquisition, None)
            return None
        with self._candidacy.lock.tracing.span(TERM_SPAN, self._span_attributes()) as span:
            term = self._begin(span)
            error: BaseException | None = None
            interrupted: BaseException | None = None
            task: asyncio.Future[Any] | None = None
            try:
                work: object = lead(term.leadership)
            except Exception as exc:
                error = exc
            else:
                if inspect.isawaitable(work):
                    task = term.task = asyncio.ensure_future(work)
                else:
                    interrupted = TypeError("lead is not async: use election.run(lead) for a plain function")
                    term.end("stopped", "lead is not async")
            watch = self._watch(term)
            if task is not None:
                try:
                    await asyncio.wait([task])
                except asyncio.CancelledError as exc:  # the task running run_async was cancelled
                    interrupted = exc
                    term.end("stopped", "run_async was cancelled")
                    task.cancel()
                    await asyncio.wait([task])
                if not task.cancelled():
                    error = task.exception()
                elif term.ending is None:
                    error = asyncio.CancelledError("lead's task was cancelled, not by the election")
            told = term.ending
            term.finish()
            # To the end even if this task is cancelled again meanwhile: the lock must not stay held.
            hand_over = asyncio.ensure_future(self._hand_over_async(watch, acquisition, term))
            while not hand_over.done():
                try:
                    await asyncio.wait([hand_over])
                except asyncio.CancelledError as exc:
                    interrupted = interrupted or exc
            hand_over.result()
            pause = self._conclude(term, told, error)
            if interrupted is not None:
                raise interrupted
            if error is not None and not isinstance(error, Exception | asyncio.CancelledError):
                raise error
            return pause

    async def _hand_over_async(self, watch: threading.Thread, acquisition: AsyncAcquisition, term: Term) -> None:
        await asyncio.to_thread(watch.join)  # it has only to finish reporting: a moment
        await self._release_async(acquisition, term)

    async def _release_async(self, acquisition: AsyncAcquisition, term: Term | None) -> None:
        try:
            await acquisition.__aexit__(None, None, None)
        except LockNotHeldError as exc:
            if term is not None:
                term.end("lost", f"leadership was lost: {exc.reason}")
        except DatabaseError as exc:
            self._events.release_failed(exc)

    # -- what run and run_async share ------------------------------------------------

    def _enter(self) -> None:
        if not self._running.acquire(blocking=False):
            raise MutexError(f"election {self.name!r} is running already: one run() or run_async() at a time")
        # Started here, never in stop(): a signal handler may not start a thread.
        self._relay = Relay(self._stop_now, self._resign_now)

    def _leave(self) -> None:
        relay, self._relay = self._relay, None
        if relay is not None:
            relay.close()

    def _close_if_asked_meanwhile(self) -> None:
        # close() came after run's own check, and found the run still going: close now.
        if self._close_when_done and self._running.acquire(blocking=False):
            try:
                self._mutex.close()
            finally:
                self._running.release()

    def _span_attributes(self) -> dict[str, str | bool | int | float]:
        return {LOCK_NAME: self.name, INSTANCE_ID: self.instance_id}

    def _begin(self, span: Span) -> Term:
        hold = self._candidacy.lock.hold
        assert hold is not None
        term = Term(self._mutex, self._candidacy.lock, hold, span)
        self._term = term
        self._events.term_began(span, hold.token)
        if not hold.held:  # lost before the term was there to hear of it
            term.end("lost", "leadership was lost: " + (hold.reason or "its lease ran out"))
        if self._stop_requested:
            term.end("stopped", _STOPPED)
        return term

    def _watch(self, term: Term) -> threading.Thread:
        """A thread that tells the term's end (and an async ``lead``'s task) and watches the grace period."""
        watch = threading.Thread(target=self._watch_term, args=(term,), name="postgres-mutex-election", daemon=True)
        watch.start()
        return watch

    def _watch_term(self, term: Term) -> None:
        term.wake.wait()
        ending, reason = term.ending, term.reason
        if ending is None or reason is None:
            return  # lead returned on its own
        self._events.ending(term.span, ending, reason)
        task, loop = term.task, self._loop
        if task is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the task is gone with it
                loop.call_soon_threadsafe(task.cancel)
        if term.returned.wait(self._grace):
            return
        self._events.grace_overrun(term.span, now() - term.ended_at, reason)
        term.returned.wait()
        self._events.returned_late(now() - term.ended_at)

    def _conclude(self, term: Term, told: str | None, error: BaseException | None) -> float:
        ended = self._policy.ended(term, told, error)
        pause = self._policy.pause_after(ended)
        if error is not None and isinstance(error, Exception | asyncio.CancelledError):
            if ended == "failed":
                self._events.lead_failed(term.span, error, pause)
            elif not isinstance(error, asyncio.CancelledError):
                self._events.raised_after_end(error)
        self._term = None
        self._events.term_ended(term.span, ended, now() - term.began, term.hold.token)
        return pause

    def _on_lost(self, error: LockNotHeldError) -> None:
        """The Mutex lost its lock (on the client's event thread): tell the term it belongs to, at once."""
        term = self._term
        if term is not None and term.hold.status is HoldStatus.LOST:
            term.end("lost", f"leadership was lost: {error.reason}")

    # -- ending ------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop campaigning, for good; if leading, tell ``lead`` to stop, and release the moment it returns.

        Returns at once: call it from any thread, from a signal handler, or
        from the event loop of `run_async`. A campaign waiting for the lock
        ends at once, or when the statement it has in flight ends (within
        ``operation_timeout``); the next candidate is woken by the release.
        """
        self._stop_requested = True
        relay = self._relay
        if relay is None or not relay.send(Relay.STOP):
            self._stop_now()

    def _stop_now(self) -> None:
        # Never in a signal handler's frame (see Relay): it sets events a thread may be waiting on.
        self._stopped.set()
        loop = self._loop
        if loop is None:
            self._stop.set()
        else:
            try:
                loop.call_soon_threadsafe(self._stop_on_loop)
            except RuntimeError:  # the loop is closed
                self._stop.set()
        term = self._term
        if term is not None:
            term.end("stopped", _STOPPED)

    def _stop_on_loop(self) -> None:
        # Async waits are woken on their loop, never from a signal handler's frame.
        self._stop.set()
        if self._wakeup is not None:
            self._wakeup.set()

    def resign(self) -> bool:
        """Give up the current term and keep campaigning: another candidate takes over at once.

        ``lead`` is told (as for `stop`), the lock is released the moment it
        returns, and this candidate campaigns again only after a short pause
        (twice ``poll_interval``, at least 0.25 s), so a waiting candidate wins.
        Returns False if this candidate was not leading. Safe from any thread.
        """
        term = self._term
        if term is None or term.endings:
            return False
        relay = self._relay
        if relay is None or not relay.send(Relay.RESIGN):
            self._resign_now()
        return True

    def _resign_now(self) -> None:
        term = self._term
        if term is not None:
            term.end("resigned", _RESIGNED)

    def close(self) -> None:
        """`stop`, then close the Mutex underneath; safe to call while `run` runs.

        A run still in progress closes it itself once ``lead`` has returned
        and the lock is released, so closing never releases the lock under a
        running ``lead``.
        """
        self._close_when_done = True  # before stop(): a run ending meanwhile sees it
        self.stop()
        if self._running.acquire(blocking=False):  # no run in progress: close now
            try:
                self._mutex.close()
            finally:
                self._running.release()

    async def aclose(self) -> None:
        """Async `close`."""
        self._close_when_done = True
        self.stop()
        if self._running.acquire(blocking=False):
            try:
                await self._mutex.aclose()
            finally:
                self._running.release()

    def __enter__(self) -> Election:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Election:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- who leads -------------------------------------------------------------------

    def leader(self) -> Leader | None:
        """Who leads now, from the lock table (one query, the server's clock), or None.

        Any process can ask, candidate or not. A holder silent past
        ``stale_threshold`` is no leader (it has given up its lease, or is
        dead), so None is returned for it. Raises `DatabaseError` if the table
        cannot be read.
        """
        config = self._mutex.config
        return _leader(
            self._table.holders(
                [self.name], alert_threshold=config.alert_threshold, stale_threshold=config.stale_threshold
            )
        )

    async def leader_async(self) -> Leader | None:
        """Async `leader`."""
        config = self._mutex.config
        return _leader(
            await self._table.holders_async(
                [self.name], alert_threshold=config.alert_threshold, stale_threshold=config.stale_threshold
            )
        )

    def watch_leader(self, interval: float = 1.0) -> Iterator[Leader | None]:
        """Yield the leader (or None) now, then again each time it changes, reading every ``interval`` seconds.

        For followers that cache the leader's address. A change is a new
        instance or a new term (token); a read that fails on a transient
        error is logged and retried at the next interval. Ends after `stop`
        (within ``interval``). Raises `DatabaseError` for a failure that
        retrying cannot cure.
        """
        every = check_seconds(interval, "interval")
        last: tuple[str, int | None] | bool | None = False
        while not self._stop_requested:
            try:
                current = self.leader()
            except DatabaseError as exc:
                if not exc.transient:
                    raise
                logger.warning("election %r: %s; reading the leader again in %gs", self.name, exc, every)
            else:
                if _identity(current) != last:
                    last = _identity(current)
                    yield current
            self._stopped.wait(every)

    async def watch_leader_async(self, interval: float = 1.0) -> AsyncIterator[Leader | None]:
        """Async `watch_leader`."""
        every = check_seconds(interval, "interval")
        last: tuple[str, int | None] | bool | None = False
        while not self._stop_requested:
            try:
                current = await self.leader_async()
            except DatabaseError as exc:
                if not exc.transient:
                    raise
                logger.warning("election %r: %s; reading the leader again in %gs", self.name, exc, every)
            else:
                if _identity(current) != last:
                    last = _identity(current)
                    yield current
            await asyncio.sleep(every)


def _leader(observations: list[LockObservation]) -> Leader | None:
    if not observations or observations[0].reclaimable:
        return None
    seen = observations[0]
    return Leader(
        instance_id=seen.holder,
        token=seen.token,
        seconds_held=seen.seconds_held,
        seconds_since_heartbeat=seen.seconds_since_heartbeat,
        alerting=seen.alerting,
    )


def _identity(leader: Leader | None) -> tuple[str, int | None] | None:
    return None if leader is None else (leader.instance_id, leader.token)


def _discard(awaitable: object) -> None:
    """Close a coroutine that will never be awaited, so Python does not warn about it."""
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()
