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
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _flows as flows
from ._clock import now
from ._events import ElectionEvents
from ._metrics import LockObservation, guard
from ._mutex import Mutex
from ._settings import check_name, check_seconds
from ._state import LEASE_EXPIRED, HoldStatus
from ._tracing import INSTANCE_ID, LOCK_NAME
from .errors import DatabaseError, LockNotHeldError, MutexError
from .table import LockTable

if TYPE_CHECKING:
    import psycopg
    from opentelemetry.trace import Span, TracerProvider
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from ._acquisition import Acquisition
    from ._acquisition_async import AsyncAcquisition
    from ._state import Hold
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


class Flag:
    """A flag like `threading.Event` that only the election sets: `is_set`, `wait`."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set, or ``timeout`` seconds; returns whether it is set (`threading.Event.wait`)."""
        return self._event.wait(timeout)

    def _set(self) -> None:
        self._event.set()

    def __repr__(self) -> str:
        return f"<Flag {'set' if self.is_set() else 'clear'}>"


class _Relay:
    """Carries `Election.stop` and `Election.resign` out of a signal handler, to a thread of its own.

    A signal handler runs in the main thread between two bytecodes, possibly
    while that thread holds the internal lock of the very event it waits on
    (``leadership.ended.wait()``, the campaign's wait): setting that event
    from the handler would wait for itself forever. The handler only writes
    a byte to a pipe (no lock taken); this thread reads it and sets the
    events.
    """

    STOP = b"s"
    RESIGN = b"r"
    _QUIT = b"q"

    def __init__(self, stop: Callable[[], None], resign: Callable[[], None]) -> None:
        self._read, self._write = os.pipe()
        self._stop, self._resign = stop, resign
        self._thread = threading.Thread(target=self._run, name="postgres-mutex-election-relay", daemon=True)
        self._thread.start()

    def send(self, what: bytes) -> bool:
        """Pass ``what`` on; False if the relay is closed (then the caller acts itself)."""
        try:
            os.write(self._write, what)
        except OSError:
            return False
        return True

    def _run(self) -> None:
        while True:
            try:
                received = os.read(self._read, 64)
            except OSError:
                return
            if self.STOP in received:
                self._stop()
            elif self.RESIGN in received:
                self._resign()
            if not received or self._QUIT in received:
                return

    def close(self) -> None:
        """Act on what was sent before, then end the thread.

        The write end stays open while anyone may still hold this relay (a
        `send` after this fails, and its caller acts itself): closed with it,
        its descriptor number could be reused by a file of the user's.
        """
        self.send(self._QUIT)
        self._thread.join()
        os.close(self._read)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._write)


class Leadership:
    """One term of leadership, handed to ``lead``: its fencing token and how to learn that it ends.

    `ended` is set the moment the term must end: leadership was lost (then
    `lost` is True), or `Election.stop` or `Election.resign` was called.
    ``lead`` should then return promptly; the lock is released when it does.
    """

    def __init__(self, election: Election, hold: Hold, span: Span) -> None:
        self._election = election
        self._mutex = election._mutex
        self._hold = hold
        self._span = span
        self._began = now()
        self._endings: list[tuple[str, str]] = []
        self._ended_at = 0.0
        self._returned = threading.Event()
        self._wake = threading.Event()
        self._task: asyncio.Future[Any] | None = None
        self.ended = Flag()
        """Set when the term must end: lost, stopped or resigned. ``lead`` returns once it is set."""

    @property
    def name(self) -> str:
        """The election's name (its lock's name)."""
        return self._election.name

    @property
    def instance_id(self) -> str:
        return self._election.instance_id

    @property
    def token(self) -> int | None:
        """This term's fencing token: greater than every earlier term's (None on a table without tokens)."""
        return self._hold.token

    @property
    def lost(self) -> bool:
        """True if the term ended because leadership was lost, rather than given up."""
        return self._ending == "lost"

    @property
    def reason(self) -> str | None:
        """Why the term ends (None while it does not)."""
        return self._endings[0][1] if self._endings else None

    @property
    def held(self) -> bool:
        """True while this term leads: its lock is held and it has not been told to end. Never touches the database."""
        return not self._endings and self._hold.held and self._mutex._lock.hold is self._hold

    def ensure_held(self) -> None:
        """Raise `LockNotHeldError` unless this term still leads; call it between steps of the work.

        It raises once the term was told to end, whether leadership was lost
        or given up (`stop`, `resign`): the error's ``reason`` says which.
        Raising it out of ``lead`` ends the term quietly; it is not counted
        as a failure of ``lead``.
        """
        if self._mutex._lock.hold is not self._hold:
            raise self._error("this term is over: its lock was released")
        if not self._endings and not self._hold.held:
            # The lease ran out a moment before the loss was reported: the term is lost all the same.
            self._end("lost", f"leadership was lost: {self._hold.reason or LEASE_EXPIRED}")
        if self._endings:
            raise self._error(self._endings[0][1])

    def fence(self, conn: psycopg.Connection[Any]) -> int:
        """`Mutex.fence` for this term: in ``conn``'s open transaction, check that this term still holds the lock.

        Returns the token; raises `LockNotHeldError` if the lock changed
        hands since (roll the transaction back), which also ends the term as
        lost. A term told to end but not yet released still passes: until
        ``lead`` returns, the lock is its.
        """
        self._require_current()
        try:
            return self._check_token(self._mutex.fence(conn))
        except LockNotHeldError as exc:
            self._end("lost", f"leadership was lost: {exc.reason}")
            raise

    async def fence_async(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Async `fence`, on an `AsyncConnection`."""
        self._require_current()
        try:
            return self._check_token(await self._mutex.fence_async(conn))
        except LockNotHeldError as exc:
            self._end("lost", f"leadership was lost: {exc.reason}")
            raise

    @contextlib.contextmanager
    def fenced(self, conn: psycopg.Connection[Any]) -> Iterator[int]:
        """`Mutex.fenced` for this term: a transaction on ``conn``, fenced first; yields the token."""
        with conn.transaction():
            yield self.fence(conn)

    @contextlib.asynccontextmanager
    async def fenced_async(self, conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[int]:
        """Async `fenced`, on an `AsyncConnection`."""
        async with conn.transaction():
            yield await self.fence_async(conn)

    def __repr__(self) -> str:
        state = "leading" if self.held else f"ended ({self._ending})" if self._endings else "not held"
        return f"<Leadership election={self.name!r} token={self.token} {state}>"

    # -- the election's side ---------------------------------------------------------

    @property
    def _ending(self) -> str | None:
        return self._endings[0][0] if self._endings else None

    def _end(self, ending: str, reason: str) -> bool:
        """Tell the term to end; the first call wins. No lock: a signal handler may call it."""
        entry = (ending, reason)
        self._endings.append(entry)
        if self._endings[0] is not entry:
            return False
        self._ended_at = now()
        self.ended._set()
        self._wake.set()
        return True

    def _finish(self) -> None:
        """``lead`` has returned."""
        self._returned.set()
        self._wake.set()

    def _require_current(self) -> None:
        if self._mutex._lock.hold is not self._hold:
            raise self._error("this term is over: its lock was released")

    def _check_token(self, token: int) -> int:
        if token != self.token:
            raise self._error(f"this term is over: the lock is held with token {token} now")
        return token

    def _error(self, reason: str) -> LockNotHeldError:
        return LockNotHeldError(
            f"leadership of election {self.name!r} (token {self.token}) has ended: {reason}",
            lock_name=self.name,
            instance_id=self.instance_id,
            reason=reason,
        )


class _Policy:
    """What follows a term, decided once for `run` and `run_async` (no I/O): how it ended, and the pause."""

    def __init__(self, failure_backoff: float, max_failure_backoff: float, rejoin_pause: float) -> None:
        self.failure_backoff = failure_backoff
        self.max_failure_backoff = max_failure_backoff
        self.rejoin_pause = rejoin_pause
        self.failures = 0

    def ended(self, term: Leadership, told: str | None, error: BaseException | None) -> str:
        """How the term ended. ``told``: how it was told to end before ``lead`` returned (None: it was not)."""
        if told is not None:
            return told
        if error is not None and not (isinstance(error, LockNotHeldError) and term._ending == "lost"):
            return "failed"
        # A loss found only by the release counts as one, and so does lead's LockNotHeldError then.
        return term._ending or "returned"

    def pause_after(self, ended: str) -> float:
        """Seconds to wait before campaigning again.

        A failure backs off exponentially, up to the cap; giving the term up
        (``lead`` returned, `resign`) sits out a short pause so that another
        candidate, woken by the release, takes over; after a loss the
        candidate campaigns at once (it waits for the lock anyway).
        """
        if ended == "failed":
            self.failures += 1
            return min(self.max_failure_backoff, self.failure_backoff * 2.0 ** (self.failures - 1))
        self.failures = 0
        if ended in ("returned", "resigned"):
            return self.rejoin_pause
        return 0.0


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
        config = self._mutex.config
        self._grace = config.heartbeat_interval if grace is None else grace
        self._policy = _Policy(backoff, max_backoff, rejoin_pause=max(0.25, 2 * config.poll_interval))
        self._table = LockTable(client=self._mutex.client, table=table, operation_timeout=config.operation_timeout)
        self._events = ElectionEvents(
            lock_name=name, instance_id=self._mutex.instance_id, hook=guard(metrics), grace_period=self._grace
        )
        self._stop = flows.StopSignal()
        self._stopped = threading.Event()
        # Set by stop() itself: a plain flag, as a signal handler may set it.
        self._stop_requested = False
        self._relay: _Relay | None = None
        self._running = threading.Lock()
        self._term: Leadership | None = None
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
        return term is not None and term.held

    @property
    def leadership(self) -> Leadership | None:
        """The current term, while ``lead`` runs (None otherwise)."""
        return self._term

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
        acquisition = self._mutex._campaign(self._stop)
        if not acquisition.__enter__():
            return None
        if self._stop_requested:  # won just as stop() came: no term
            self._release(acquisition, None)
            return None
        with self._mutex._lock.tracing.span(TERM_SPAN, self._span_attributes()) as span:
            term = self._begin(span)
            watch = self._watch(term)
            error: BaseException | None = None
            misuse: TypeError | None = None
            try:
                result = lead(term)
            except BaseException as exc:
                error = exc
                if not isinstance(exc, Exception):
                    term._end("stopped", f"the run was interrupted ({type(exc).__name__})")
            else:
                if inspect.isawaitable(result):
                    _discard(result)
                    misuse = TypeError("lead returned an awaitable: use 'await election.run_async(lead)'")
                    term._end("stopped", "lead is async")
            told = term._ending
            term._finish()
            watch.join()
            self._release(acquisition, term)
            pause = self._conclude(term, told, error)
            if misuse is not None:
                raise misuse
            if error is not None and not isinstance(error, Exception):
                raise error
            return pause

    def _release(self, acquisition: Acquisition, term: Leadership | None) -> None:
        try:
            acquisition.__exit__(None, None, None)
        except LockNotHeldError as exc:
            if term is not None:
                term._end("lost", f"leadership was lost: {exc.reason}")
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
        acquisition = self._mutex._campaign_async(self._stop)
        if not await acquisition.__aenter__():
            return None
        if self._stop_requested:
            await self._release_async(acquisition, None)
            return None
        with self._mutex._lock.tracing.span(TERM_SPAN, self._span_attributes()) as span:
            term = self._begin(span)
            error: BaseException | None = None
            interrupted: BaseException | None = None
            task: asyncio.Future[Any] | None = None
            try:
                work: object = lead(term)
            except Exception as exc:
                error = exc
            else:
                if inspect.isawaitable(work):
                    task = term._task = asyncio.ensure_future(work)
                else:
                    interrupted = TypeError("lead is not async: use election.run(lead) for a plain function")
                    term._end("stopped", "lead is not async")
            watch = self._watch(term)
            if task is not None:
                try:
                    await asyncio.wait([task])
                except asyncio.CancelledError as exc:  # the task running run_async was cancelled
                    interrupted = exc
                    term._end("stopped", "run_async was cancelled")
                    task.cancel()
                    await asyncio.wait([task])
                if not task.cancelled():
                    error = task.exception()
                elif term._ending is None:
                    error = asyncio.CancelledError("lead's task was cancelled, not by the election")
            told = term._ending
            term._finish()
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

    async def _hand_over_async(self, watch: threading.Thread, acquisition: AsyncAcquisition, term: Leadership) -> None:
        await asyncio.to_thread(watch.join)  # it has only to finish reporting: a moment
        await self._release_async(acquisition, term)

    async def _release_async(self, acquisition: AsyncAcquisition, term: Leadership | None) -> None:
        try:
            await acquisition.__aexit__(None, None, None)
        except LockNotHeldError as exc:
            if term is not None:
                term._end("lost", f"leadership was lost: {exc.reason}")
        except DatabaseError as exc:
            self._events.release_failed(exc)

    # -- what run and run_async share ------------------------------------------------

    def _enter(self) -> None:
        if not self._running.acquire(blocking=False):
            raise MutexError(f"election {self.name!r} is running already: one run() or run_async() at a time")
        # Started here, never in stop(): a signal handler may not start a thread.
        self._relay = _Relay(self._stop_now, self._resign_now)

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

    def _begin(self, span: Span) -> Leadership:
        hold = self._mutex._lock.hold
        assert hold is not None
        term = Leadership(self, hold, span)
        self._term = term
        self._events.term_began(span, hold.token)
        if not hold.held:  # lost before the term was there to hear of it
            term._end("lost", "leadership was lost: " + (hold.reason or "its lease ran out"))
        if self._stop_requested:
            term._end("stopped", _STOPPED)
        return term

    def _watch(self, term: Leadership) -> threading.Thread:
        """A thread that tells the term's end (and an async ``lead``'s task) and watches the grace period."""
        watch = threading.Thread(target=self._watch_term, args=(term,), name="postgres-mutex-election", daemon=True)
        watch.start()
        return watch

    def _watch_term(self, term: Leadership) -> None:
        term._wake.wait()
        ending, reason = term._ending, term.reason
        if ending is None or reason is None:
            return  # lead returned on its own
        self._events.ending(term._span, ending, reason)
        task, loop = term._task, self._loop
        if task is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the task is gone with it
                loop.call_soon_threadsafe(task.cancel)
        if term._returned.wait(self._grace):
            return
        self._events.grace_overrun(term._span, now() - term._ended_at, reason)
        term._returned.wait()
        self._events.returned_late(now() - term._ended_at)

    def _conclude(self, term: Leadership, told: str | None, error: BaseException | None) -> float:
        ended = self._policy.ended(term, told, error)
        pause = self._policy.pause_after(ended)
        if error is not None and isinstance(error, Exception | asyncio.CancelledError):
            if ended == "failed":
                self._events.lead_failed(term._span, error, pause)
            elif not isinstance(error, asyncio.CancelledError):
                self._events.raised_after_end(error)
        self._term = None
        self._events.term_ended(term._span, ended, now() - term._began, term.token)
        return pause

    def _on_lost(self, error: LockNotHeldError) -> None:
        """The Mutex lost its lock (on the client's event thread): tell the term it belongs to, at once."""
        term = self._term
        if term is not None and term._hold.status is HoldStatus.LOST:
            term._end("lost", f"leadership was lost: {error.reason}")

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
        if relay is None or not relay.send(_Relay.STOP):
            self._stop_now()

    def _stop_now(self) -> None:
        # Never in a signal handler's frame (see _Relay): it sets events a thread may be waiting on.
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
            term._end("stopped", _STOPPED)

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
        if term is None or term._endings:
            return False
        relay = self._relay
        if relay is None or not relay.send(_Relay.RESIGN):
            self._resign_now()
        return True

    def _resign_now(self) -> None:
        term = self._term
        if term is not None:
            term._end("resigned", _RESIGNED)

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
