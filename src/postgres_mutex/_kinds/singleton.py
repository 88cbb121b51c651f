# Generated from singleton_async.py by tools/async_to_sync.py: do not edit.
# Change the async module and run `python tools/async_to_sync.py`.
"""``@mutex.singleton``: a function that runs only while its lock is held, and is skipped otherwise.

Built on the Mutex's public API alone (`Mutex.acquire`). A call that
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from .._state.settings import check_wait
from ..errors import LockAlreadyHeldError

if TYPE_CHECKING:
    from .holder import Holder
    from .siblings import Siblings

logger = logging.getLogger("postgres_mutex")

P = ParamSpec("P")
R = TypeVar("R")

Function = Callable[P, R]
"""What the decorator is given."""
Skippable = Callable[P, R | None]
"""What it returns: the same function, returning None when it did not run."""

BARE_BLOCKING = False
"""Whether a decorator used bare waits for the lock: as `Mutex.acquire` with no argument does."""


def only_while_held(
    target: Holder, *, blocking: bool, timeout: float | None
) -> Callable[[Function[P, R]], Skippable[P, R]]:
    """The decorator `Mutex.singleton` returns: ``func`` runs inside ``target.acquire(...)``, or not
    at all."""

    def decorate(func: Function[P, R]) -> Skippable[P, R]:
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


def singleton_decorator(
    siblings: Siblings, lock_name: str | Callable[..., Any] | None, *, blocking: bool | None, timeout: float | None
) -> Any:
    """What `Mutex.singleton` returns for its arguments: a decorator or, used bare, the decorated function."""
    if callable(lock_name):
        return singleton_decorator(siblings, None, blocking=BARE_BLOCKING, timeout=None)(lock_name)
    blocking, timeout = check_wait(blocking, timeout)
    return only_while_held(siblings.get(lock_name), blocking=blocking, timeout=timeout)
