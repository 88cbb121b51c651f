"""`Siblings`: the Mutexes a Mutex's decorators run under for lock names other than its own."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._state.settings import check_name

if TYPE_CHECKING:
    from .holder import Holder


class Siblings:
    """The Mutexes a Mutex's decorators run under for lock names other than its own; closed with it.

    Each is made once, by the Mutex's ``make`` (on its client, with its
    settings and its identity), the first time a decorator names its lock.
    """

    def __init__(self, mutex: Holder, make: Callable[[str], Holder]) -> None:
        # The Mutex keeps its siblings; they refer to it weakly, so that it is let go of once unused.
        self._mutex = weakref.ref(mutex)
        self._make = weakref.WeakMethod(make)
        self._made: dict[str, Holder] = {}

    def get(self, lock_name: str | None) -> Holder:
        """The Mutex for ``lock_name``: the Mutex itself for its own name (or None)."""
        mutex, make = self._mutex(), self._make()
        assert mutex is not None  # called through the Mutex: both are alive
        assert make is not None
        if lock_name is None or lock_name == mutex.lock_name:
            return mutex
        check_name(lock_name, "lock_name")
        sibling = self._made.get(lock_name)
        if sibling is None:
            sibling = self._made[lock_name] = make(lock_name)
        return sibling

    def close(self) -> None:
        for sibling in self._made.values():
            sibling.close()

    async def aclose(self) -> None:
        for sibling in self._made.values():
            await sibling.aclose()
