"""Exceptions raised by postgres-mutex.

Everything the library raises on purpose derives from `MutexError`, except bad
arguments, which raise the built-in `ValueError` or `TypeError` at construction
and name the argument (a bad value raises `InvalidArgument`, a `ValueError`
whose ``arguments`` say which)::

    MutexError (also importable as PgMutexError, its 0.1.0 name)
    ├── LockNotHeldError          the lock was lost, or this Mutex never held it
    ├── LockAcquisitionTimeout    a blocking acquire ran out of time (also TimeoutError)
    ├── LockAlreadyHeldError      acquire on a Mutex that already holds its lock
    ├── PermitsMismatchError      a Semaphore's permits= differs from its semaphore's (also ValueError)
    └── DatabaseError             PostgreSQL could not be reached or refused a statement
        ├── OperationTimeout      a statement passed its deadline (also TimeoutError)
        └── SchemaError           the table is missing, or the role may not use or create it

No message ever contains a password: messages that quote the DSN or a server
error are redacted before they are raised.

Where a message names the library's own parts (an argument, ``create_schema()``),
the error keeps it as a `Phrase` in ``phrase``: ``phrase.render(words)`` says the
same message with other names for those parts, as the command line does with
its flags.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DatabaseError",
    "InvalidArgument",
    "LockAcquisitionTimeout",
    "LockAlreadyHeldError",
    "LockNotHeldError",
    "MutexError",
    "OperationTimeout",
    "PermitsMismatchError",
    "PgMutexError",
    "Phrase",
    "SchemaError",
]


class MutexError(Exception):
    """Base class of every error postgres-mutex raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt as it is, not by its constructor (which reads a lone argument as 0.1.0's lock name).
        return (_rebuilt, (type(self), self.args, self.__dict__))


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


class LockAlreadyHeldError(MutexError):
    """This Mutex already holds (or is acquiring) its lock.

    A Mutex holds at most one lease on its lock; a second acquire would
    otherwise silently share it. Use one Mutex per concurrent holder.
    """


class PermitsMismatchError(MutexError, ValueError):
    """A Semaphore's ``permits`` disagrees with the number its semaphore was declared with.

    The first Semaphore to use a name fixes its number of permits; one that
    says otherwise is refused rather than let the fleet disagree on the limit.
    ``semaphore``, ``permits`` (this Semaphore's) and ``stored_permits`` (the
    table's) say which. Change the number deliberately with
    `LockTable.set_permits`.
    """

    def __init__(self, message: str, *, semaphore: str, permits: int, stored_permits: int) -> None:
        super().__init__(message)
        self.semaphore = semaphore
        self.permits = permits
        self.stored_permits = stored_permits


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
    A message that names the library's own calls (``create_schema()``) keeps
    them as data in ``phrase``, so the command line can name its own instead.
    """

    phrase: Phrase | None = None

    def __init__(
        self,
        message: str | Phrase,
        *,
        transient: bool = False,
        outcome_unknown: bool = False,
        sqlstate: str | None = None,
    ) -> None:
        if isinstance(message, Phrase):
            self.phrase = message
            message = message.render()
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


# -- messages that name the library's own terms ----------------------------------------------
#
# A user of the Python API knows ``heartbeat_interval`` and ``create_schema()``; a user of the
# command line knows ``--heartbeat-interval`` and ``postgres-mutex init``. A message is written
# once, as a template whose fields in braces are either values, given by keyword, or terms: the
# names of the interface's own parts. The library raises it in the API's words; the command line
# renders the same message with its own, so no message is rewritten by matching its English.

_API_WORDS: Mapping[str, str] = {
    "call create_schema()": "call create_schema()",
    "create_schema()": "create_schema()",
    "LockTable.migrate()": "LockTable.migrate() (or 'postgres-mutex migrate')",
    "LockTable.migrate(history=True)": "LockTable.migrate(history=True) (or 'postgres-mutex migrate --history')",
    "pass blocking=True": "pass blocking=True",
    "LockTable.create(celery_beat=True)": "LockTable.create(celery_beat=True) (or 'postgres-mutex init --celery-beat')",
    "LockTable.create(apscheduler=True)": "LockTable.create(apscheduler=True) (or 'postgres-mutex init --apscheduler')",
}
"""Terms whose words in the Python API differ from their name; any other term is said as its name."""


@dataclass(frozen=True, slots=True)
class Term:
    """A part of the interface a message names: an argument, a method, a way to call it."""

    name: str


@dataclass(frozen=True, slots=True)
class Phrase:
    """A message as text and terms, to be said in one interface's words."""

    parts: tuple[str | Term, ...]

    def render(self, words: Mapping[str, str] | None = None) -> str:
        """The message, each term in ``words`` if it is there, else in the Python API's."""
        chosen = words or {}
        return "".join(
            part if isinstance(part, str) else chosen.get(part.name, _API_WORDS.get(part.name, part.name))
            for part in self.parts
        )

    @property
    def terms(self) -> tuple[str, ...]:
        """The terms named, in order, each once."""
        return tuple(dict.fromkeys(part.name for part in self.parts if isinstance(part, Term)))

    def __str__(self) -> str:
        return self.render()


_FORMATTER = string.Formatter()


def phrase(template: str, /, **values: object) -> Phrase:
    """A `Phrase` from ``template``: ``{name}`` is a value when given by keyword, else a term.

    Values are formatted as `str.format` would (``{value!r}``, ``{seconds:g}``) and kept as plain
    text, so braces in a value never read as a field.
    """
    parts: list[str | Term] = []
    for literal, field, spec, conversion in _FORMATTER.parse(template):
        if literal:
            parts.append(literal)
        if field is None:
            continue
        if field in values:
            value = _FORMATTER.convert_field(values[field], conversion)
            parts.append(format(value, spec or ""))
        else:
            parts.append(Term(field))
    return Phrase(tuple(parts))


class InvalidArgument(ValueError):
    """A `ValueError` about the arguments it names, said in the words of the interface that reports it."""

    def __init__(self, template: str, /, **values: object) -> None:
        self.phrase = phrase(template, **values)
        super().__init__(self.phrase.render())

    @property
    def arguments(self) -> tuple[str, ...]:
        """The arguments (and other terms) the message names, in order."""
        return self.phrase.terms


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An error unpickled (or copied) with its message and attributes as they were, not built again."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error
