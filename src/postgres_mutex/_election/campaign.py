"""`Campaign`: what `Election.run` and `Election.run_async` repeat until stopped, and what ends it.

Each round campaigns (waits for the lock, woken at once by the holder's
release), serves one term (calls ``lead`` with the term's `Leadership`, and
tells it the moment the term must end), hands the lock over the moment
``lead`` returns, and pauses as `TermPolicy` says. A thread watches each term
(`Campaign` starts it): it tells the term's end to an async ``lead`` by
cancelling its task, and reports a ``lead`` that overruns the grace period.

The Election keeps what is its own (the one run at a time, its relay out of
signal handlers, closing); the campaign keeps the run's state that `stop`,
`resign` and a loss reach: the flag a signal handler may set, the current
term, and the event loop of an async run.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .._base.acompat import Event
from .._base.clock import now
from .._observe.tracing import INSTANCE_ID, LOCK_NAME
from .._state import steps
from .._state.locks import IN_DOUBT, HoldStatus
from ..errors import DatabaseError, LockNotHeldError
from .term import Leadership, Term

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from .._io.acquisition import Acquisition
    from .._io.acquisition_async import AsyncAcquisition
    from .._kinds.mutex import Mutex
    from .._state.events import ElectionEvents
    from .term import TermPolicy

logger = logging.getLogger("postgres_mutex")

TERM_SPAN = "postgres_mutex.election.term"

_STOPPED = "stop() was called"
_RESIGNED = "resign() was called"

Lead = Callable[[Leadership], object]
AsyncLead = Callable[[Leadership], Awaitable[object]]


class Campaign:
    """One candidate's rounds in an election: campaign, serve a term, hand over, pause; until stopped."""

    def __init__(self, mutex: Mutex, events: ElectionEvents, policy: TermPolicy, grace: float) -> None:
        self._mutex = mutex
        # The election is built on its Mutex, and reads the lock's state (the hold a term leads with, its tracing).
        self._lock = mutex._lock
        self._lock.events.on_doubt = self.on_doubt
        self._events = events
        self._policy = policy
        self._grace = grace
        self._stop = steps.StopSignal()
        # Waited on between rounds in the caller's thread, where a signal handler's exception may land.
        self._stopped = Event()
        # Set by request_stop() itself: a plain flag, as a signal handler may set it.
        self._stop_requested = False
        self.term: Term | None = None
        """The term being served, while ``lead`` runs (None otherwise)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None

    @property
    def stop_requested(self) -> bool:
        """True once `request_stop` was called: no campaign begins after it."""
        return self._stop_requested

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds``, or until `stop_now`; returns whether stopped (a sync wait, for a thread)."""
        return self._stopped.wait(seconds)

    # -- the rounds ------------------------------------------------------------------

    def run(self, lead: Lead) -> None:
        """Round after round in the calling thread, until stopped (see `Election.run`)."""
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

    async def run_async(self, lead: AsyncLead) -> None:
        """Round after round on the running loop, until stopped (see `Election.run_async`)."""
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
            self._loop = self._wakeup = None

    def _serve(self, lead: Lead) -> float | None:
        """Campaign, then one term; returns the pause before the next campaign, None once stopped."""
        acquisition = self._mutex._campaign(self._stop)
        if not acquisition.__enter__():
            return None
        if self._stop_requested:  # won just as stop() came: no term
            self._release(acquisition, None)
            return None
        with self._lock.tracing.span(TERM_SPAN, self._span_attributes()) as span:
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
            self._join_watch(watch)
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

    async def _serve_async(self, lead: AsyncLead) -> float | None:
        acquisition = self._mutex._campaign_async(self._stop)
        if not await acquisition.__aenter__():
            return None
        if self._stop_requested:
            await self._release_async(acquisition, None)
            return None
        with self._lock.tracing.span(TERM_SPAN, self._span_attributes()) as span:
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
        await asyncio.to_thread(self._join_watch, watch)
        await self._release_async(acquisition, term)

    async def _release_async(self, acquisition: AsyncAcquisition, term: Term | None) -> None:
        try:
            await acquisition.__aexit__(None, None, None)
        except LockNotHeldError as exc:
            if term is not None:
                term.end("lost", f"leadership was lost: {exc.reason}")
        except DatabaseError as exc:
            self._events.release_failed(exc)

    # -- what both kinds of round share ------------------------------------------------

    def _span_attributes(self) -> dict[str, str | bool | int | float]:
        return {LOCK_NAME: self._mutex.lock_name, INSTANCE_ID: self._mutex.instance_id}

    def _begin(self, span: Span) -> Term:
        hold = self._lock.hold
        assert hold is not None
        term = Term(self._mutex, self._lock, hold, span)
        self.term = term
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

    def _join_watch(self, watch: threading.Thread) -> None:
        """Wait for the term's watch, ``lead`` having returned: within ``operation_timeout``, then release anyway.

        It has only to finish reporting the term's end (a log line, a metrics
        hook, a span event): a moment, unless a handler or a hook is stuck,
        which must not keep the lock from the next candidate.
        """
        bound = self._lock.timing.operation_timeout
        watch.join(bound)
        if watch.is_alive():
            logger.warning(
                "election %r: reporting the end of the term (a log handler, a metrics hook) still runs %.3gs "
                "(operation_timeout) after lead returned; releasing the lock without waiting for it",
                self._mutex.lock_name,
                bound,
            )

    def _watch_term(self, term: Term) -> None:
        # Woken by the term's end, or at its lease's end to end it by the clock: an async lead is cancelled
        # then, not when the client's event thread gets round to reporting the loss.
        while not term.wake.wait(None if (due := term.settle()) == math.inf else max(0.0, due - now())):
            pass
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
        self.term = None
        self._events.term_ended(term.span, ended, now() - term.began, term.hold.token)
        return pause

    # -- what ends it ----------------------------------------------------------------

    def on_lost(self, error: LockNotHeldError) -> None:
        """The Mutex lost its lock (on the client's event thread): tell the term it belongs to, at once."""
        term = self.term
        if term is not None and term.hold.status is HoldStatus.LOST:
            term.end("lost", f"leadership was lost: {error.reason}")

    def on_doubt(self) -> None:
        """The hold turned in doubt (``reclaim_disconnected_after``): another candidate may take the lock over
        if this one's session ended, so the term ends now, as for a loss (on the client's event thread)."""
        term = self.term
        if term is not None and term.hold.in_doubt:
            term.end("lost", f"leadership was lost: {IN_DOUBT}")

    def request_stop(self) -> None:
        """No campaign begins after this. Only a flag is set: a signal handler may call it."""
        self._stop_requested = True

    def stop_now(self) -> None:
        """End the campaign waiting for the lock, the pause, and the term being served."""
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
        term = self.term
        if term is not None:
            term.end("stopped", _STOPPED)

    def _stop_on_loop(self) -> None:
        # Async waits are woken on their loop, never from a signal handler's frame.
        self._stop.set()
        if self._wakeup is not None:
            self._wakeup.set()

    def resign_now(self) -> None:
        """End the term being served; the rounds go on."""
        term = self.term
        if term is not None:
            term.end("resigned", _RESIGNED)


def refuse_async_lead(lead: object) -> None:
    """`Election.run` calls ``lead`` in its thread: a coroutine function's work would never run."""
    if inspect.iscoroutinefunction(lead):
        raise TypeError("lead is a coroutine function: use 'await election.run_async(lead)'")


def _discard(awaitable: object) -> None:
    """Close a coroutine that will never be awaited, so Python does not warn about it."""
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()
