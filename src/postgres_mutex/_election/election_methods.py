# Generated from election_methods_async.py by tools/async_to_sync.py: do not edit.
# Change the async module and run `python tools/async_to_sync.py`.
"""`Election`'s methods in one flavour: run the rounds, close, and read who leads.

`Election` is made of them and of what is its own (one run at a time, the
relay out of signal handlers, stopping and resigning).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Self

from .._state.settings import check_seconds
from .campaign import refuse_async_lead

if TYPE_CHECKING:
    import threading

    from .._kinds.mutex import Mutex
    from .campaign import Campaign, Lead
    from .leader import Leader
    from .leader_reader import LeaderReader


class ElectionMethods:
    """What an Election does in one flavour (``run``, ``leader`` ...)."""

    # What `Election` sets up for them.
    _mutex: Mutex
    _campaign: Campaign
    _leaders: LeaderReader
    _running: threading.Lock
    _close_when_done: bool
    _enter: Callable[[], None]
    _leave: Callable[[], None]
    stop: Callable[[], None]

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
        refuse_async_lead(lead)
        self._enter()
        try:
            self._campaign.run(lead)
        finally:
            self._leave()
            if self._close_when_done:
                self._mutex.close()
            self._running.release()
            self._close_if_asked_meanwhile()

    def _close_if_asked_meanwhile(self) -> None:
        # close() came after run's own check, and found the run still going: close now.
        if self._close_when_done and self._running.acquire(blocking=False):
            try:
                self._mutex.close()
            finally:
                self._running.release()

    # -- ending ------------------------------------------------------------------------

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- who leads -------------------------------------------------------------------

    def leader(self) -> Leader | None:
        """Who leads now, from the lock table (one query, the server's clock), or None.

        Any process can ask, candidate or not. A holder silent past
        ``stale_threshold`` is no leader (it has given up its lease, or is
        dead), so None is returned for it. Raises `DatabaseError` if the table
        cannot be read.
        """
        return self._leaders.read()

    def watch_leader(self, interval: float = 1.0) -> Iterator[Leader | None]:
        """Yield the leader (or None) now, then again each time it changes, reading every ``interval`` seconds.

        For followers that cache the leader's address. A change is a new
        instance or a new term (token); a read that fails on a transient
        error is logged and retried at the next interval. Ends after `stop`
        (within ``interval``). Raises `DatabaseError` for a failure that
        retrying cannot cure.
        """
        every = check_seconds(interval, "interval")
        yield from self._leaders.watch(every, lambda: self._campaign.stop_requested, self._campaign.wait)
