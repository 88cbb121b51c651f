"""What a row's ``lock_name`` says it holds: a mutex, a permit of a semaphore, or a mode of a read/write lock.

A mutex's row is named after the lock. A semaphore's permit is a row named
after the semaphore, the unit separator and the permit's number
(`_sql.semaphores`); a read/write lock's writer is a row named after the lock,
the separator and ``w``, and each reader's after the lock, the separator,
``r`` and a digest of its instance id (`_sql.rwlocks`). No mutex name holds
the separator (`_state.settings.check_name` refuses it), so a row's name alone says
which it is: the table's reads and its history read it from there.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

SEPARATOR = "\x1f"
"""Between a lock's name and what its row holds of it (a permit's number, a mode) in a row's ``lock_name``
(``chr(31)`` in SQL)."""


class RowOf(NamedTuple):
    """What one row holds, read from its name: each pair is None unless the row is of that kind."""

    semaphore: str | None = None
    permit: int | None = None
    rwlock: str | None = None
    mode: str | None = None
    """``"read"`` or ``"write"``, for a read/write lock's row."""


def row_of(lock_name: str) -> RowOf:
    """What the row named ``lock_name`` holds (all None: a mutex's)."""
    owner, separator, rest = lock_name.partition(SEPARATOR)
    if not separator:
        return RowOf()
    if rest.isascii() and rest.isdigit():
        return RowOf(semaphore=owner, permit=int(rest))
    if rest == "w":
        return RowOf(rwlock=owner, mode="write")
    if rest.startswith("r"):
        return RowOf(rwlock=owner, mode="read")
    return RowOf()


def rw_row_name(lock_name: str, instance_id: str, mode: str) -> str:
    """The ``lock_name`` of a read/write lock's row (`_sql.rwlocks`): one writer's, or each reader's own.

    A reader's carries a digest of its instance id: distinct per holder, and short enough to fit.
    """
    if mode == "write":
        return f"{lock_name}{SEPARATOR}w"
    return f"{lock_name}{SEPARATOR}r{hashlib.sha256(instance_id.encode()).hexdigest()[:12]}"
