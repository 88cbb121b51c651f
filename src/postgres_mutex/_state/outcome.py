"""What an acquire's reply means: acquired, reclaimed, taken back, or contended.

Read alike by the sync and async paths, and by every kind of lock (`_state.kind`); nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime


class Outcome(enum.Enum):
    ACQUIRED = "acquired"
    """No row existed: ours was inserted."""
    RECLAIMED = "reclaimed"
    """Another instance's row was past ``stale_threshold``: we took it over."""
    REACQUIRED = "reacquired"
    """The row already carried our instance_id: we took it back."""
    CONTENDED = "contended"
    """Another instance holds the lock."""

    @property
    def acquired(self) -> bool:
        return self is not Outcome.CONTENDED


@dataclass(frozen=True, slots=True)
class AcquireResult:
    outcome: Outcome
    holder: str | None
    """Contended: the current holder. Reclaimed: the previous holder."""
    heartbeat_age: float | None
    """Seconds since the (previous) holder's last heartbeat, by the server's clock."""
    acquired_at: datetime | None = None
    """When acquired: the new row's ``acquired_at``, which identifies this hold."""
    token: int | None = None
    """When acquired on a table with tokens: this acquisition's fencing token."""
    holder_mode: str | None = None
    """For a read/write lock: the mode of ``holder``'s row (``"read"`` or ``"write"``)."""


def interpret_acquire(row: Sequence[object] | None, instance_id: str) -> AcquireResult:
    """Read the acquire statement's single row: ``(inserted, holder, heartbeat_age, acquired_at, token)``.

    ``inserted`` is NULL when the INSERT neither inserted nor took over the
    row: the lock is held by someone else. ``holder`` and ``heartbeat_age``
    come from the statement's snapshot; they are NULL when the row appeared
    after the snapshot was taken.
    """
    if row is None or len(row) != 5:
        raise ValueError(f"unexpected acquire result {row!r}")
    inserted, holder, age, acquired_at, token = row
    holder_id = None if holder is None else str(holder)
    heartbeat_age = None if age is None else float(age)  # type: ignore[arg-type]
    if inserted is None:
        return AcquireResult(Outcome.CONTENDED, holder_id, heartbeat_age)
    if not isinstance(acquired_at, datetime) or not (token is None or isinstance(token, int)):
        raise ValueError(f"unexpected acquire result {row!r}")
    if inserted:
        # A holder seen in the snapshot released in the meantime: a plain acquire.
        return AcquireResult(Outcome.ACQUIRED, None, None, acquired_at, token)
    if holder_id == instance_id or holder_id is None:
        return AcquireResult(Outcome.REACQUIRED, instance_id, heartbeat_age, acquired_at, token)
    return AcquireResult(Outcome.RECLAIMED, holder_id, heartbeat_age, acquired_at, token)


@dataclass(frozen=True, slots=True)
class PermitReply:
    """What a semaphore's acquire statement (`_sql.semaphores.acquire_permit`) said."""

    result: AcquireResult
    row_name: str | None
    """The ``lock_name`` of the permit row won (None if none was)."""
    stored_permits: int | None
    """The semaphore's N in the table: None if another session was declaring it at that moment."""
    held: int
    """How many of its rows were held in the statement's snapshot."""

    def retry_at_once(self, count: int | None) -> bool:
        """Nothing won, yet there is reason to try again without waiting (for a semaphore of size ``count``):
        it was being declared, or another contender won the free permit this one chose while others were free."""
        if count is None or self.result.outcome.acquired:
            return False
        return self.stored_permits is None or (self.stored_permits == count and self.held < count - 1)


def read_acquire(
    row: Sequence[object] | None, instance_id: str, count: int | None, *, wide: bool = False
) -> PermitReply:
    """Read a mutex's acquire row (`interpret_acquire`) or, with ``count`` (a semaphore's size) or
    ``wide`` (a read/write lock's), the same five columns, then the row's ``lock_name``, the stored N (for a
    read/write lock: 1 to try again at once) and how many rows were held; a read/write lock's, then the mode of
    the holder shown."""
    if count is None and not wide:
        return PermitReply(interpret_acquire(row, instance_id), None, None, 0)
    if row is None or len(row) != (9 if wide else 8):
        raise ValueError(f"unexpected acquire result {row!r}")
    result = interpret_acquire(row[:5], instance_id)
    if wide and isinstance(row[8], str):
        result = dataclasses.replace(result, holder_mode=row[8])
    row_name, stored, held = row[5:8]
    if result.outcome.acquired and not isinstance(row_name, str):
        raise ValueError(f"unexpected acquire result {row!r}")
    return PermitReply(
        result,
        row_name if isinstance(row_name, str) else None,
        None if stored is None else int(stored),  # type: ignore[call-overload]
        int(held),  # type: ignore[call-overload]
    )
