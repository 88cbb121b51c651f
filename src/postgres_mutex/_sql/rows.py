"""What a row's ``lock_name`` says it holds: a mutex, a permit of a semaphore, or a mode of a read/write lock.

A mutex's row is named after the lock. A semaphore's permit is a row named
after the semaphore, the unit separator and the permit's number
(`_sql.permits`); a read/write lock's writer is a row named after the lock,
the separator and ``w``, and each reader's after the lock, the separator,
``r`` and a digest of its instance id (`_sql.rwlocks`). No mutex name holds
the separator (`_state.settings.check_name` refuses it), so a row's name alone says
which it is: the table's reads and its history read it from there.
"""

from __future__ import annotations

from typing import NamedTuple

from .permits import SEPARATOR


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
