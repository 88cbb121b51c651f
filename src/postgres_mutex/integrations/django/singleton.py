"""``@once``: a management command or a function that runs on one process of the fleet at a time."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from postgres_mutex.errors import MutexError

from .. import in_setup_words
from .settings import mutex

__all__ = ["AlreadyRunning", "once"]

log = logging.getLogger("postgres_mutex.integrations.django")

P = ParamSpec("P")
R = TypeVar("R")
Policy = Literal["skip", "wait", "raise"]
_POLICIES = ("skip", "wait", "raise")
_MAX_NAME = 64
_COMMAND_WORDS = {
    "call create_schema()": "run 'python manage.py migrate'",
    "create_schema()": "'python manage.py migrate'",
}
"""How a command's user makes the lock table: the app's migration."""


class AlreadyRunning(MutexError):
    """The lock of a function decorated ``@once(on_contention="raise")`` is held elsewhere.

    A management command reports it as a `CommandError` instead: one line on
    stderr, exit status 1.
    """


def once(
    lock_name: str | None = None,
    *,
    on_contention: Policy = "skip",
    wait_timeout: float = 60.0,
    alias: str | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Run the decorated function, or a command's ``handle``, under a lock: on one process of the fleet at a time.

    ``lock_name`` defaults to ``django:<command>`` for a management
    command's ``handle``, else ``django:<module>.<function>``. The lock is
    taken on the database ``alias`` (default: ``POSTGRES_MUTEX["DATABASE"]``)
    with the settings' options, held while the function runs, released when
    it returns or raises. When it is held elsewhere, ``on_contention`` says:

    - ``"skip"`` (default): return None without running (a command says so
      on its stderr and exits 0);
    - ``"wait"``: wait up to ``wait_timeout`` seconds in all (for this
      process's other calls, then for the fleet), then raise
      `LockAcquisitionTimeout` (a command: `CommandError`);
    - ``"raise"``: raise `AlreadyRunning` (a command: `CommandError`).
    """
    if on_contention not in _POLICIES:
        raise ValueError(f"on_contention must be one of {', '.join(_POLICIES)}, not {on_contention!r}")

    def decorate(func: Callable[P, R]) -> Callable[P, R | None]:
        if inspect.iscoroutinefunction(func):
            # The lock would be released when the coroutine is made, before any of it runs.
            raise TypeError(f"@once runs functions, not coroutine functions: {func.__qualname__} is async")
        name = lock_name or _default_name(func)

        @functools.wraps(func)
        def run_once(*args: P.args, **kwargs: P.kwargs) -> R | None:
            command = args[0] if args and isinstance(args[0], BaseCommand) else None
            local = _turn(alias, name)
            waits = on_contention == "wait"
            # One wait_timeout for both turns, this process's and the fleet's: a deadline, not two timeouts.
            deadline = time.monotonic() + wait_timeout
            try:
                if not local.acquire(blocking=waits, timeout=wait_timeout if waits else -1):
                    _contended(name, on_contention, command)
                    return None
                try:
                    lock = mutex(name, alias=alias)
                    # Past the deadline, one try, which ends as a wait that ran out: LockAcquisitionTimeout.
                    left = max(deadline - time.monotonic(), 0.001) if waits else None
                    with lock.acquire(blocking=waits, timeout=left) as acquired:
                        if not acquired:
                            _contended(name, on_contention, command)
                            return None
                        return func(*args, **kwargs)
                finally:
                    local.release()
            except MutexError as exc:
                if command is None:
                    raise
                raise CommandError(in_setup_words(exc, _COMMAND_WORDS)) from exc

        return run_once

    return decorate


_turns: dict[tuple[str | None, str], threading.Lock] = {}
_turns_lock = threading.Lock()


def _turn(alias: str | None, name: str) -> threading.Lock:
    """The process's turn at a lock: its one Mutex holds one lease, so calls in this process take turns first."""
    with _turns_lock:
        return _turns.setdefault((alias, name), threading.Lock())


def _contended(name: str, policy: Policy, command: BaseCommand | None) -> None:
    if policy == "raise" or policy == "wait":
        # "wait" gets here only when this process's own calls kept the lock for the whole timeout.
        raise AlreadyRunning(f"{name!r} is already running: not run here")
    log.info("%r is already running elsewhere: skipped", name)
    if command is not None:
        command.stderr.write(f"{name!r} is already running elsewhere: skipped")


def _default_name(func: Callable[..., Any]) -> str:
    module, qualname = func.__module__, func.__qualname__
    if ".management.commands." in module and qualname.endswith("Command.handle"):
        name = "django:" + module.rpartition(".")[2]
    else:
        name = f"django:{module}.{qualname}"
    if len(name) > _MAX_NAME:
        raise ImproperlyConfigured(f"the lock name {name!r} is longer than {_MAX_NAME} characters: give @once a name")
    return name
