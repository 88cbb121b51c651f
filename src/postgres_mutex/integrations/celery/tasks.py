"""Singleton Celery tasks: a task that must not run twice at once, across every worker of the fleet.

``@app.task(base=SingletonTask)`` runs the task's body under a `Mutex` named
after the task (and, with ``singleton_key``, after chosen arguments). The
lock is released when the body ends in any way; when the worker process
dies, its database session ends and the lock is reclaimed after
``reclaim_disconnected_after`` (60 s unless configured), or after the lock's
``stale_threshold`` if the session outlives it (a machine that vanished).
A retry the body asks for is sent once the body has ended and its lock is
released, so it never finds its own attempt holding the lock.
"""

from __future__ import annotations

import contextvars
import hashlib
import inspect
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from celery import Task, signals
from celery.exceptions import Reject

from postgres_mutex.client import MutexClient
from postgres_mutex.errors import MutexError
from postgres_mutex.mutex import Mutex

__all__ = ["SKIPPED", "TASK_DEFAULTS", "SingletonTask", "TaskAlreadyRunning", "close_clients", "current_mutex"]

logger = logging.getLogger("postgres_mutex.integrations.celery")

SKIPPED = "postgres-mutex: skipped, the task is already running"
"""What a singleton task with ``singleton_on_contention = "skip"`` returns when another run holds its lock.

A string, so that every result backend and serializer carries it:
``result.get() == SKIPPED`` tells a skipped run from one that ran.
"""

TASK_DEFAULTS: Mapping[str, float] = {"reclaim_disconnected_after": 60.0}
"""The Mutex options of singleton tasks unless ``postgres_mutex_task_options`` (or the task's
``singleton_options``) says otherwise; the rest are `Mutex`'s defaults (heartbeat every 10 s,
alert at 30 s, reclaim of a silent holder at 10 min)."""

Policy = Literal["skip", "wait", "raise"]
_POLICIES = ("skip", "wait", "raise")
_MAX_NAME = 64


@dataclass
class _Run:
    """One run of a singleton task's body: the Mutex it holds, and the retries it asked for, not yet sent."""

    task: Task
    mutex: Mutex
    retrying: bool = False
    retries: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)


_current: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("postgres_mutex_celery_task", default=None)


class TaskAlreadyRunning(MutexError):
    """A singleton task with ``singleton_on_contention = "raise"`` found its lock held by another run.

    Carries one argument, its message, so that result backends can rebuild it.
    """


def current_mutex() -> Mutex:
    """The `Mutex` the running singleton task holds: for ``mutex.fence(conn)`` on the task's own writes.

    Raises `MutexError` outside the body of a singleton task.
    """
    run = _current.get()
    if run is None:
        raise MutexError("current_mutex() is only available inside the body of a SingletonTask")
    return run.mutex


class _Clients:
    """One `MutexClient` per process and DSN, made in the process that uses it.

    A prefork child must not use connections its parent opened, so a client
    made before a fork is left to the parent and a new one is made.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[str, tuple[int, MutexClient]] = {}

    def get(self, dsn: str) -> MutexClient:
        pid = os.getpid()
        with self._lock:
            known = self._clients.get(dsn)
            if known is None or known[0] != pid:
                known = (pid, MutexClient(dsn))
                self._clients[dsn] = known
            return known[1]

    def close(self) -> None:
        """Close this process's clients: their locks are released, their connections closed."""
        pid = os.getpid()
        with self._lock:
            mine = [client for owner, client in self._clients.values() if owner == pid]
            self._clients.clear()
        for client in mine:
            client.close()


_clients = _Clients()


def close_clients(**_: Any) -> None:
    """Close the clients singleton tasks opened in this process (a worker does it as it shuts down).

    A task run after this opens a new one.
    """
    _clients.close()


# A prefork child as it exits, and a solo or threads worker as it stops: end their sessions cleanly.
signals.worker_process_shutdown.connect(close_clients, weak=False, dispatch_uid="postgres_mutex.tasks.child")
signals.worker_shutdown.connect(close_clients, weak=False, dispatch_uid="postgres_mutex.tasks.worker")


def lock_name_for(base: str, arguments: Sequence[tuple[str, Any]]) -> str:
    """The lock's name: ``base``, then the chosen arguments; hashed past the table's 64 characters."""
    name = f"{base}({', '.join(f'{key}={value!r}' for key, value in arguments)})" if arguments else base
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "backslashreplace")).hexdigest()[:20]
    return f"{name[: _MAX_NAME - len(digest) - 1]}#{digest}"


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task base class whose runs never overlap: ``@app.task(base=SingletonTask)``.

    Options, given to ``@app.task(...)`` as Celery passes task attributes:

    - ``singleton_key``: names of the arguments that make runs distinct
      (default: none, one run of the task at a time);
    - ``singleton_on_contention``: ``"skip"`` (default: log, and return
      `SKIPPED`), ``"wait"`` (up to ``singleton_timeout`` seconds, then raise
      `LockAcquisitionTimeout`) or ``"raise"`` (`TaskAlreadyRunning`);
    - ``singleton_timeout``: how long ``"wait"`` waits (default 60 s);
    - ``singleton_lock_name``: the lock's name before the arguments
      (default: the task's name);
    - ``singleton_options``: `Mutex` options for this task, over the app's
      ``postgres_mutex_task_options`` and `TASK_DEFAULTS`.

    The app's ``postgres_mutex_dsn`` names the database of the lock table.
    Inside the body, ``self.singleton_mutex`` (or `current_mutex`) is the
    held `Mutex`: fence the task's own writes with it. A lock lost while the
    body runs fails the task with `LockNotHeldError` when the body ends. A
    retry (``self.retry``, ``autoretry_for``) is sent once the body has ended
    and the lock is released: it never runs beside its attempt, nor finds
    that attempt's lock held.
    """

    abstract = True
    singleton_key: ClassVar[Sequence[str]] = ()
    singleton_on_contention: ClassVar[Policy] = "skip"
    singleton_timeout: ClassVar[float] = 60.0
    singleton_lock_name: ClassVar[str | None] = None
    singleton_options: ClassVar[Mapping[str, Any]] = {}

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Check the task's singleton options as soon as it is registered, not at its first run."""
        super().on_bound(app)
        if cls.singleton_on_contention not in _POLICIES:
            raise ValueError(
                f"task {cls.name!r}: singleton_on_contention must be one of {', '.join(_POLICIES)}, "
                f"not {cls.singleton_on_contention!r}"
            )
        if isinstance(cls.singleton_key, str):
            raise TypeError(
                f"task {cls.name!r}: singleton_key is a list of argument names, "
                f"not one string: singleton_key=[{cls.singleton_key!r}]"
            )

    @property
    def singleton_mutex(self) -> Mutex:
        """The `Mutex` this run holds (see `current_mutex`)."""
        return current_mutex()

    def singleton_lock_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The name of the lock a run with these arguments takes."""
        base = self.singleton_lock_name or self.name
        if not self.singleton_key:
            return lock_name_for(base, ())
        bound = inspect.signature(self.run).bind(*args, **kwargs)
        bound.apply_defaults()
        missing = [key for key in self.singleton_key if key not in bound.arguments]
        if missing:
            raise TypeError(f"task {self.name!r}: singleton_key names {missing}, which are not its arguments")
        return lock_name_for(base, [(key, bound.arguments[key]) for key in self.singleton_key])

    def _singleton_mutex(self, lock_name: str) -> Mutex:
        conf = self.app.conf
        dsn = conf.get("postgres_mutex_dsn")
        if not dsn:
            raise MutexError(
                f"task {self.name!r} is a SingletonTask but postgres_mutex_dsn is not set: "
                "app.conf.postgres_mutex_dsn = 'postgresql://...'"
            )
        options = {**TASK_DEFAULTS, **dict(conf.get("postgres_mutex_task_options") or {}), **self.singleton_options}
        return _clients.get(str(dsn)).mutex(lock_name, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under the task's lock, or skip, wait or raise when another run holds it.

        A retry the body asks for (``self.retry``, ``autoretry_for``) is sent
        here, after the body has ended and the lock is released, not from
        inside the body as Celery sends it. Sent from inside, a worker that
        is idle takes the retry up while its own attempt still holds the
        lock, and skips it (or raises, or waits). Releasing the lock as the
        retry is sent, instead, would let the retry run beside the rest of
        its attempt's body (``self.retry(throw=False)`` returns into the
        body, and any ``finally`` or ``with`` in it runs after the message
        left). Sent after the release, the retry cannot start before its
        attempt's body has ended, and finds the lock free unless another run
        took it meanwhile: then the retry is a run like any other, and the
        policy says what it does.
        """
        lock_name = self.singleton_lock_for(args, kwargs)
        waits = self.singleton_on_contention == "wait"
        mutex = self._singleton_mutex(lock_name)
        run = _Run(self, mutex)
        try:
            try:
                with mutex.acquire(blocking=waits, timeout=self.singleton_timeout if waits else None) as acquired:
                    if not acquired:
                        return self._contended(lock_name, mutex.last_holder)
                    reset = _current.set(run)
                    try:
                        return super().__call__(*args, **kwargs)
                    finally:
                        _current.reset(reset)
            finally:
                mutex.close()
        finally:
            self._send_retries(run)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``Task.retry``, but the retry is sent when the body has ended and its lock is released."""
        run = _current.get()
        if run is None or run.task is not self:
            return super().retry(*args, **kwargs)
        run.retrying = True
        try:
            return super().retry(*args, **kwargs)
        finally:
            run.retrying = False

    def apply_async(self, *args: Any, **options: Any) -> Any:
        """Celery's ``Task.apply_async``; a retry asked for in the body is kept until the body ends (see `retry`)."""
        run = _current.get()
        if run is not None and run.task is self and run.retrying:
            run.retries.append((args, options))
            return None  # Celery's retry does not use what sending returns
        return super().apply_async(*args, **options)

    def _send_retries(self, run: _Run) -> None:
        retries, run.retries = run.retries, []
        for args, options in retries:
            try:
                super().apply_async(*args, **options)
            except Exception as exc:  # what Celery's retry does when it cannot send the message
                raise Reject(exc, requeue=False) from exc

    def _contended(self, lock_name: str, holder: str | None) -> str:
        by = f" by {holder}" if holder else ""
        if self.singleton_on_contention == "raise":
            raise TaskAlreadyRunning(f"task {self.name!r} is already running: its lock {lock_name!r} is held{by}")
        logger.info("task %s skipped: its lock %r is held%s", self.name, lock_name, by)
        return SKIPPED
