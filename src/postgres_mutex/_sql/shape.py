"""What a lock table has (`TableShape`), as `_sql.schema.inspect_table` finds it: the statements are made for it.

Tables come in shapes: the README's five columns; the same plus a ``token``
column fed by a sequence, the columns that name a holder's session, and what
semaphores, read/write locks, minimum holds, fair locks and leases need, which
`migrate` adds; and the functions of the common acquire and release
(`_sql.functions`). `CURRENT` is the shape `create_schema` makes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class TableShape:
    """What a lock table has beyond the README's five columns."""

    tokens: bool
    """A ``token`` column fed by the table's sequence: acquisitions get fencing tokens."""
    history: bool = False
    """A history table next to it (``<table>_history``): one row per hold, written by the same statements."""
    sessions: bool = False
    """The columns that name a holder's session (``session_key``, ``session_hold``, ``reclaim_after``):
    a holder whose session ended may be reclaimed before ``stale_threshold``."""
    semaphores: bool = False
    """The semaphores' table (``<table>_semaphores``) and the permit columns and constraints (`_sql.semaphores`)."""
    rwlocks: bool = False
    """The read/write locks' gates (``<table>_rwlocks``) and the columns and constraints of their rows
    (`_sql.rwlocks`)."""
    holds: bool = False
    """The ``hold_until`` column: a holder may ask for a minimum hold, and a row released before it stays."""
    fair: bool = False
    """The fair locks' queue of waiters (``<table>_queue``, `_sql.fair`): a release hands the lock to the oldest."""
    leases: bool = False
    """The leases' table (``<table>_leases``), which the role may read, and the ``lease_key`` column: a mutex's
    row may follow its holder's lease, which one statement renews for every lock of a heartbeat group
    (`_sql.leases`); a row is judged by the later of its own heartbeat and its lease's."""
    lease_column: bool = False
    """The ``lease_key`` column: a take-over or a hand-off clears it, so the new holder's row does not follow the
    former holder's lease (whether or not the role may read the leases)."""
    lease_renewal: bool = False
    """The role may renew leases too (SELECT, INSERT, UPDATE, DELETE on the leases' table)."""
    functions_made: bool = False
    """The common acquire's and release's functions (`lock_functions`) are there, whoever may execute them."""
    functions: bool = False
    """The common acquire and release are functions on the server the role may execute (`lock_functions`), on a
    table with every column their bodies read, whose leases the role may read."""

    @classmethod
    def inspected(cls, row: tuple[object, ...]) -> tuple[bool, TableShape]:
        """Whether the table exists, and its shape, from `_sql.schema.inspect_table`'s row."""
        exists, token, history, sessions_, semaphores, rwlocks, hold_until, queue, lease_level, functions = row
        assert isinstance(lease_level, int)
        assert isinstance(functions, int)
        shape = cls(
            tokens=bool(token),
            history=bool(history),
            sessions=bool(sessions_),
            semaphores=bool(semaphores),
            rwlocks=bool(rwlocks),
            holds=bool(hold_until),
            fair=bool(queue),
            functions_made=functions >= 1,
            **cls.with_leases(lease_level),
        )
        # Their bodies are the plain statements of the table's current shape (`CURRENT`): a table recreated
        # in an older shape keeps functions that no longer fit it.
        fits = shape.tokens and shape.sessions and shape.holds and shape.lease_column and shape.leases
        return bool(exists), replace(shape, functions=functions == 2 and fits)

    @staticmethod
    def with_leases(level: int) -> dict[str, bool]:
        """The lease fields of a shape, from the inspection's answer (`_sql.schema.inspect_table`)."""
        return {"lease_column": level >= 1, "leases": level >= 2, "lease_renewal": level >= 3}

    @property
    def renews_by_lease(self) -> bool:
        """Whether holders renew by lease here: a table with tokens and leases the role may renew, and no
        history (whose alert counts the per-row heartbeat keeps)."""
        return self.lease_renewal and self.leases and self.tokens and not self.history


CURRENT = TableShape(
    tokens=True,
    sessions=True,
    semaphores=True,
    rwlocks=True,
    holds=True,
    fair=True,
    leases=True,
    lease_column=True,
    lease_renewal=True,
)
