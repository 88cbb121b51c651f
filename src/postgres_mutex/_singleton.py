"""``@mutex.singleton``: a function that runs only while its lock is held, and is skipped otherwise.

Built on the Mutex's public API alone (`Mutex.acquire`, `Mutex.acquire_async`).
A call that finds the lock held elsewhere, or held by another call in this
process, does not run and returns None, saying so at INFO; a blocking one
with a timeout raises `LockAcquisitionTimeout` instead.

A decorator may name another lock than the Mutex's own: it then runs under a
sibling of the Mutex (`Siblings`), made once for that name and closed with it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from ._settings import check_name, check_wait
from .errors import LockAlreadyHeldError

if TYPE_CHECKING:
    from ._holder import Holder

logger = logging.getLogger("postgres_mutex")

P = ParamSpec("P")
R = TypeVar("R")


def only_while_held(
    target: Holder, *, blocking: bool, timeout: float | None
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """The decorator `Mutex.singleton` returns: ``func`` runs inside ``target.acquire(...)``, or not at all."""

    def decorate(func: Callable[P, R]) -> Callable[P, R | None]:
        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            with contextlib.ExitStack() as stack:
                try:
                    acquired = stack.enter_context(target.acquire(blocking=blocking, timeout=timeout))
                except LockAlreadyHeldError:
                    logger.info("lock %r is held in this process already: not running %s", target.lock_name, func)
                    return None
                if not acquired:
                    logger.info("lock %r is held elsewhere: not running %s", target.lock_name, func)
                    return None
                return func(*args, **kwargs)

        return wrapper

    return decorate


def only_while_held_async(
    target: Holder, *, blocking: bool, timeout: float | None
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R | None]]]:
    """The decorator `Mutex.singleton_async` returns, for coroutine functions."""

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R | None]]:
        @functools.wraps(func)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            async with contextlib.AsyncExitStack() as stack:
                try:
                    acquired = await stack.enter_async_context(target.acquire_async(blocking=blocking, timeout=timeout))
                except LockAlreadyHeldError:
                    logger.info("lock %r is held in this process already: not running %s", target.lock_name, func)
                    return None
                if not acquired:
                    logger.info("lock %r is held elsewhere: not running %s", target.lock_name, func)
                    return None
                return await func(*args, **kwargs)

        return wrapper

    return decorate


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


def singleton_decorator(
    siblings: Siblings, lock_name: str | Callable[..., Any] | None, *, blocking: bool | None, timeout: float | None
) -> Any:
    """What `Mutex.singleton` returns for its arguments: a decorator or, used bare, the decorated function."""
    if callable(lock_name):
        return singleton_decorator(siblings, None, blocking=False, timeout=None)(lock_name)
    blocking, timeout = check_wait(blocking, timeout)
    return only_while_held(siblings.get(lock_name), blocking=blocking, timeout=timeout)


def singleton_decorator_async(
    siblings: Siblings, lock_name: str | Callable[..., Any] | None, *, blocking: bool, timeout: float | None
) -> Any:
    """What `Mutex.singleton_async` returns for its arguments, as `singleton` for coroutine functions."""
    if callable(lock_name):
        return singleton_decorator_async(siblings, None, blocking=True, timeout=None)(lock_name)
    blocking, timeout = check_wait(blocking, timeout)
    return only_while_held_async(siblings.get(lock_name), blocking=blocking, timeout=timeout)
