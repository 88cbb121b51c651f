"""What both flavours of `LockTable` share: its records, its arguments checked, the flows it runs.

The methods that run a flow are written once, async (`_table.methods_async`), and
their sync twins generated (`_table.methods`); `table` puts both on `LockTable`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from .._observe.hooks import LockObservation
from .._sql import APSCHEDULER_RUNS, CELERY_BEAT_STATE, Names
from .._state import admin_flows, steps
from .._state.rows import row_of
from .._state.settings import check_name, check_names, check_seconds, check_thresholds
from ..errors import InvalidArgument

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ..client import ClientCore, MutexClient


@dataclass(frozen=True)
class ForcedRelease:
    """Whom `LockTable.force_release` removed."""

    lock_name: str
    holder: str
    seconds_since_heartbeat: float
    """By the server's clock, at the moment of the release."""
    token: int | None
    """The removed hold's fencing token (None on a table without tokens)."""


@dataclass(frozen=True)
class PermitsChanged:
    """What `LockTable.set_permits` did."""

    name: str
    permits: int
    """The semaphore's number of permits now."""
    previous: int | None
    """Its number before (None: nobody had used it)."""
    released: int
    """How many holders of permits at or above the new number were released."""


@dataclass(frozen=True)
class HoldRecord:
    """One hold of a lock, as the history recorded it (times by the server's clock)."""

    lock_name: str
    token: int | None
    """The hold's fencing token (None on a table without tokens)."""
    holder: str
    """The holder's instance_id."""
    acquired_at: datetime
    ended_at: datetime | None
    """None while the hold lasts. For an end nobody recorded (``ended_how`` None), when the next
    acquire found the hold over."""
    ended_how: str | None
    """``released``, ``reclaimed`` (by ``ended_by``, after the stale threshold), ``replaced`` (taken
    back by its own instance), ``lost`` (its lease ran out; its holder deleted the row after),
    ``abandoned`` (a row an unanswered acquire left, deleted once the database answered),
    ``force_released`` (an operator's override); None while the hold lasts, or once ended by a
    process that keeps no history (a release before 0.2.0, or one started before the history)."""
    ended_by: str | None
    """Who reclaimed the lock, for ``reclaimed`` and ``replaced``."""
    alerts: int
    """Alert episodes during the hold: heartbeat silences past the alert threshold."""
    held_for: float
    """Seconds from acquired_at to ended_at (or to now, while the hold lasts)."""
    semaphore: str | None = None
    """For a permit of a `Semaphore`: the semaphore's name (``lock_name`` is then its permit row's)."""
    permit: int | None = None
    """For a permit of a `Semaphore`: the permit's number, from 0."""
    rwlock: str | None = None
    """For a hold of an `RWLock`: the read/write lock's name (``lock_name`` is then its holder's row's)."""
    mode: str | None = None
    """For a hold of an `RWLock`: ``"read"`` or ``"write"``."""


class TableBase:
    """A lock table's name, timeout and client (`LockTable` sets them), and the flows its methods run."""

    _names: Names
    _timeout: float
    """The deadline of each of its statements."""
    _client: MutexClient
    _core: ClientCore

    @property
    def name(self) -> str:
        """The table's name, as given (``"mutex_lock"``, ``"ops.mutex_lock"``)."""
        return self._names.table_name

    def __repr__(self) -> str:
        return f"<LockTable {self.name} on {self._client!r}>"

    def _holders(
        self, lock_names: Iterable[str] | None, alert_threshold: float, stale_threshold: float
    ) -> steps.Flow[list[LockObservation]]:
        alert, stale = check_thresholds(alert_threshold, stale_threshold)
        names = check_names(lock_names, "lock_names")
        return admin_flows.holders(self._names, names, self._timeout, alert_threshold=alert, stale_threshold=stale)

    def _history(
        self, lock_name: str | None, since: datetime | timedelta | None, limit: int
    ) -> steps.Flow[list[tuple[Any, ...]]]:
        if lock_name is not None:
            check_name(lock_name, "lock_name")
        moment: datetime | None = None
        age: float | None = None
        if isinstance(since, timedelta):
            age = check_seconds(since.total_seconds(), "since", allow_zero=True)
        elif since is not None:
            if not isinstance(since, datetime) or since.tzinfo is None:
                raise InvalidArgument(
                    "{since} must be a timezone-aware datetime or a timedelta, got {value!r}", value=since
                )
            moment = since
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidArgument("{limit} must be a positive integer, got {value!r}", value=limit)
        return admin_flows.read_history(
            self._names, self._timeout, lock_name=lock_name, since=moment, since_seconds=age, limit=limit
        )

    def _force_release(
        self, lock_name: str, permit: int | None, writer: bool, reader: str | None
    ) -> steps.Flow[tuple[str, float, int | None] | None]:
        check_release(lock_name, permit, writer, reader)
        return admin_flows.force_release(
            self._names, lock_name, self._timeout, permit=permit, writer=writer, reader=reader
        )


def hold_record(row: tuple[Any, ...]) -> HoldRecord:
    """A row of the history read, with what its row's name says it held (`row_of`)."""
    return HoldRecord(*row, **row_of(str(row[0]))._asdict())


def history_options(history: bool, retention: float | None) -> dict[str, Any]:
    if not isinstance(history, bool):
        raise InvalidArgument("{history} must be True or False, got {value!r}", value=history)
    if retention is not None:
        if not history:
            raise InvalidArgument("{history_retention} applies to a history: pass {history=True} with it")
        retention = check_seconds(retention, "history_retention")
    return {"history": history, "history_retention": retention}


def integration_tables(celery_beat: bool | str, apscheduler: bool | str) -> dict[str, str]:
    """``{integration: its table's name}`` for the integrations asked for (True: the default name)."""
    tables: dict[str, str] = {}
    for integration, value, default in (
        ("celery_beat", celery_beat, CELERY_BEAT_STATE),
        ("apscheduler", apscheduler, APSCHEDULER_RUNS),
    ):
        if value is False:
            continue
        name = default if value is True else value
        try:
            tables[integration] = Names(name).table_name
        except (TypeError, ValueError):
            raise InvalidArgument(
                "{" + integration + "} must be True, False or a table's name ('name' or 'schema.name'), got {value!r}",
                value=value,
            ) from None
    return tables


def check_release(lock_name: str, permit: int | None, writer: bool, reader: str | None) -> None:
    """``force_release``'s arguments checked: a lock's name, or a semaphore's and one of its permits, or a
    read/write lock's and its writer or one of its readers."""
    check_name(lock_name, "lock_name")
    if permit is not None and (isinstance(permit, bool) or not isinstance(permit, int) or permit < 0):
        raise ValueError(f"permit must be a permit's number, an int from 0 (as holders() shows it), not {permit!r}")
    if not isinstance(writer, bool):
        raise InvalidArgument("{writer} must be True or False, got {value!r}", value=writer)
    if reader is not None:
        check_name(reader, "reader")
    if (permit is not None) + writer + (reader is not None) > 1:
        raise InvalidArgument(
            "{permit}, {writer} and {reader} each name one holder (of a semaphore, or of a read/write lock): "
            "pass one of them"
        )


def forced_release(lock_name: str, found: tuple[str, float, int | None] | None) -> ForcedRelease | None:
    if found is None:
        return None
    holder, age, token = found
    return ForcedRelease(lock_name, holder, age, token)
