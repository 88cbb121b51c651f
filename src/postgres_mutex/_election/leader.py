"""Who leads an election, as its lock table says: `Leader`, and what a read of the lock's row means.

A holder silent past ``stale_threshold`` is no leader (it has given up its
lease, or is dead), so a read finds none. The reads themselves are
`_election.leader_reader_async`'s (and its sync twin's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .._observe.hooks import LockObservation

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


def leader_of(observations: list[LockObservation]) -> Leader | None:
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


def identity(leader: Leader | None) -> tuple[str, int | None] | None:
    return None if leader is None else (leader.instance_id, leader.token)
