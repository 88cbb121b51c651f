# Generated from heartbeat_async.py by tools/async_to_sync.py: do not edit.
# Change the async module and run `python tools/async_to_sync.py`.
"""The heartbeat and clean-up worker of one engine: one worker for every hold it renews.

It renews every hold the engine acquired, once per interval for each
heartbeat group (the holds that share a table, an interval and what they
report): one statement per group, or one per batch of at most
`heartbeat_flows.BATCH` holds for a larger group, so that no statement of the
heartbeat keeps the connection from the process's other lock operations for
long. It also deletes the rows that unanswered statements may have left, as
soon as the database answers. It exists while there is something to renew
or delete, and ends a while after. What it finds out goes to the session's
event thread, never to a user callback directly: a slow callback never
delays a heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from .._base.acompat import Cancelled, Event, Worker
from .._base.clock import MAX_SLICE, now
from .._state import flows, heartbeat_flows, steps
from .._state.events import Defects
from .._state.locks import HeartbeatGroup, Hold
from .._state.settings import retry_pause
from ..errors import DatabaseError

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger("postgres_mutex")

# How long the worker stays once nothing is held: locks come and go in bursts,
# and a worker started per acquire would cost more than the lock.
_WORKER_LINGER = 10.0


class HeartbeatWorker:
    """Renews an engine's holds and deletes the rows it may have left; see the module's docstring."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._host = engine.host
        self.groups = engine.host.session.groups_of(engine)
        self._state_lock = engine.host.state_lock
        """The host's state lock, read once (a property of the host): its session's, as ``groups`` are."""
        self._cleanups: list[steps.Cleanup] = []
        self._wake = Event()
        self._worker: Worker | None = None
        self._defects = Defects("heartbeat worker")

    def keep(self, hold: Hold) -> None:
        """Renew ``hold`` from now on, with the other holds of its table and interval."""
        lock = hold.lock
        # One statement for the holds that share a table, an interval and what their heartbeats report.
        key = (lock.names.table_name, lock.timing.heartbeat_interval, lock.timing.alert_threshold, id(lock.tracing))
        with self._state_lock:
            group = self.groups.get(key)
            new_group = group is None
            if group is None:
                group = self.groups[key] = HeartbeatGroup(key, lock.timing.heartbeat_interval, lock.tracing)
            group.holds[hold] = None
            hold.group = group
            if self._worker is None:  # `_start_worker`'s first look, inline: a worker mostly runs
                self._start_worker()
        self._host.session.kept(hold)
        if new_group:
            self._wake.set()  # its first heartbeat may be due before the worker would look again

    def schedule(self, cleanup: steps.Cleanup) -> None:
        """Delete a row that may remain, in the background, as soon as the database answers."""
        with self._host.state_lock:
            closed = self._engine.closed
            if not closed:
                self._cleanups.append(cleanup)
                self._start_worker()
        if closed:
            self._host.adopt_cleanup(cleanup)
        else:
            self._wake.set()

    def has_cleanups(self) -> bool:
        return bool(self._cleanups)

    def take_cleanups(self) -> list[steps.Cleanup]:
        with self._host.state_lock:
            pending, self._cleanups = self._cleanups, []
            return pending

    def _start_worker(self) -> None:
        # Under the state lock: the worker decides to end under it too. One
        # that could not start (at interpreter exit) is tried again next time.
        # The worker clears ``_worker`` (under the state lock) however it ends: one that is set runs, and
        # is not asked (a thread's is_alive is a few calls, on every acquire).
        if self._worker is None and not self._engine.closed:
            worker = Worker(self._background, name="postgres-mutex-heartbeat")
            if worker.running:
                self._worker = worker

    def _background(self) -> None:
        """Renew the holds and delete left rows until there is nothing left to do."""
        idle_since: float | None = None
        try:
            while True:
                self._wake.clear()
                with self._host.state_lock:
                    busy = any(group.holds for group in self.groups.values()) or bool(self._cleanups)
                    idle_since = None if busy else idle_since if idle_since is not None else now()
                    if self._engine.closed or (idle_since is not None and now() - idle_since >= _WORKER_LINGER):
                        # Nothing to renew or delete for a while: end until there is.
                        self._worker = None
                        return
                    groups = list(self.groups.values())
                    cleanups = list(self._cleanups)
                for group in groups:
                    if group.next_beat <= now():
                        try:
                            self._beat(group)
                        except Exception as exc:
                            # A defect, not the database's answer: the next heartbeat may
                            # well succeed, and ending here would let every hold expire.
                            self._defect("renewing the holds", exc)
                            group.next_beat = now() + retry_pause(group.interval)
                for cleanup in cleanups:
                    if cleanup.due <= now():
                        try:
                            self._clean(cleanup)
                        except Exception as exc:
                            self._defect(f"deleting a row lock {cleanup.lock.lock_name!r} may have left", exc)
                            with self._host.state_lock:
                                cleanup.due = now() + cleanup.lock.timing.poll_interval
                                if now() >= cleanup.give_up_at:
                                    with contextlib.suppress(ValueError):
                                        self._cleanups.remove(cleanup)
                wake_at = min(
                    [group.next_beat for group in self.groups.values()]
                    + [cleanup.due for cleanup in self._cleanups]
                    + [now() + MAX_SLICE]
                )
                if wake_at > now():
                    self._wake.wait(min(wake_at - now(), MAX_SLICE))
        except (Cancelled, GeneratorExit):
            # Stopped from outside (what runs the worker is shutting down, or was
            # closed with it unfinished): its holds end with it (the exit releases them).
            with self._host.state_lock:
                self._worker = None
            raise
        except BaseException:
            # What ends the worker itself (a failure of one round is caught above). Never
            # silently: the leases of the holds then run out, and the event thread declares
            # them lost on time.
            logger.exception("postgres-mutex heartbeat worker failed")
            with self._host.state_lock:
                self._worker = None
            raise

    def _beat(self, group: HeartbeatGroup) -> None:
        """Renew the group's holds: one statement per batch of at most `heartbeat_flows.BATCH` holds.

        The batches go one after another, each taking its own turn on the
        connection, so the process's other statements get theirs in between.
        A failed batch ends the round: it and the batches not yet sent are
        reported failed and the whole group is tried again soon (renewing
        the holds of the earlier batches again does no harm). A lost hold,
        or one whose row another session holds locked, is told as soon as
        its batch is answered; the holds renewed are told together once the
        round is done, which keeps the event thread's work per interval the
        same whatever the number of batches.
        """
        with self._host.state_lock:
            # In the order they were kept, the same each round: a batch that keeps failing (a round
            # ends at a failed batch) costs the holds after it, not, moved to the front by its
            # shorter lease, every hold of the group.
            holds = group.live()
            if not holds:
                if not group.holds:
                    self.groups.pop(group.key, None)
                group.next_beat = now() + group.interval
                return
        timeout = min(hold.lock.timing.operation_timeout for hold in holds)
        batches = heartbeat_flows.batches(holds)
        renewed: list[heartbeat_flows.Beat] = []
        started_at: float | None = None
        retry_at: float | None = None
        try:
            for index, batch in enumerate(batches):
                try:
                    statements = self._engine.shape(batch[0].lock.names, timeout)
                    beat = self._engine.run(heartbeat_flows.heartbeat(batch, statements, group.tracing, timeout))
                except DatabaseError as exc:  # the inspection failed
                    beat = heartbeat_flows.Beat([], [], 0.0, exc)
                if beat.error is not None:
                    error = beat.error
                    if index == 0 and flows.died_while_idle(error) and not group.quiet_retry:
                        # The server closed the connection while it was idle: not a
                        # failure of the holder's, and worth no alert. Again, at once.
                        logger.debug("%s; retrying at once on a new connection", error)
                        group.quiet_retry = True
                        group.next_beat = now()
                        return
                    group.quiet_retry = False
                    group.next_beat = now() + retry_pause(group.interval)
                    self._host.session.post(_failed([hold for rest in batches[index:] for hold in rest], error))
                    return
                group.quiet_retry = False
                if started_at is None:
                    started_at = beat.sent_at
                if beat.busy:
                    retry_at = now() + retry_pause(group.interval)
                    self._host.session.post(_failed(beat.busy, None))
                if beat.lost:
                    self._host.session.post(_renewed([beat]))
                else:
                    renewed.append(beat)
        finally:
            if renewed:
                self._host.session.post(_renewed(renewed))
        # From when the first statement was sent: the interval is kept whatever the statements took.
        assert started_at is not None
        group.next_beat = started_at + group.interval
        if retry_at is not None:
            group.next_beat = min(group.next_beat, retry_at)

    def _clean(self, cleanup: steps.Cleanup) -> None:
        lock = cleanup.lock
        try:
            done = self._engine.run(flows.clean_up(cleanup))
            retry_at = cleanup.conclusive_from
        except steps.CleanupSuperseded:
            done, retry_at = True, now()
        except DatabaseError as exc:
            lock.events.row_may_remain(exc)
            # A failure that will not pass (a closed pool, a revoked privilege): give up;
            # the row is reclaimable after stale_threshold anyway.
            done, retry_at = not exc.transient, now() + lock.timing.poll_interval
        with self._host.state_lock:
            if done or now() >= cleanup.give_up_at:
                with contextlib.suppress(ValueError):
                    self._cleanups.remove(cleanup)
            else:
                cleanup.due = max(retry_at, now())

    def _defect(self, doing: str, exc: Exception) -> None:
        self._defects.report(doing, exc, "trying again at the next heartbeat")

    def stop(self) -> None:
        """The engine closed: let the worker end (within a statement deadline) and take nothing more."""
        with self._host.state_lock:
            worker, self._worker = self._worker, None
        self._wake.set()
        if worker is not None:
            worker.join(self._host.operation_timeout + 1.0)


def _failed(holds: list[Hold], error: DatabaseError | None) -> Any:
    """Report failed heartbeats: the statement's error, or (None) each row locked by another session."""

    def report() -> None:
        for index, hold in enumerate(holds):
            hold.lock.events.heartbeat_failed(
                error or heartbeat_flows.busy_error(hold), log=error is None or index == 0
            )

    return report


def _renewed(beats: list[heartbeat_flows.Beat]) -> Any:
    """Report what heartbeat statements did: renewed (with each statement's latency), confirmed, lost."""

    def report() -> None:
        for beat in beats:
            for hold in beat.renewed:
                hold.lock.events.heartbeat_renewed(beat.latency)
            for hold, seconds in beat.confirmed:
                hold.lock.events.confirmed(seconds)
            for hold, error in beat.lost:
                hold.lock.events.lost(error)

    return report
