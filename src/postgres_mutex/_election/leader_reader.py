# Generated from leader_reader_async.py by tools/async_to_sync.py: do not edit.
# Change the async module and run `python tools/async_to_sync.py`.
"""Who leads an election, read from its lock table once, or watched for changes.

Any process can ask, candidate or not: it is one read of the lock's row,
timed by the server's clock, through the election's `LockTable`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..errors import DatabaseError
from .leader import Leader, identity, leader_of

if TYPE_CHECKING:
    from ..table import LockTable

logger = logging.getLogger("postgres_mutex")

Wait = Callable[[float], object]
"""How a watch sleeps between reads (it may end early)."""


class LeaderReader:
    """The reads behind `Election.leader` and `Election.watch_leader`, for one election."""

    def __init__(self, table: LockTable, name: str, alert_threshold: float, stale_threshold: float) -> None:
        self._table = table
        self._name = name
        self._alert_threshold = alert_threshold
        self._stale_threshold = stale_threshold

    def read(self) -> Leader | None:
        return leader_of(
            self._table.holders(
                [self._name], alert_threshold=self._alert_threshold, stale_threshold=self._stale_threshold
            )
        )

    def watch(self, every: float, stopped: Callable[[], bool], wait: Wait) -> Iterator[Leader | None]:
        """The leader now, then at each change, read every ``every`` seconds until ``stopped()``.

        A change is a new instance or a new term (token). A read that fails on
        a transient error is logged and retried at the next read; any other
        failure is raised. ``wait`` sleeps between reads (and may end early).
        """
        last: tuple[str, int | None] | bool | None = False
        while not stopped():
            try:
                current = self.read()
            except DatabaseError as exc:
                if not exc.transient:
                    raise
                logger.warning("election %r: %s; reading the leader again in %gs", self._name, exc, every)
            else:
                if identity(current) != last:
                    last = identity(current)
                    yield current
            wait(every)
