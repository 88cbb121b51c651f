"""The turn of a stray row's clean-up: one on the wire at a time per lock, and no acquire of it beside one."""

from __future__ import annotations

import threading

from ._clock import now

# A turn's statement has the client's deadline; the server's, a little inside it, has ended the
# statement by then, whatever became of its sender.
_MARGIN = 0.5


class CleanupTurn:
    """Taken while a clean-up of a lock's stray row is on the wire: an acquire of the same lock waits
    for it, so the two never cross (a clean-up removes any row carrying the lock's id).

    A turn lasts at most its statement's deadline. A sender cut off mid-statement (the event loop it
    ran on ended under it) never gives its turn back; by its deadline the server has ended the
    statement, so the turn is over then anyway, and nothing waits on it past that.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._holder: object | None = None
        self._until = 0.0

    def take(self, seconds: float) -> object | None:
        """The turn, for a statement with ``seconds`` to run (a token to give back), or None if it is taken."""
        with self._guard:
            if self._holder is not None and now() < self._until:
                return None
            self._holder = token = object()
            self._until = now() + seconds + _MARGIN
            return token

    def give_back(self, token: object) -> None:
        with self._guard:
            if self._holder is token:
                self._holder = None

    @property
    def free(self) -> bool:
        """No clean-up is on the wire (or the one that was has outlived its deadline)."""
        with self._guard:
            return self._holder is None or now() >= self._until
