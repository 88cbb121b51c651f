"""Exceptions raised by postgres-mutex.

Everything the library raises on purpose derives from `MutexError`, except bad
arguments, which raise the built-in `ValueError` or `TypeError` at construction
and name the argument::

    MutexError (also importable as PgMutexError, its 0.1.0 name)
    ├── LockNotHeldError          the lock was lost, or this Mutex never held it
    ├── LockAcquisitionTimeout    a blocking acquire ran out of time (also TimeoutError)
    ├── LockAlreadyHeldError      acquire on a Mutex that already holds its lock
    └── DatabaseError             PostgreSQL could not be reached or refused a statement
        ├── OperationTimeout      a statement passed its deadline (also TimeoutError)
        └── SchemaError           the table is missing, or the role may not use or create it

No message ever contains a password: messages that quote the DSN or a server
error are redacted before they are raised.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DatabaseError",
    "LockAcquisitionTimeout",
    "LockAlreadyHeldError",
    "LockNotHeldError",
    "MutexError",
    "OperationTimeout",
    "PgMutexError",
    "SchemaError",
]


class MutexError(Exception):
    """Base class of every error postgres-mutex raises on purpose."""


PgMutexError = MutexError
"""The name 0.1.0 gave `MutexError`; kept so programs written for it keep working."""


class LockNotHeldError(MutexError):
    """The lock is not (or no longer) held by this Mutex.

    Raised when a heartbeat finds the row gone or owned by another instance,
    when the local lease ran out before a heartbeat could renew it, by
    `Mutex.ensure_held()`, and when a ``with`` block ends after the lock was
    lost. ``lock_name``, ``instance_id`` and ``reason`` say which lock and why.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        lock_name: str | None = None,
        instance_id: str | None = None,
        reason: str = "",
    ) -> None:
        if message is None or lock_name is None:
            # 0.1.0 took the lock name alone: LockNotHeldError("job") or LockNotHeldError(lock_name="job").
            lock_name = message if lock_name is None else lock_name
            message = (
                f"lock {lock_name!r} is not held by this instance (it may have been reclaimed after a missed heartbeat)"
            )
        super().__init__(message)
        self.lock_name = lock_name
        self.instance_id = instance_id
        self.reason = reason or "this Mutex does not hold the lock"

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt as it is: its constructor reads a lone argument as 0.1.0's lock name.
        return (_rebuilt, (type(self), self.args, self.__dict__))


class LockAcquisitionTimeout(MutexError, TimeoutError):
    """A blocking acquire did not get the lock within its ``timeout``.

    ``holder`` is the instance that held the lock at the last attempt, when
    known; ``timeout`` the seconds waited.
    """

    def __init__(
        self,
        message: str | None = None,
        timeout: float | None = None,
        *,
        lock_name: str | None = None,
        holder: str | None = None,
    ) -> None:
        if message is None or lock_name is None:
            # 0.1.0 took (lock_name, timeout), by position or by keyword.
            lock_name = message if lock_name is None else lock_name
            message = f"timed out after {timeout}s waiting to acquire lock {lock_name!r}"
        super().__init__(message)
        self.lock_name = lock_name
        self.holder = holder
        self.timeout = timeout

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt, (type(self), self.args, self.__dict__))


class LockAlreadyHeldError(MutexError):
    """This Mutex already holds (or is acquiring) its lock.

    A Mutex holds at most one lease on its lock; a second acquire would
    otherwise silently share it. Use one Mutex per concurrent holder.
    """


class DatabaseError(MutexError):
    """PostgreSQL could not be reached, or refused a statement.

    ``outcome_unknown`` is true when the statement may have reached the server
    but its reply never came. ``transient`` is true for failures that may pass
    on their own (lost connection, deadline, server restart); false for errors
    the server reported about the statement itself. ``sqlstate`` is the
    server's error code, when it sent one. The original psycopg error is
    chained as ``__cause__`` unless it holds a secret: its text had to be
    redacted, or it is a failed connect's, which keeps the connection's
    options, the password among them (then nothing is chained at all).
    """

    def __init__(
        self,
        message: str,
        *,
        transient: bool = False,
        outcome_unknown: bool = False,
        sqlstate: str | None = None,
    ) -> None:
        super().__init__(message)
        self.transient = transient
        self.outcome_unknown = outcome_unknown
        self.sqlstate = sqlstate


class OperationTimeout(DatabaseError, TimeoutError):
    """A database operation passed its deadline (``operation_timeout``).

    The connection it used is discarded; the next operation opens a new one.
    """


class SchemaError(DatabaseError):
    """The lock table is missing, or the role lacks a privilege on it.

    Raised by `Mutex.create_schema()` when the role may not create the table,
    and by any operation when the table does not exist or may not be used.
    """


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An error unpickled (or copied) with its message and attributes as they were, not built again."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error
