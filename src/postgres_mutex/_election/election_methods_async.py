"""`Election`'s methods in one flavour: run the rounds, close, and read who leads.

`Election` is made of them and of what is its own (one run at a time, the
relay out of signal handlers, stopping and resigning).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Self

from .._state.settings import check_seconds

# sync-only
# from .campaign import refuse_async_lead
# end sync-only

if TYPE_CHECKING:
    import threading

    from .._kinds.mutex import Mutex
    from .campaign import AsyncLead, Campaign
    from .leader import Leader
    from .leader_reader_async import AsyncLeaderReader


class AsyncElectionMethods:
    """What an Election does in one flavour (``run_async``, ``leader_async`` ...)."""

    # What `Election` sets up for them.
    _mutex: Mutex
    _campaign: Campaign
    _leaders_async: AsyncLeaderReader
    _running: threading.Lock
    _close_when_done: bool
    _enter: Callable[[], None]
    _leave: Callable[[], None]
    stop: Callable[[], None]

    # -- campaigning -----------------------------------------------------------------

    async def run_async(self, lead: AsyncLead) -> None:
        # async-only
        """Async `run`: ``lead`` is a coroutine function, run as a task of its own.

        When the term must end (lost, `stop`, `resign`), that task is
        cancelled and `Leadership.ended` is set; it must finish within
        ``grace_period``. Cancelling the task awaiting `run_async` ends the
        term the same way, releases the lock, and stops campaigning.
        """
        # end async-only
        # sync-only
        # """Campaign, call ``lead(leadership)`` during each term, and campaign again; until `stop`.
        #
        # ``lead`` runs in the calling thread. When it returns, the term is
        # given up: the lock is released and the candidate campaigns again
        # after a short pause (so another candidate, woken by the release,
        # takes over first). When it raises, the error is logged and counted,
        # the lock released, and the candidate waits ``failure_backoff``
        # (doubling, up to ``max_failure_backoff``) before campaigning again.
        # When the term must end (lost, `stop`, `resign`), `Leadership.ended`
        # is set and ``lead`` must return within ``grace_period``.
        #
        # Returns once stopped, at once if it is waiting for the lock, or as
        # soon as ``lead`` returns. Raises `DatabaseError` for a failure that
        # waiting cannot cure (a missing table, a missing privilege), and
        # `MutexError` if this Election is running already. KeyboardInterrupt
        # (or any exception a signal handler raises) ends the term, releases
        # the lock and propagates.
        # """
        # end sync-only
        if not callable(lead):
            raise TypeError(f"lead must be callable, not {type(lead).__name__}")
        # sync-only
        # refuse_async_lead(lead)
        # end sync-only
        self._enter()
        try:
            await self._campaign.run_async(lead)
        finally:
            self._leave()
            if self._close_when_done:
                await self._mutex.aclose()
            self._running.release()
            await self._close_if_asked_meanwhile_async()

    async def _close_if_asked_meanwhile_async(self) -> None:
        # close() came after run's own check, and found the run still going: close now.
        if self._close_when_done and self._running.acquire(blocking=False):
            try:
                await self._mutex.aclose()
            finally:
                self._running.release()

    # -- ending ------------------------------------------------------------------------

    async def aclose(self) -> None:
        """`stop`, then close the Mutex underneath; safe to call while `run_async` runs.

        A run still in progress closes it itself once ``lead`` has returned
        and the lock is released, so closing never releases the lock under a
        running ``lead``.
        """
        self._close_when_done = True  # before stop(): a run ending meanwhile sees it
        self.stop()
        if self._running.acquire(blocking=False):  # no run in progress: close now
            try:
                await self._mutex.aclose()
            finally:
                self._running.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- who leads -------------------------------------------------------------------

    async def leader_async(self) -> Leader | None:
        """Who leads now, from the lock table (one query, the server's clock), or None.

        Any process can ask, candidate or not. A holder silent past
        ``stale_threshold`` is no leader (it has given up its lease, or is
        dead), so None is returned for it. Raises `DatabaseError` if the table
        cannot be read.
        """
        return await self._leaders_async.read_async()

    async def watch_leader_async(self, interval: float = 1.0) -> AsyncIterator[Leader | None]:
        """Yield the leader (or None) now, then again each time it changes, reading every ``interval`` seconds.

        For followers that cache the leader's address. A change is a new
        instance or a new term (token); a read that fails on a transient
        error is logged and retried at the next interval. Ends after `stop`
        (within ``interval``). Raises `DatabaseError` for a failure that
        retrying cannot cure.
        """
        every = check_seconds(interval, "interval")
        # async-only
        async for found in self._leaders_async.watch_async(every, lambda: self._campaign.stop_requested, asyncio.sleep):
            yield found
        # end async-only
        # sync-only
        # yield from self._leaders.watch(every, lambda: self._campaign.stop_requested, self._campaign.wait)
        # end sync-only
