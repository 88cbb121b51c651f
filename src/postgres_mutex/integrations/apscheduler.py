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

from postgres_mutex import Mutex, MutexError

__all__ = ["FleetExecutor", "JobRunningElsewhere", "Policy", "fire_time"]

log = logging.getLogger("postgres_mutex.integrations.apscheduler")

Policy = Literal["skip", "wait", "raise"]
_POLICIES = ("skip", "wait", "raise")
_CONNECT_TIMEOUT = 10  # seconds: the ledger's connections fail rather than hang on a silent network

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
    default ``mutex_apscheduler_runs``, one row per job) is created when the
    scheduler starts; the lock table must exist (``postgres-mutex init``).
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
        self._ledger = sql.Identifier(*ledger.split("."))
        self._options = options
        self._idle: dict[str, list[Mutex]] = {}
        self._idle_lock = threading.Lock()

    # -- the scheduler's side -----------------------------------------------------

    def start(self, scheduler: Any, alias: str) -> None:
        """Create the ledger table if needed, then start as APScheduler's thread pool does."""
        # Schedulers starting together race to create it: the losers' UniqueViolation, or
        # DuplicateObject (the table's row type), or DuplicateTable, means it exists.
        exists = (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject, psycopg.errors.DuplicateTable)
        with (
            psycopg.connect(self._dsn, autocommit=True, connect_timeout=_CONNECT_TIMEOUT) as conn,
            contextlib.suppress(*exists),
        ):
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (job_id TEXT PRIMARY KEY, fire_time TIMESTAMPTZ NOT NULL,"
                    " token BIGINT, instance_id TEXT, ran_at TIMESTAMPTZ NOT NULL DEFAULT now())"
                ).format(self._ledger)
            )
        super().start(scheduler, alias)

    def shutdown(self, wait: bool = True) -> None:
        """Stop as APScheduler's thread pool does (``wait``: for the runs in flight), then close the jobs' Mutexes."""
        super().shutdown(wait)
        with self._idle_lock:
            mutexes = [mutex for idle in self._idle.values() for mutex in idle]
            self._idle.clear()
        for mutex in mutexes:
            mutex.close()

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
                acquisition = mutex.acquire(
                    blocking=self._policy == "wait", timeout=self._wait_timeout if self._policy == "wait" else None
                )
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
                log.warning("job %r, fire time %s: %s", job.id, run_time, error)
                trace = "".join(traceback.format_tb(error.__traceback__))
                events.append(
                    JobExecutionEvent(EVENT_JOB_ERROR, job.id, alias, run_time, exception=error, traceback=trace)
                )
        return events

    def _claim(self, mutex: Mutex, job_id: str, run_time: datetime) -> bool:
        """Record ``run_time`` as run, fenced by the hold: False if it (or a later fire time) already was."""
        # A connection per fire time: a job that fires every second costs one connect a second, and nothing idles.
        with psycopg.connect(self._dsn, connect_timeout=_CONNECT_TIMEOUT) as conn, mutex.fenced(conn) as token:
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
