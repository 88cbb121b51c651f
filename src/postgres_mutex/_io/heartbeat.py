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
import operator
import os
import random
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._base.acompat import Cancelled, Event, Worker
from .._base.clock import MAX_SLICE, now
from .._state import flows, heartbeat_flows, steps
from .._state.events import Defects
from .._state.failures import PRIVILEGE, UNDEFINED_TABLE
from .._state.locks import HeartbeatGroup, Hold
from .._state.settings import retry_pause
from ..errors import DatabaseError

if TYPE_CHECKING:
    from .._observe.tracing import Tracing
    from .._sql import Statements
    from .engine import Engine

logger = logging.getLogger("postgres_mutex")
_DUE = operator.attrgetter("due")

# How long the worker stays once nothing is held: locks come and go in bursts,
# and a worker started per acquire would cost more than the lock.
_WORKER_LINGER = 10.0


@dataclass
class _Lease:
    """A heartbeat group's lease (`_sql.leases`): its key, the revision last seen, the holds whose rows follow it."""

    key: int = field(default_factory=lambda: secrets.randbits(63))
    pid: int = field(default_factory=os.getpid)
    """The process that drew the key: a forked child draws its own."""
    seen: int | None = None
    rows: dict[Hold, float] = field(default_factory=dict)
    """The holds whose rows follow the lease, each with when its row's own heartbeat is next renewed."""
    detach: dict[int, None] = field(default_factory=dict)
    """The tokens of rows that follow the lease but are no longer renewed: detached by the next renewal."""
    statements: Statements | None = None
    """Its table's statements, which delete it once its group holds nothing (`_sql.leases.end`)."""

    def own_heartbeat_due(self, hold: Hold, *, first: bool) -> float:
        """When ``hold``'s row's own heartbeat is renewed next (`heartbeat_flows.own_heartbeat_period`); a first
        one at random in the second half of the period, so holds acquired together spread their renewals over
        the intervals."""
        period = heartbeat_flows.own_heartbeat_period(hold)
        spread = random.uniform(period / 2, period)  # noqa: S311 (a spread over time, not a secret)
        return now() + (spread if first else period)


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
        self._leases: dict[object, _Lease] = {}
        self._no_lease: set[str] = set()
        """The tables whose leases this engine may not renew (their grant revoked, or dropped): rows one by one."""

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
            group.add(hold, heartbeat_flows.facts(hold))
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
                # The longest due first, and a due heartbeat between any two: a clean-up may wait out
                # its operation_timeout (its row locked by another session). One at least each round.
                for index, cleanup in enumerate(sorted(cleanups, key=_DUE)):
                    if index and any(group.next_beat <= now() for group in groups):
                        break
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
            ended: _Lease | None = None
            if not holds:
                if not group.holds:
                    self.groups.pop(group.key, None)
                    ended = self._leases.pop(group.key, None)
                group.next_beat = now() + group.interval
            # What the heartbeat reads of every hold in the group, counted as they come and go: a few entries.
            # A hold that is not live this round only makes what follows stricter.
            counts = dict(group.counts)
        if not holds:
            if ended is not None:
                self._end_lease(ended)
            return
        timeout = min(operation_timeout for operation_timeout, _, _, _ in counts)
        # Holds the lease alone renews are told as heartbeats of each only where someone listens (thousands).
        told_each = not all(quiet for _, _, _, quiet in counts)
        fit = heartbeat_flows.fit(counts, group.interval, timeout)
        renewed: list[heartbeat_flows.Beat] = []
        started_at: float | None = None
        retry_at: float | None = None
        try:
            statements: Statements | None = self._engine.shape(holds[0].lock.names, timeout, urgent=True)
        except DatabaseError:
            statements = None  # the first batch inspects the table again, and fails as it does
        # Few holds, thresholds too short for a lease (`heartbeat_flows.fit`), or a pooler between (whose
        # queue may hold the lease's renewal past the deadline it must land within): rows renewed one by one.
        table = holds[0].lock.names.table_name
        within = None if self._engine.behind_pooler or table in self._no_lease else fit
        lease = (
            self._lease(group)
            if within is not None and statements is not None and statements.renew_lease is not None
            else None
        )
        if lease is not None:
            lease.statements = statements
        by_row: list[Hold] = holds
        if lease is not None and statements is not None and within is not None:
            try:
                first, by_lease, left = self._renew_lease(lease, holds, statements, group.tracing, timeout, within)
            except DatabaseError as exc:
                if not self._lease_refused(group, table, exc):
                    self._round_failed(group, holds, exc, first=True)
                    return
                lease, first, by_lease, left = None, None, [], holds  # each row renewed by itself, in this round
            by_row = left
            if first is not None:
                started_at = first.sent_at
                group.quiet_retry = False
                # The holds whose rows the lease's statement renewed by themselves, and those the lease alone
                # did: a heartbeat of each, to the hooks and the metrics (the latter's trust left as it was).
                if first.busy:
                    retry_at = now() + retry_pause(group.interval)
                    self._host.session.post(_failed(first.busy, None))
                told = heartbeat_flows.Beat(
                    first.renewed + by_lease if told_each else first.renewed,
                    first.lost,
                    first.latency,
                    confirmed=first.confirmed,
                )
                if told.lost:
                    self._host.session.post(_renewed([told]))
                else:
                    renewed.append(told)
        # The rows renewed one by one: those that may follow the lease in batches of their own, which point them
        # at it, then the others.
        leased = [hold for hold in by_row if heartbeat_flows.follows_lease(hold)] if lease is not None else []
        batches = [(batch, True) for batch in heartbeat_flows.batches(leased)]
        if leased:
            rest = set(leased)
            by_row = [hold for hold in by_row if hold not in rest]
        batches += [(batch, False) for batch in heartbeat_flows.batches(by_row)]
        try:
            for index, (batch, follows) in enumerate(batches):
                key = lease.key if follows and lease is not None else None
                try:
                    statements = self._engine.shape(batch[0].lock.names, timeout, urgent=True)
                    beat = self._engine.run(heartbeat_flows.heartbeat(batch, statements, group.tracing, timeout, key))
                    if beat.error is not None and key is not None and self._lease_refused(group, table, beat.error):
                        # Nothing was renewed: the same rows again, by themselves, in this round.
                        lease = key = None
                        beat = self._engine.run(heartbeat_flows.heartbeat(batch, statements, group.tracing, timeout))
                except DatabaseError as exc:  # the inspection failed
                    beat = heartbeat_flows.Beat([], [], 0.0, exc)
                if beat.error is not None:
                    self._round_failed(
                        group,
                        [hold for rest, _ in batches[index:] for hold in rest],
                        beat.error,
                        first=started_at is None,
                    )
                    return
                group.quiet_retry = False
                if started_at is None:
                    started_at = beat.sent_at
                if key is not None and lease is not None and beat.revision is None:
                    # The lease lapsed, and was not revived: these rows follow none now, and the next round
                    # points them at a lease of a new key.
                    if self._leases.get(group.key) is lease:
                        self._leases[group.key] = _Lease(statements=statements)
                    lease = None
                elif key is not None and lease is not None:
                    self._attach(lease, batch, beat)
                    if lease.seen is None:
                        # What the next renewal's revision is compared to: a forced release of any row since
                        # changes it.
                        lease.seen = beat.revision
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

    def _round_failed(self, group: HeartbeatGroup, holds: list[Hold], error: DatabaseError, *, first: bool) -> None:
        """A statement of the round failed: ``holds`` (those not renewed yet) are told, and the round is tried
        again soon."""
        if first and flows.died_while_idle(error) and not group.quiet_retry:
            # The server closed the connection while it was idle: not a
            # failure of the holder's, and worth no alert. Again, at once.
            logger.debug("%s; retrying at once on a new connection", error)
            group.quiet_retry = True
            group.next_beat = now()
            return
        group.quiet_retry = False
        group.next_beat = now() + retry_pause(group.interval)
        self._host.session.post(_failed(holds, error))

    def _lease_refused(self, group: HeartbeatGroup, table: str, error: DatabaseError) -> bool:
        """Whether ``error`` says the lease may not be renewed on the group's table (its grant revoked, or the
        leases' table dropped, since the table was inspected): then this engine stops using the lease there, and
        renews each row by itself, as on a table without leases."""
        if error.sqlstate not in (PRIVILEGE, UNDEFINED_TABLE):
            return False
        self._no_lease.add(table)
        self._leases.pop(group.key, None)
        logger.warning(
            "the lease of the locks on %s could not be renewed (%s): each row is renewed by itself", table, error
        )
        return True

    def _lease(self, group: HeartbeatGroup) -> _Lease:
        lease = self._leases.get(group.key)
        if lease is None or lease.pid != os.getpid():
            lease = self._leases[group.key] = _Lease()
        return lease

    def _renew_lease(
        self,
        lease: _Lease,
        holds: list[Hold],
        statements: Statements,
        tracing: Tracing,
        timeout: float,
        within: float,
    ) -> tuple[heartbeat_flows.Beat | None, list[Hold], list[Hold]]:
        """Renew the lease, detach the rows no longer renewed, and renew by themselves the rows whose own heartbeat
        is due (`_Lease.own_heartbeat_due`, at most `heartbeat_flows.BATCH` of them, the longest due first), in
        one statement. Returns what it did for those rows (None: no statement was needed), the holds the lease
        alone renewed, and the holds left to renew by themselves in this round (in the order of ``holds``): those
        whose rows do not follow the lease, and those due but not carried. ``within``: how old the lease may be
        for the renewal to land (`heartbeat_flows.fit`).

        None are renewed by the lease alone unless its revision is the one
        last seen (a forced release changes it; a lapsed lease has none):
        then each row is renewed by itself, which tells which are still held.
        Raises `DatabaseError` if the statement failed.

        One pass over ``holds`` sorts them, and one over those the lease
        renews tells which are still not due once the statement is answered:
        a round costs a few passes over thousands of holds, not one per
        question.
        """
        rows = lease.rows
        current = now()
        attached: list[Hold] = []
        due: list[Hold] = []
        alone: list[Hold] = []
        for hold in holds:
            due_at = rows.get(hold)
            if due_at is None:
                alone.append(hold)
            else:
                attached.append(hold)
                if due_at <= current:
                    due.append(hold)
        if len(attached) != len(rows):
            # Rows whose holds are no longer renewed (released, lost, paused): detached by this renewal.
            live = set(attached)
            for hold in [hold for hold in rows if hold not in live]:
                del rows[hold]
                if hold.token is not None:
                    lease.detach[hold.token] = None
        if not attached and not lease.detach:
            return None, [], alone
        due.sort(key=rows.__getitem__)
        carried, late = due[: heartbeat_flows.BATCH], due[heartbeat_flows.BATCH :]
        detach = list(lease.detach)
        if carried:
            renewal = heartbeat_flows.LeaseRenewal(lease.key, detach, within)
            beat = self._engine.run(heartbeat_flows.heartbeat(carried, statements, tracing, timeout, renewal=renewal))
            if beat.error is not None:
                raise beat.error
            revision, kept = beat.revision, detach if beat.kept is None else beat.kept
            for hold in beat.renewed:
                rows[hold] = lease.own_heartbeat_due(hold, first=False)
        else:
            revision, kept, sent_at = self._engine.run(
                heartbeat_flows.renew_lease(attached, detach, statements, lease.key, timeout, within)
            )
            beat = heartbeat_flows.Beat([], [], now() - sent_at, sent_at=sent_at)
        # Rows another session held locked were not detached: the next renewal tries them again.
        lease.detach = dict.fromkeys(kept)
        if not attached:
            return beat, [], alone
        seen, lease.seen = lease.seen, revision
        if revision is None or revision != seen:
            # Each row by itself: those the statement did not carry.
            done = set(carried)
            return beat, [], [hold for hold in holds if hold not in done]
        if len(due) == len(attached):
            return beat, [], alone + late
        current = now()
        # Carried (renewed, lost or busy: told with the statement's beat) or left already.
        seen_to = set(due)
        by_lease: list[Hold] = []
        for hold in attached:
            if hold in seen_to:
                continue
            if rows[hold] > current:
                by_lease.append(hold)
            else:
                late.append(hold)  # due since the pass above: by itself, this round
        return beat, by_lease, alone + late

    def _end_lease(self, lease: _Lease) -> None:
        """Delete the lease of a group that holds nothing any more, rather than leave its row for good."""
        statements = lease.statements
        if statements is None or statements.end_lease is None or lease.pid != os.getpid():
            return  # never used, or a parent process's
        detach = [hold.token for hold in lease.rows if hold.token is not None] + list(lease.detach)
        try:
            self._engine.run(heartbeat_flows.end_lease(detach, statements, lease.key, self._host.operation_timeout))
        except DatabaseError as exc:
            # Its row stays until another group's end deletes it (`_sql.leases.FORGOTTEN_AFTER`); nothing
            # judges a lock by a lease its holder no longer renews but as by the row's own heartbeat.
            logger.debug("could not delete a lease no lock follows any more: %s", exc)

    @staticmethod
    def _attach(lease: _Lease, batch: list[Hold], beat: heartbeat_flows.Beat) -> None:
        """The rows a per-row heartbeat renewed follow the lease from now on (a lost or busy one does not)."""
        lost = {hold for hold, _ in beat.lost}
        busy = set(beat.busy)
        # A row this statement may have pointed at the lease that then turned out not to be held: detached by the
        # next renewal (a row that does not follow the lease is left as it is).
        lease.detach.update((hold.token, None) for hold in lost if hold.token is not None)
        for hold in batch:
            if hold not in lost and hold not in busy:
                lease.rows[hold] = lease.own_heartbeat_due(hold, first=hold not in lease.rows)

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
                events = hold.lock.events
                if not events.quiet:  # else nobody is told (thousands of holds, at times)
                    events.heartbeat_renewed(beat.latency)
            for hold, seconds in beat.confirmed:
                hold.lock.events.confirmed(seconds)
            for hold, error in beat.lost:
                hold.lock.events.lost(error)

    return report
