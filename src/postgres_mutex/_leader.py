"""Who leads an election, as its lock table says: `Leader`, read once or watched for changes.

Any process can ask, candidate or not: it is one read of the lock's row,
timed by the server's clock, through the election's `LockTable`. A holder
silent past ``stale_threshold`` is no leader (it has given up its lease, or
is dead), so the read finds none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from ._metrics import LockObservation
from .errors import DatabaseError
from .table import LockTable

logger = logging.getLogger("postgres_mutex")


@dataclass(frozen=True)
class Leader:
    """Who leads an election now, as the lock table says, timed by the server's clock."""

    instance_id: str
    """The leader's id (its `Election.instance_id`)."""
    token: int | None
    """The fencing token of its term (None on a table without tokens)."""
    seconds_held: float
    """How long it has led."""
    seconds_since_heartbeat: float
    """Seconds since its last heartbeat."""
    alerting: bool
    """Silent for ``alert_threshold`` or longer: slow, or dead? (Past ``stale_threshold`` there is no leader.)"""


class LeaderReader:
    """The reads behind `Election.leader` and `Election.watch_leader`, for one election."""

    def __init__(self, table: LockTable, name: str, alert_threshold: float, stale_threshold: float) -> None:
        self._table = table
        self._name = name
        self._alert_threshold = alert_threshold
        self._stale_threshold = stale_threshold

    def read(self) -> Leader | None:
        return _leader(
            self._table.holders(
                [self._name], alert_threshold=self._alert_threshold, stale_threshold=self._stale_threshold
            )
        )

    async def read_async(self) -> Leader | None:
        return _leader(
            await self._table.holders_async(
                [self._name], alert_threshold=self._alert_threshold, stale_threshold=self._stale_threshold
            )
        )

    def watch(
        self, every: float, stopped: Callable[[], bool], wait: Callable[[float], object]
    ) -> Iterator[Leader | None]:
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
                if _identity(current) != last:
                    last = _identity(current)
                    yield current
            wait(every)

    async def watch_async(self, every: float, stopped: Callable[[], bool]) -> AsyncIterator[Leader | None]:
        """Async `watch`, sleeping on the running loop."""
        last: tuple[str, int | None] | bool | None = False
        while not stopped():
            try:
                current = await self.read_async()
            except DatabaseError as exc:
                if not exc.transient:
                    raise
                logger.warning("election %r: %s; reading the leader again in %gs", self._name, exc, every)
            else:
                if _identity(current) != last:
                    last = _identity(current)
                    yield current
            await asyncio.sleep(every)


def _leader(observations: list[LockObservation]) -> Leader | None:
    if not observations or observations[0].reclaimable:
        return None
    seen = observations[0]
    return Leader(
        instance_id=seen.holder,
        token=seen.token,
        seconds_held=seen.seconds_held,
        seconds_since_heartbeat=seen.seconds_since_heartbeat,
        alerting=seen.alerting,
    )


def _identity(leader: Leader | None) -> tuple[str, int | None] | None:
    return None if leader is None else (leader.instance_id, leader.token)
