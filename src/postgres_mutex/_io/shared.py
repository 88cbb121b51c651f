"""The clients of one process: the ones ``Mutex(dsn, ...)`` shares, and what exit and fork do to all.

Every client registers two callbacks here when it is made: what a normal
interpreter exit does (release what is held, within a budget) and what a
forked child does (forget the parent's connections and threads). The
registry holds them weakly: a client nobody uses any more is collected as
usual. The clients that ``Mutex(dsn, ...)`` and friends share, one per DSN
or pool, are kept here too; the registry makes them with the factory it is
given, so it never names the client class (the client imports this module,
not the reverse).
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Shareable(Protocol):
    """What the registry needs to know of a shared client."""

    @property
    def closed(self) -> bool: ...

    @property
    def pool(self) -> object: ...

    @property
    def async_pool(self) -> object: ...


C = TypeVar("C", bound=Shareable)


class SharedClients(Generic[C]):
    """The clients ``Mutex(dsn, ...)`` shares: one per DSN (or pool pair) per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_dsn: dict[str, C] = {}
        self._by_pool: list[C] = []
        os.register_at_fork(after_in_child=self._reset_after_fork)

    def get(self, dsn: str | None, pool: object, async_pool: object, make: Callable[[], C]) -> C:
        """The open shared client for ``dsn`` (or this pool pair), made by ``make`` if there is none."""
        with self._lock:
            if dsn is not None:
                client = self._by_dsn.get(dsn)
                if client is None or client.closed:
                    client = self._by_dsn[dsn] = make()
                return client
            for client in self._by_pool:
                if client.pool is pool and client.async_pool is async_pool and not client.closed:
                    return client
            client = make()
            self._by_pool.append(client)
            return client

    def holds(self, client: object) -> bool:
        """Whether ``client`` is one of the shared ones (the last Mutex out closes its connections)."""
        with self._lock:
            return client in self._by_dsn.values() or client in self._by_pool

    def forget(self, client: object) -> None:
        """A closed client: the next ``Mutex(dsn, ...)`` makes a new one."""
        with self._lock:
            for dsn, found in list(self._by_dsn.items()):
                if found is client:
                    del self._by_dsn[dsn]
            if client in self._by_pool:
                self._by_pool.remove(client)

    def _reset_after_fork(self) -> None:
        # Held by a thread of the parent, perhaps: that thread does not exist in the child.
        self._lock = threading.Lock()


class _Lifetime:
    """A client's callbacks for exit and fork, held weakly (through its bound methods)."""

    def __init__(self, at_exit: Callable[[], None], after_fork: Callable[[], None]) -> None:
        self.at_exit = weakref.WeakMethod(at_exit)
        self.after_fork = weakref.WeakMethod(after_fork)


_LIFETIMES: weakref.WeakKeyDictionary[object, _Lifetime] = weakref.WeakKeyDictionary()


def track(client: object, *, at_exit: Callable[[], None], after_fork: Callable[[], None]) -> None:
    """Call ``at_exit`` at a normal interpreter exit and ``after_fork`` in a forked child, while ``client`` lives.

    Both are bound methods of ``client``.
    """
    _LIFETIMES[client] = _Lifetime(at_exit, after_fork)


def _callbacks(pick: Callable[[_Lifetime], weakref.WeakMethod[Callable[[], None]]]) -> list[Callable[[], None]]:
    found = (pick(lifetime)() for lifetime in list(_LIFETIMES.values()))
    return [callback for callback in found if callback is not None]


@atexit.register
def _release_all_at_exit() -> None:
    """A normal interpreter exit releases every lock still held, so nobody waits out stale_threshold.

    Each client bounds its own part (one ``operation_timeout`` of its locks,
    plus a connect): an exit is never held up longer by a database that does
    not answer.
    """
    for at_exit in _callbacks(lambda lifetime: lifetime.at_exit):
        at_exit()


def _forget_after_fork() -> None:
    for after_fork in _callbacks(lambda lifetime: lifetime.after_fork):
        after_fork()


os.register_at_fork(after_in_child=_forget_after_fork)
