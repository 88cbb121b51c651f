"""`EngineHost`: what an engine needs of the client that made it, declared in one typed place.

The engines (sync and async) never name the client: the client's core is
their host, and hands itself to each engine it makes. Everything an engine
shares with its client and its sibling engines is declared here, and
nothing else is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._sql import Statements

if TYPE_CHECKING:
    from .._base.secrets import Redactor
    from .._state.locks import StateLock
    from .._state.session import Session
    from .._state.steps import Cleanup


class Shapes:
    """The statements for each table's shape (columns), inspected once per client and shared by its engines.

    It remembers which tables had a history when last inspected, so that a
    history dropped while its locks are in use is told once per client,
    whichever engine finds out first.
    """

    def __init__(self, state_lock: StateLock) -> None:
        self._state_lock = state_lock
        self._statements: dict[str, Statements] = {}
        self._with_history: set[str] = set()
        self.get: Callable[[str], Statements | None] = self._statements.get
        """The statements for ``table``, if inspected: the dict's own ``get`` (asked twice per lock cycle)."""

    def forget(self, table: str) -> None:
        """The table changed (migrated, or a column it names is gone): inspect it again before its next use."""
        self._statements.pop(table, None)

    def learn(self, statements: Statements) -> bool:
        """Keep what an inspection found; True when the table had a history before and has none now."""
        table = statements.names.table_name
        has_history = statements.shape.history
        with self._state_lock:
            self._statements[table] = statements
            had_history = table in self._with_history
            if has_history:
                self._with_history.add(table)
            else:
                self._with_history.discard(table)
        return had_history and not has_history


class EngineHost(Protocol):
    """The client's side of its engines: one per client (its core), shared by all of them."""

    session: Session
    """The lease of the client's holds: heartbeat groups, lease expiry, the event thread."""
    shapes: Shapes
    redactor: Redactor
    """What masks the DSN's password in every message an engine raises or logs."""
    operation_timeout: float
    """The deadline of the client's own statements (and of an engine's shutdown)."""

    @property
    def state_lock(self) -> StateLock:
        """The client's state lock: every change to a lock state, a hold or a group happens under it."""
        ...

    def connect_kwargs(self, role: str) -> dict[str, Any]:
        """How an engine connects, given what the connection is for (its ``application_name``)."""
        ...

    def adopt_cleanup(self, cleanup: Cleanup) -> None:
        """Where a clean-up goes when its engine closes before it could run."""
        ...
