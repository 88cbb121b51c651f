"""What a `Mutex` is made of: its arguments checked, its settings, and the lock state it keeps on its client.

Kept apart from `_mutex`, whose module is the API: the checks a constructor
makes are the same for every primitive built on a lock (an `Election` makes
its Mutex through them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._events import LockEvents, LostCallback
from ._metrics import guard
from ._settings import Timing, check_lock_name, check_name
from ._sql import Names
from ._state import LockState
from .errors import InvalidArgument

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from ._core import ClientCore
    from .client import MutexClient


@dataclass(frozen=True)
class MutexConfig:
    """A Mutex's settings, read-only: what 0.1.0 exposed as ``mutex.config``."""

    lock_name: str
    instance_id: str
    table: str
    heartbeat_interval: float
    alert_threshold: float
    stale_threshold: float
    poll_interval: float
    operation_timeout: float
    reclaim_disconnected_after: float | None = None
    hold_at_least: float | None = None
    """Each acquire's minimum hold by default, in seconds (None: none)."""


class MissingLockName(TypeError, ValueError):
    """``Mutex()`` without a lock name: a `TypeError` as Python says it, and a `ValueError` as 0.1.0 did."""


def checked_names(lock_name: str | None, instance_id: str | None) -> tuple[str, str | None]:
    """The lock's name and the instance id asked for (None: the default one), checked."""
    if lock_name is None:
        raise MissingLockName("Mutex() needs a lock_name: Mutex(dsn, 'nightly-report')")
    check_lock_name(lock_name, "lock_name")
    if instance_id == "":
        instance_id = None  # as in 0.1.0: an unset environment variable means the default id
    if instance_id is not None:
        check_name(instance_id, "instance_id")
    return lock_name, instance_id


def check_reclaim_source(timing: Timing, client: MutexClient) -> None:
    """``reclaim_disconnected_after`` needs connections of the library's own: it names their sessions.

    A pool's connections are the application's: one may be closed by the pool
    while this process lives on, or outlive it behind a pooler. Refused at
    construction, rather than reclaim a live holder or never reclaim early.
    """
    if timing.reclaim_disconnected_after is not None and client.dsn is None:
        raise InvalidArgument(
            "{reclaim_disconnected_after} needs the library's own connections (a dsn): it names this process's "
            "database session in the lock's row, and a pool's connections are not this process's to vouch for"
        )


def new_lock_state(
    core: ClientCore,
    *,
    names: Names,
    lock_name: str,
    instance_id: str,
    timing: Timing,
    metrics: object | None,
    on_lost: LostCallback | None,
    tracer_provider: TracerProvider | None,
    permits: int | None = None,
    rw_mode: str | None = None,
) -> LockState:
    """The state of one Mutex's lock on ``core``'s client, with how its events are told."""
    events = LockEvents(
        lock_name=lock_name,
        instance_id=instance_id,
        hook=guard(metrics),
        on_lost=on_lost,
        alert_threshold=timing.alert_threshold,
        stale_threshold=timing.stale_threshold,
        permits=permits,
        rw_mode=rw_mode,
    )
    return LockState(
        names=names,
        lock_name=lock_name,
        instance_id=instance_id,
        timing=timing,
        events=events,
        tracing=core.tracing(tracer_provider, names.table_name),
        state_lock=core.state_lock,
        permits=permits,
        rw_mode=rw_mode,
    )
