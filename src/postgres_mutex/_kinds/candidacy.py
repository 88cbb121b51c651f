"""`Candidacy`: what an `Election` needs of its Mutex beyond the public API.

An election leads with its Mutex's lock. It reads the lock's state (the
hold a term leads with, the lock's tracing), and campaigns: a campaign is a
blocking acquire without a timeout that a stop ends at once (entering then
yields False). Unlike a timeout, a stop wakes the wait the moment it is set,
from any thread. The Mutex makes its Candidacy; `_kinds.mutex.candidacy` hands it
over, the one door from an election into its Mutex.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .._io.acquisition import Acquisition
from .._io.acquisition_async import AsyncAcquisition

if TYPE_CHECKING:
    from .._io.engine import Engine
    from .._io.engine_async import AsyncEngine
    from .._state import steps
    from .._state.locks import LockState


class Candidacy:
    """A Mutex's side of an election: its lock state, and campaigns for its lock."""

    def __init__(
        self,
        lock: LockState,
        engine_for: Callable[[], Engine],
        engine_async_for: Callable[[], AsyncEngine],
        *,
        before: Callable[[], None],
        before_async: Callable[[], None],
    ) -> None:
        self.lock = lock
        self._engine_for = engine_for
        self._engine_async_for = engine_async_for
        # What the Mutex does before any acquire (start the watcher of its own lock), a campaign does too.
        self._before = before
        self._before_async = before_async

    def campaign(self, stop: steps.StopSignal) -> Acquisition:
        """A campaign, entered with ``with``: yields True once the lock is won, False if ``stop`` came first."""
        self._before()
        return Acquisition(self._engine_for, self.lock, blocking=True, timeout=None, stop=stop)

    def campaign_async(self, stop: steps.StopSignal) -> AsyncAcquisition:
        """An async campaign, entered with ``async with``."""
        self._before_async()
        return AsyncAcquisition(self._engine_async_for, self.lock, blocking=True, timeout=None, stop=stop)
