"""Celery beat on several nodes, exactly one sending: a scheduler that leads an `Election` before it sends.

Run ``celery beat -S postgres_mutex.integrations.celery:LeaderScheduler`` on
every node. Each beat campaigns in a thread of its own; the one that leads
sends the schedule, the others tick idly and send nothing. What the leader
has sent is recorded in PostgreSQL, in the lock table's database, before it
is sent, in a transaction fenced by the term's token: a beat that lost its
term cannot record a run, and a beat that takes over starts from the runs
its predecessors recorded, not from its own file. So no run of an entry is
sent twice, whoever sent it; a leader that dies between recording a run and
sending it loses that one run (at most once, never twice).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg
from celery.beat import PersistentScheduler, Scheduler
from celery.utils.time import maybe_make_aware
from psycopg import sql

from postgres_mutex.client import MutexClient
from postgres_mutex.election import Election, Leadership
from postgres_mutex.errors import LockNotHeldError, MutexError, SchemaError

from .. import in_setup_words

__all__ = ["BEAT_DEFAULTS", "LeaderScheduler", "LeaderSchedulerMixin"]

logger = logging.getLogger("postgres_mutex.integrations.celery")

BEAT_DEFAULTS: Mapping[str, float] = {
    "heartbeat_interval": 2.0,
    "alert_threshold": 10.0,
    "stale_threshold": 60.0,
    "reclaim_disconnected_after": 10.0,
    "poll_interval": 0.5,
}
"""The election's settings unless ``postgres_mutex_beat_options`` says otherwise.

A killed beat's term is taken over ``reclaim_disconnected_after`` after its
last heartbeat (plus up to two ``poll_interval``); a beat whose machine
vanished without closing its connection, after ``stale_threshold``.
"""

RUN_HEADERS = ("postgres_mutex_entry", "postgres_mutex_run", "postgres_mutex_token")
"""The message headers each task sent by a leading beat carries: the entry's name, its run number, the term's token.

The run number counts the entry's runs across every beat that led, so
``(entry, run)`` names one run: a consumer may use it to drop a duplicate.
They are in the message as it is built: Celery's ``before_task_publish``
handlers find them in ``headers``, whichever was connected first.
"""

_JOIN_TIMEOUT = 15.0
STATE_GRANTS = "SELECT, INSERT, UPDATE, DELETE"
"""What the beat's role needs on its table, as the README's Permissions section grants it."""


class LeaderSchedulerMixin:
    """Make a Celery beat scheduler send only while it leads an election on PostgreSQL.

    Mix it in before the scheduler class: ``class S(LeaderSchedulerMixin,
    PersistentScheduler)``. It reads the app's configuration:

    - ``postgres_mutex_beat_dsn`` (or ``postgres_mutex_dsn``): the database
      of the lock table, where the runs are recorded too. Required.
    - ``postgres_mutex_beat_lock``: the election's name (default
      ``"celery-beat"``): beats that share it share one schedule.
    - ``postgres_mutex_beat_state_table``: where the runs are recorded
      (default ``"celery_beat_state"``, made by ``postgres-mutex init
      --celery-beat``; a leader whose role may create it makes it if missing).
    - ``postgres_mutex_beat_options``: `Election` options over
      `BEAT_DEFAULTS` (``heartbeat_interval``, ``reclaim_disconnected_after``...).

    The lock table must exist (``postgres-mutex init``). A beat that cannot
    campaign (the lock table missing, a privilege lacking), or that leads but
    may not use its table (missing, and the role may not create it; a grant
    lacking), logs one line at ERROR saying what to run or grant, resigns (a
    standby takes over) and exits with status 1, rather than stand by, or lead
    without sending, forever.
    """

    app: Any
    schedule: Any
    _heap: Any

    _election: Election | None = None
    _campaigner: threading.Thread | None = None
    _leadership: Leadership | None = None
    _loaded_token: int | None = None
    _cleared: tuple[str, int, int] | None = None
    _recorded: dict[str, tuple[datetime, int]]
    _conn: psycopg.Connection[Any] | None = None
    _campaign_error: BaseException | None = None
    _stopped_by: str | None = None
    _role = "the beat's role"
    _closed = False

    # -- configuration -------------------------------------------------------------

    def _setting(self, name: str, default: Any = None) -> Any:
        value = self.app.conf.get(name)
        return default if value is None else value

    @property
    def _dsn(self) -> str:
        dsn = self._setting("postgres_mutex_beat_dsn") or self._setting("postgres_mutex_dsn")
        if not dsn:
            raise MutexError(
                "postgres_mutex_beat_dsn is not set: the leader-elected beat needs the PostgreSQL database of "
                "its lock table, e.g. app.conf.postgres_mutex_beat_dsn = 'postgresql://...'"
            )
        return str(dsn)

    @property
    def _beat_name(self) -> str:
        return str(self._setting("postgres_mutex_beat_lock", "celery-beat"))

    @property
    def _state_table_name(self) -> str:
        return str(self._setting("postgres_mutex_beat_state_table", "celery_beat_state"))

    @property
    def _state_table(self) -> sql.Identifier:
        return sql.Identifier(*self._state_table_name.split("."))

    def _options(self) -> dict[str, Any]:
        return {**BEAT_DEFAULTS, **dict(self._setting("postgres_mutex_beat_options", {}))}

    # -- the campaign, in a thread of its own ------------------------------------------

    def _start_campaign(self) -> None:
        if self._campaigner is not None or self._closed:
            return
        self._recorded = {}
        self._election = Election(self._dsn, self._beat_name, **self._options())
        self._campaigner = threading.Thread(target=self._campaign, name="postgres-mutex-beat", daemon=True)
        self._campaigner.start()

    def _campaign(self) -> None:
        assert self._election is not None
        try:
            self._election.run(self._lead)
        except BaseException as exc:  # told to the main thread, which stops beat with it
            self._campaign_error = exc

    def _lead(self, leadership: Leadership) -> None:
        logger.info("beat leads %r (term %s): sending the schedule", leadership.name, leadership.token)
        self._leadership = leadership
        try:
            leadership.ended.wait()
        finally:
            self._leadership = None
            logger.info("beat's term %s of %r ended: %s", leadership.token, leadership.name, leadership.reason)

    def _stop_campaign(self) -> None:
        election, campaigner = self._election, self._campaigner
        if election is None:
            return
        election.stop()  # the lock is released as soon as _lead returns: a standby takes over at once
        if campaigner is not None:
            campaigner.join(_JOIN_TIMEOUT)
        election.close()

    @property
    def leading(self) -> bool:
        """True while this beat leads its election (it sends the schedule only then)."""
        leadership = self._leadership
        return leadership is not None and leadership.held

    # -- the scheduler's hooks ---------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Send what is due while leading; otherwise send nothing and look again after ``poll_interval``."""
        self._start_campaign()
        if self._campaign_error is not None:
            # One line at ERROR, the level an operator alerts on; then beat closes and exits (see close).
            # An exception would reach Celery, which logs it at CRITICAL with a traceback and prints it
            # again, line by line, at WARNING.
            logger.error(
                "beat cannot campaign for %r, and stops: %s", self._beat_name, in_setup_words(self._campaign_error)
            )
            raise SystemExit(1)
        if self._stopped_by is not None:
            raise SystemExit(1)  # said at ERROR by _stop, once
        leadership = self._leadership
        standby = float(self._options()["poll_interval"])
        if leadership is None or not leadership.held:
            return standby
        if self._loaded_token != leadership.token and not self._load_runs(leadership):
            return standby
        interval: float = super().tick(*args, **kwargs)  # type: ignore[misc]
        return interval

    def is_due(self, entry: Any) -> Any:
        """Celery's answer, for ``entry`` as of the last run any leading beat recorded for it."""
        self._catch_up(entry)
        return super().is_due(entry)  # type: ignore[misc]

    def reserve(self, entry: Any) -> Any:
        """Advance ``entry`` and record its run, fenced by this term: what is not recorded is not sent."""
        new_entry = super().reserve(entry)  # type: ignore[misc]
        self._cleared = self._record(new_entry)
        return new_entry

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Send ``entry``'s run only if `reserve` recorded it; tag the message with the run."""
        cleared, self._cleared = self._cleared, None
        if cleared is None:
            logger.warning(
                "beat did not send %r: it no longer leads %r, or could not record the run", entry.name, self._beat_name
            )
            return
        # In the entry's options, the headers are in the message from the start: every
        # before_task_publish handler sees them, whichever was connected first. Only for this
        # send: the entry's own options, which a scheduler may save, stay as they were.
        options = entry.options
        run = dict(zip(RUN_HEADERS, cleared, strict=True))
        entry.options = {**options, "headers": {**(options.get("headers") or {}), **run}}
        try:
            super().apply_entry(entry, producer=producer)  # type: ignore[misc]
        finally:
            entry.options = options

    def close(self) -> None:
        """Resign (a standby takes over at once), then close the scheduler as the stock one does.

        A beat that could not campaign, or could not use its table, then exits
        with status 1: Celery's beat ends a ``SystemExit`` raised in a tick
        quietly, with status 0.
        """
        if not self._closed:
            self._closed = True
            self._stop_campaign()
            self._drop_connection()
        super().close()  # type: ignore[misc]
        if self._campaign_error is not None or self._stopped_by is not None:
            raise SystemExit(1)

    # -- the runs, in PostgreSQL ---------------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=10)
            self._role = self._conn.info.user
        return self._conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _load_runs(self, leadership: Leadership) -> bool:
        """Take up the runs the beats before this term recorded, so no entry is sent again for a run already sent."""
        table = self._state_table
        try:
            conn = self._connection()
            with leadership.fenced(conn):
                rows = conn.execute(
                    sql.SQL("SELECT entry, last_run_at, total_run_count FROM {} WHERE beat = %s").format(table),
                    (self._beat_name,),
                ).fetchall()
        except LockNotHeldError:
            return False
        except psycopg.errors.UndefinedTable:
            self._drop_connection()
            self._make_state_table()
            return False  # read at the next tick, from the table just made
        except psycopg.errors.InsufficientPrivilege as exc:
            self._stop(f"it may not read its table {self._state_table_name} ({_first_line(exc)})")
            return False
        except (psycopg.Error, MutexError) as exc:  # the database, unreachable or refusing: try at the next tick
            logger.error("beat leads %r but cannot read its recorded runs: %s", self._beat_name, exc)
            self._drop_connection()
            return False
        self._recorded = {name: (self._aware(last_run_at), int(count)) for name, last_run_at, count in rows}
        self._heap = None  # rebuilt at the next tick, through is_due, from the runs taken up
        self._loaded_token = leadership.token
        logger.info("beat took up the recorded runs of %d entries of %r", len(rows), self._beat_name)
        return True

    def _make_state_table(self) -> None:
        """Make the beat's table, missing at this term's start, if this role may; else stop saying how to."""
        lock_table = str(self._options().get("table", "mutex_lock"))
        try:
            with MutexClient(self._dsn) as client:
                client.table(lock_table).create(celery_beat=self._state_table_name)
        except SchemaError as exc:
            if exc.sqlstate != "42501":
                raise
            self._stop(f"its table {self._state_table_name} is missing", in_setup_words(exc))
            return
        logger.info("beat made its table %s", self._state_table_name)

    def _stop(self, why: str, advice: str | None = None) -> None:
        """Log why this beat cannot lead, once, as the error it is, and resign: a standby leads, this beat stops."""
        if self._stopped_by is not None:
            return
        self._stopped_by = why
        if advice is None:
            advice = (
                f"the table is made by 'postgres-mutex init --celery-beat' (as a role that may create tables), "
                f"and the beat's role needs GRANT {STATE_GRANTS} ON {self._state_table_name} TO {self._role}"
            )
        logger.error("beat cannot lead %r: %s; %s. This beat resigns and stops", self._beat_name, why, advice)
        self._drop_connection()
        if self._election is not None:
            self._election.stop()  # a standby takes over at once

    def _aware(self, moment: datetime) -> datetime:
        return maybe_make_aware(moment, self.app.timezone).astimezone(self.app.timezone)  # type: ignore[no-any-return]

    def _catch_up(self, entry: Any) -> None:
        """Give ``entry`` the last run recorded for it, if that is later than the one it knows of.

        Applied as each entry is looked at, not once: a scheduler that reloads
        its entries (django-celery-beat's does, after an edit in the admin)
        gets the recorded runs again.
        """
        recorded = self._recorded.get(entry.name)
        if recorded is not None and recorded[0] > self._aware(entry.last_run_at):
            self._take_up(entry, *recorded)

    def _take_up(self, entry: Any, last_run_at: datetime, count: int) -> None:
        entry.last_run_at = last_run_at
        entry.total_run_count = count

    def _record(self, entry: Any) -> tuple[str, int, int] | None:
        leadership = self._leadership
        if leadership is None or not leadership.held:
            return None
        try:
            conn = self._connection()
            with leadership.fenced(conn) as token:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (beat, entry, last_run_at, total_run_count, token) VALUES (%s, %s, %s, %s, %s) "
                        "ON CONFLICT (beat, entry) DO UPDATE SET last_run_at = EXCLUDED.last_run_at, "
                        "total_run_count = EXCLUDED.total_run_count, token = EXCLUDED.token"
                    ).format(self._state_table),
                    (self._beat_name, entry.name, self._aware(entry.last_run_at), entry.total_run_count, token),
                )
        except LockNotHeldError:
            return None
        except psycopg.errors.InsufficientPrivilege as exc:
            self._stop(f"it may not record its runs in its table {self._state_table_name} ({_first_line(exc)})")
            return None
        except (psycopg.Error, MutexError) as exc:  # not recorded, so not sent: at most once
            logger.error("beat could not record run %d of %r: %s", entry.total_run_count, entry.name, exc)
            self._drop_connection()
            return None
        self._recorded[entry.name] = (self._aware(entry.last_run_at), int(entry.total_run_count))
        return (str(entry.name), int(entry.total_run_count), int(token))


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class LeaderScheduler(LeaderSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's stock `PersistentScheduler` (the schedule from ``beat_schedule``), sending only while it leads.

    ``celery beat -S postgres_mutex.integrations.celery:LeaderScheduler``, or
    ``beat_scheduler`` in the app's configuration.
    """


def database_scheduler() -> type[Scheduler]:
    """django-celery-beat's ``DatabaseScheduler``, sending only while it leads (needs django-celery-beat)."""
    from django_celery_beat.schedulers import DatabaseScheduler

    class LeaderDatabaseScheduler(LeaderSchedulerMixin, DatabaseScheduler):  # type: ignore[misc]
        """django-celery-beat's schedule (edited in the admin), sent by the leading beat only."""

        def _take_up(self, entry: Any, last_run_at: datetime, count: int) -> None:
            super()._take_up(entry, last_run_at, count)
            entry.model.last_run_at = last_run_at
            entry.model.total_run_count = count
            self._dirty.add(entry.name)  # saved to Django's database at the next sync

    return LeaderDatabaseScheduler
