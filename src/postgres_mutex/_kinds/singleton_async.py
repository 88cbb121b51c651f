"""``@mutex.singleton_async``: a function that runs only while its lock is held, and is skipped otherwise.

Built on the Mutex's public API alone (`Mutex.acquire_async`). A call that
finds the lock held elsewhere, or held by another call in this process, does
not run and returns None, saying so at INFO; a blocking one with a timeout
raises `LockAcquisitionTimeout` instead.

A decorator may name another lock than the Mutex's own: it then runs under
a sibling of the Mutex (`Siblings`), made once for that name and closed with
it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from .._state.settings import check_wait
from ..errors import LockAlreadyHeldError

if TYPE_CHECKING:
    from .holder import Holder
    from .siblings import Siblings

logger = logging.getLogger("postgres_mutex")

P = ParamSpec("P")
R = TypeVar("R")

AsyncFunction = Callable[P, Awaitable[R]]  # sync: Function = Callable[P, R]
"""What the decorator is given."""
AsyncSkippable = Callable[P, Awaitable[R | None]]  # sync: Skippable = Callable[P, R | None]
"""What it returns: the same function, returning None when it did not run."""

BARE_BLOCKING = True  # sync: BARE_BLOCKING = False
"""Whether a decorator used bare waits for the lock: as `Mutex.acquire_async` with no argument does."""


def only_while_held_async(
    target: Holder, *, blocking: bool, timeout: float | None
) -> Callable[[AsyncFunction[P, R]], AsyncSkippable[P, R]]:
    """The decorator `Mutex.singleton_async` returns: ``func`` runs inside ``target.acquire_async(...)``, or not
    at all."""

    def decorate(func: AsyncFunction[P, R]) -> AsyncSkippable[P, R]:
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


def singleton_decorator_async(
    siblings: Siblings, lock_name: str | Callable[..., Any] | None, *, blocking: bool | None, timeout: float | None
) -> Any:
    """What `Mutex.singleton_async` returns for its arguments: a decorator or, used bare, the decorated function."""
    if callable(lock_name):
        return singleton_decorator_async(siblings, None, blocking=BARE_BLOCKING, timeout=None)(lock_name)
    blocking, timeout = check_wait(blocking, timeout)
    return only_while_held_async(siblings.get(lock_name), blocking=blocking, timeout=timeout)
