"""APScheduler 3.x jobs that run once per fire time across every scheduler of the fleet.

Each web worker, pod or process runs its own APScheduler scheduler with the same
jobs; `FleetExecutor`, the scheduler's executor, lets one of them run each fire
time. It holds the job's lock (``apscheduler:<job id>``) while the job runs,
and before running a fire time records it in a ledger table, one row per job,
under the lock's fencing token: a scheduler that fires the same time later, or
a holder that lost its lock, finds it recorded and does not run it again.

Needs the ``apscheduler`` extra.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import logging
import threading
import traceback
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import psycopg
from apscheduler.events import EVENT_JOB_ERROR, JobExecutionEvent
from apscheduler.executors.base import run_job
from apscheduler.executors.pool import ThreadPoolExecutor
from psycopg import sql

from postgres_mutex.client import MutexClient
from postgres_mutex.errors import MutexError, SchemaError
from postgres_mutex.mutex import Mutex

from . import in_setup_words

__all__ = ["FleetExecutor", "JobRunningElsewhere", "Policy", "fire_time"]

log = logging.getLogger("postgres_mutex.integrations.apscheduler")

Policy = Literal["skip", "wait", "raise"]
_POLICIES = ("skip", "wait", "raise")
_CONNECT_TIMEOUT = 10  # seconds: the ledger's connections fail rather than hang on a silent network
LEDGER_GRANTS = ("SELECT", "INSERT", "UPDATE")
"""What the scheduler's role needs on the ledger, as the README's Permissions section grants it."""

_fire_time: contextvars.ContextVar[datetime | None] = contextvars.ContextVar("postgres_mutex_fire_time", default=None)


def fire_time() -> datetime | None:
    """The fire time the calling job runs for, under `FleetExecutor` (None elsewhere).

    The same in every process of the fleet: a key for the job's own
    idempotent writes.
    """
    return _fire_time.get()


class JobRunningElsewhere(MutexError):
    """The job's lock is held (by another scheduler, or another run): raised under ``on_contention="raise"``.

    APScheduler reports it as the fire time's ``EVENT_JOB_ERROR``; ``job_id``
    and ``fire_time`` say which.
    """

    def __init__(self, job_id: str, fire_time: datetime) -> None:
        super().__init__(f"job {job_id!r} is already running (fire time {fire_time.isoformat()}): not run here")
        self.job_id = job_id
        self.fire_time = fire_time


class FleetExecutor(ThreadPoolExecutor):  # type: ignore[misc]  # APScheduler 3 has no type hints
    """A thread-pool executor whose jobs run once per fire time across every scheduler using it on one database.

    ``FleetExecutor(dsn, on_contention="skip", **options)``; ``options`` are
    `Mutex` options (``heartbeat_interval``, the thresholds, ``table``,
    ``reclaim_disconnected_after``...). When a job's lock is held as its fire
    time comes (another scheduler runs this fire time, or a run of an
    earlier one goes on), ``on_contention`` says what this scheduler does:

    - ``"skip"`` (default): nothing; the fire time is logged at INFO as run
      elsewhere;
    - ``"wait"``: wait up to ``wait_timeout`` seconds for the lock, then run
      the fire time if nobody has run it meanwhile; past the timeout the fire
      time ends in ``EVENT_JOB_ERROR`` with `LockAcquisitionTimeout`;
    - ``"raise"``: the fire time ends in ``EVENT_JOB_ERROR`` with
      `JobRunningElsewhere`.

    Fire times must be the same in every process: cron triggers, or interval
    triggers given a ``start_date``, without jitter (an interval trigger
    without one starts from each scheduler's own start, and its fire times
    differ from process to process). Once per fire time holds while jobs run
    shorter than their interval; a fire time whose process dies while it
    runs is not run again (at most once). The ledger table (``ledger``,
    default ``mutex_apscheduler_runs``, one row per job) is made with the
    lock table by ``postgres-mutex init --apscheduler`` (or, if missing, by a
    scheduler whose role may create it, as it starts). A scheduler whose
    role may not use it (or may not make it) does not start:
    ``scheduler.start()`` raises `SchemaError` saying what to run or grant.
    """

    def __init__(
        self,
        dsn: str,
        *,
        on_contention: Policy = "skip",
        wait_timeout: float = 60.0,
        lock_prefix: str = "apscheduler:",
        ledger: str = "mutex_apscheduler_runs",
        max_workers: int = 10,
        **options: Any,
    ) -> None:
        if on_contention not in _POLICIES:
            raise ValueError(f"on_contention must be one of {', '.join(_POLICIES)}, not {on_contention!r}")
        if wait_timeout <= 0:
            raise ValueError(f"wait_timeout must be a positive number of seconds, not {wait_timeout!r}")
        super().__init__(max_workers)
        self._dsn = dsn
        self._policy: Policy = on_contention
        self._wait_timeout = wait_timeout
        self._prefix = lock_prefix
        self._ledger_name = ledger
        self._ledger = sql.Identifier(*ledger.split("."))
        self._options = options
        self._idle: dict[str, list[Mutex]] = {}
        self._ledger_idle: list[psycopg.Connection[Any]] = []
        self._shut_down = False
        self._idle_lock = threading.Lock()

    # -- the scheduler's side -----------------------------------------------------

    def start(self, scheduler: Any, alias: str) -> None:
        """Check the tables (the ledger made if missing, when the role may), then start as APScheduler's pool does.

        Raises `SchemaError`, saying what to run or grant, if the ledger is
        missing and the role may not create it, or if the role lacks a
        privilege the lock table or the ledger needs: one error as the
        scheduler starts, rather than one at every fire time.
        """
        lock_table = str(self._options.get("table", "mutex_lock"))
        try:
            with MutexClient(self._dsn) as client:
                client.table(lock_table).create(apscheduler=self._ledger_name)
        except SchemaError as exc:
            raise SchemaError(f"FleetExecutor cannot start: {in_setup_words(exc)}", sqlstate=exc.sqlstate) from None
        needs = {lock_table: ("SELECT", "INSERT", "UPDATE", "DELETE"), self._ledger_name: LEDGER_GRANTS}
        with psycopg.connect(self._dsn, autocommit=True, connect_timeout=_CONNECT_TIMEOUT) as conn:
            asked = [
                (table, grant, sql.Identifier(*table.split(".")).as_string(conn))
                for table, grants in needs.items()
                for grant in grants
            ]
            query = sql.SQL("SELECT {}").format(
                sql.SQL(", ").join(
                    sql.SQL("has_table_privilege({}, {})").format(sql.Literal(quoted), sql.Literal(grant))
                    for _, grant, quoted in asked
                )
            )
            granted = conn.execute(query).fetchone() or ()
            role = conn.info.user
        for table, grants in needs.items():
            lacking = [grant for (of, grant, _), held in zip(asked, granted, strict=True) if of == table and not held]
            if lacking:
                made_by = "--apscheduler" if table == self._ledger_name else ""
                raise SchemaError(
                    f"FleetExecutor cannot start: the role {role} may not use the table {table} (it lacks "
                    f"{', '.join(lacking)}): GRANT {', '.join(grants)} ON {table} TO {role} (the table is made "
                    f"by 'postgres-mutex init{' ' + made_by if made_by else ''}', as the README's Permissions "
                    "section shows)",
                    sqlstate="42501",
                )
        super().start(scheduler, alias)

    def shutdown(self, wait: bool = True) -> None:
        """Stop as APScheduler's thread pool does (``wait``: for the runs in flight), then close the jobs' Mutexes."""
        super().shutdown(wait)
        with self._idle_lock:
            self._shut_down = True
            mutexes = [mutex for idle in self._idle.values() for mutex in idle]
            self._idle.clear()
            connections, self._ledger_idle = self._ledger_idle, []
        for mutex in mutexes:
            mutex.close()
        for conn in connections:
            conn.close()

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        # As APScheduler's pool executors do, with each fire time run under the job's lock.
        alias = job._jobstore_alias  # APScheduler's own executors read it so: it names the job's store in events

        def done(future: concurrent.futures.Future[list[JobExecutionEvent]]) -> None:
            error = future.exception()
            if error is not None:
                self._run_job_error(job.id, error, error.__traceback__)
            else:
                self._run_job_success(job.id, future.result())

        self._pool.submit(self._run_fire_times, job, alias, run_times).add_done_callback(done)

    # -- one fire time ---------------------------------------------------------------

    def _run_fire_times(self, job: Any, alias: str, run_times: list[datetime]) -> list[JobExecutionEvent]:
        events: list[JobExecutionEvent] = []
        for run_time in run_times:
            events.extend(self._run_once(job, alias, run_time))
        return events

    def _run_once(self, job: Any, alias: str, run_time: datetime) -> list[JobExecutionEvent]:
        logger = self._logger.name
        grace = job.misfire_grace_time
        if grace is not None and datetime.now(UTC) - run_time > timedelta(seconds=grace):
            return list(run_job(job, alias, [run_time], logger))  # reported missed, as APScheduler does
        events: list[JobExecutionEvent] = []
        with self._mutex(job.id) as mutex:
            try:
                blocking = self._policy == "wait"
                acquisition = mutex.acquire(blocking=blocking, timeout=self._wait_timeout if blocking else None)
                with acquisition as acquired:
                    if not acquired:
                        if self._policy == "raise":
                            raise JobRunningElsewhere(job.id, run_time)
                        log.info("job %r, fire time %s: already running, skipped here", job.id, run_time)
                    elif not self._claim(mutex, job.id, run_time):
                        log.info("job %r, fire time %s: already run, skipped here", job.id, run_time)
                    else:
                        token = _fire_time.set(run_time)
                        try:
                            events.extend(run_job(job, alias, [run_time], logger))
                        finally:
                            _fire_time.reset(token)
            except (MutexError, psycopg.Error) as error:
                # Contention under "raise", a wait that timed out, a lock lost (the run's own event is kept)
                # or a database out of reach: listeners hear of this fire time's failure as of any job's.
                # A table missing or refused needs an operator; the rest is contention or passes.
                level = logging.ERROR if isinstance(error, SchemaError) else logging.WARNING
                log.log(level, "job %r, fire time %s: %s", job.id, run_time, in_setup_words(error))
                trace = "".join(traceback.format_tb(error.__traceback__))
                events.append(
                    JobExecutionEvent(EVENT_JOB_ERROR, job.id, alias, run_time, exception=error, traceback=trace)
                )
        return events

    def _claim(self, mutex: Mutex, job_id: str, run_time: datetime) -> bool:
        """Record ``run_time`` as run, fenced by the hold: False if it (or a later fire time) already was."""
        with self._ledger_connection() as (conn, reused):
            try:
                return self._claim_on(conn, mutex, job_id, run_time)
            except psycopg.OperationalError:
                if not reused:
                    raise
        # The kept connection had died while idle (a server restart, a dropped network): once more on a new one.
        # Had the first try committed after all, this one finds the fire time recorded: at most once still.
        with self._ledger_connection(fresh=True) as (conn, _):
            return self._claim_on(conn, mutex, job_id, run_time)

    def _claim_on(self, conn: psycopg.Connection[Any], mutex: Mutex, job_id: str, run_time: datetime) -> bool:
        with mutex.fenced(conn) as token:
            claimed = conn.execute(
                sql.SQL(
                    "INSERT INTO {0} AS runs (job_id, fire_time, token, instance_id) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (job_id) DO UPDATE SET fire_time = EXCLUDED.fire_time, token = EXCLUDED.token,"
                    " instance_id = EXCLUDED.instance_id, ran_at = now() WHERE runs.fire_time < EXCLUDED.fire_time"
                    " RETURNING 1"
                ).format(self._ledger),
                (job_id, run_time, token, mutex.instance_id),
            ).fetchone()
        return claimed is not None

    @contextlib.contextmanager
    def _ledger_connection(self, *, fresh: bool = False) -> Iterator[tuple[psycopg.Connection[Any], bool]]:
        """A connection to record fire times on, and whether it was kept from an earlier one.

        Kept idle between fire times, one per concurrent run at most, rather
        than a connect per fire time; a connection that failed is closed.
        """
        conn = None
        if not fresh:
            with self._idle_lock:
                conn = self._ledger_idle.pop() if self._ledger_idle else None
        reused = conn is not None and not conn.closed
        if conn is None or conn.closed:
            conn = psycopg.connect(self._dsn, connect_timeout=_CONNECT_TIMEOUT)
        try:
            yield conn, reused
        except BaseException:
            conn.close()
            raise
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE and not self._shut_down:
            with self._idle_lock:
                self._ledger_idle.append(conn)
        else:
            conn.close()

    @contextlib.contextmanager
    def _mutex(self, job_id: str) -> Iterator[Mutex]:
        """An idle Mutex on the job's lock: one per concurrent run in this process, kept for the next fire time."""
        with self._idle_lock:
            idle = self._idle.setdefault(job_id, [])
            mutex = idle.pop() if idle else None
        if mutex is None:
            mutex = Mutex(self._dsn, self._prefix + job_id, **self._options)
        try:
            yield mutex
        finally:
            with self._idle_lock:
                self._idle.setdefault(job_id, []).append(mutex)
