"""``@mutex.singleton``: a function that runs only while its lock is held, and is skipped otherwise.

Built on the Mutex's public API alone (`Mutex.acquire`, `Mutex.acquire_async`).
A call that finds the lock held elsewhere, or held by another call in this
process, does not run and returns None, saying so at INFO; a blocking one
with a timeout raises `LockAcquisitionTimeout` instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from .errors import LockAlreadyHeldError

if TYPE_CHECKING:
    from ._mutex import Mutex

logger = logging.getLogger("postgres_mutex")

P = ParamSpec("P")
R = TypeVar("R")


def only_while_held(
    target: Mutex, *, blocking: bool, timeout: float | None
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
    target: Mutex, *, blocking: bool, timeout: float | None
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
