"""A fair Mutex's kind: its waiters acquire in the order they came (`_sql.fair`).

What differs from a Mutex's: its acquire queues a waiter that does not win,
and wins a free lock only if no live waiter came before; its release hands
the row to the oldest live waiter, and notifies that one alone; a waiter that
gives up leaves the line (and hands on a row handed to it meanwhile) as a
stray row of its is deleted. The rest (the lease, the heartbeat, fencing,
the history, ``on_lost``) is every Mutex's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from .._state.kind import LockKind

if TYPE_CHECKING:
    from .._sql import Statement, Statements
    from .._state.settings import Timing

_LIVE_POLLS = 4
"""A waiter not seen for this many poll intervals (and a second) is passed over by a release."""


def waiter_live_seconds(timing: Timing) -> float:
    """How long a fair lock's waiter counts as live after its last attempt (the statements' ``waiter_live_seconds``).

    A waiter attempts at least once per ``poll_interval``: one silent for a few is gone.
    """
    return _LIVE_POLLS * timing.poll_interval + 1.0


class FairKind(LockKind):
    """A fair Mutex's: one holder at a time, and the lock handed to waiters in the order they came."""

    takes_minimum_hold: ClassVar[bool] = False
    queues: ClassVar[bool] = True

    def params(self, lock_name: str, row_name: str, timing: Timing) -> dict[str, object]:
        return {"waiter_live_seconds": waiter_live_seconds(timing)}

    def migrated(self, statements: Statements) -> bool:
        return statements.acquire_fair is not None

    def acquire_statement(self, statements: Statements, name: str) -> Statement:
        if statements.acquire_fair is None:
            raise self.missing(name, statements, "queue of waiters that fair=True uses")
        return statements.acquire_fair

    def release_statement(self, statements: Statements) -> Statement:
        # A hold acquired before the table lost its queue (it never does, short of a DROP): released as a Mutex's.
        return statements.release_fair or statements.release

    def stray_cleanup(self, statements: Statements) -> Statement | None:
        return statements.leave_fair


FAIR_MUTEX = FairKind()
