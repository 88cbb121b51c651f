"""`Election`: one leader at a time among the replicas of a long-running service.

One lock of the lock table per election, named after it: the leader is the
lock's holder, with the Mutex's heartbeats, lease, fencing tokens, metrics
and spans. `Election.run` campaigns (waits for the lock, woken at once by
the holder's release), calls ``lead(leadership)`` while it leads, releases
the lock when ``lead`` returns, and campaigns again, until `Election.stop`::

    election = Election(dsn, "scheduler")

    def lead(leadership):
        while not leadership.ended.wait(1.0):
            run_due_jobs(token=leadership.token)

    election.run(lead)  # until election.stop(), from a signal handler say

What it promises:

- A term's lock is released only once its ``lead`` has returned, so two
  ``lead`` calls of one election never overlap while their processes keep
  their leases; the tokens of successive terms strictly increase.
- Leadership lost (the lease ran out, or the row was deleted or taken over)
  is told to ``lead`` at once: `Leadership.ended` is set, `ensure_held`
  raises, an async ``lead`` is cancelled. The lease runs out one heartbeat
  interval before anyone may reclaim the lock, so a ``lead`` that returns
  within that interval has stopped before its successor can start.
- ``stop()`` and ``resign()`` hand over at once: ``lead`` is told, the lock
  is released the moment it returns, and the next candidate is woken by that
  release rather than after ``stale_threshold``.

What it cannot promise: a thread cannot be stopped from outside, so a
``lead`` that ignores the news runs on; past ``grace_period`` the election
says so loudly (an error log, the ``election_grace_overrun`` metrics call, an
event on the term's span) but cannot end it. A process paused (GC, SIGSTOP,
a frozen VM) is told nothing until it runs again, and an operator's forced
release lets the next leader start before the old one hears of it. Writes
that must never come from a former leader need fencing: `Leadership.fence`.

Here is the election's public face and what is its own (one run at a time,
the relay out of signal handlers, closing). The rounds it runs are
`_election.campaign`'s, a term and its `Leadership` are `_election.term`'s, and who leads is
read by `_election.leader`; their public names are imported from here.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ._election.campaign import Campaign
from ._election.election_methods import ElectionMethods
from ._election.election_methods_async import AsyncElectionMethods
from ._election.leader import Leader
from ._election.leader_reader import LeaderReader
from ._election.leader_reader_async import AsyncLeaderReader
from ._election.relay import Relay
from ._election.term import Flag, Leadership, TermPolicy
from ._kinds.mutex import Mutex
from ._observe.hooks import guard
from ._state.events import ElectionEvents
from ._state.settings import Settings, check_lock_name, check_seconds
from .client import client_for
from .errors import InvalidArgument, LockNotHeldError, MutexError
from .table import LockTable

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from .client import MutexClient

__all__ = ["Election", "Flag", "Leader", "Leadership"]


class Election(AsyncElectionMethods, ElectionMethods):
    """A leader election among the processes that run it with the same name, on one lock of the lock table.

    Takes the `Mutex`'s options (connection: ``dsn``, ``pool``,
    ``async_pool`` or ``client``; ``instance_id``, ``table``, the thresholds,
    ``operation_timeout``, ``metrics``, ``tracer_provider``,
    ``reclaim_disconnected_after``: a leader whose process died is replaced
    that soon) and three of its own:

    - ``grace_period``: how long ``lead`` may take to return once told to end
      before the election reports an overrun (default: ``heartbeat_interval``,
      the time between a lost lease and the moment another candidate may
      reclaim the lock);
    - ``failure_backoff`` and ``max_failure_backoff``: after ``lead`` raises,
      the candidate waits ``failure_backoff`` seconds before campaigning
      again, doubling after each consecutive failure up to the cap. The
      back-off is this candidate's own: it resigns while it waits, so another
      candidate may lead at once (with N candidates whose ``lead`` keeps
      failing, up to N terms begin per back-off).

    One `run` (or `run_async`) at a time per Election. Raises `TypeError` or
    `ValueError`, naming the argument, on bad input.
    """

    def __init__(
        self,
        dsn: str | None = None,
        name: str | None = None,
        *,
        pool: ConnectionPool[Any] | None = None,
        async_pool: AsyncConnectionPool[Any] | None = None,
        client: MutexClient | None = None,
        instance_id: str | None = None,
        table: str = "mutex_lock",
        heartbeat_interval: float = 10.0,
        alert_threshold: float = 30.0,
        stale_threshold: float = 600.0,
        poll_interval: float = 0.5,
        operation_timeout: float | None = None,
        metrics: object | None = None,
        tracer_provider: TracerProvider | None = None,
        grace_period: float | None = None,
        failure_backoff: float = 1.0,
        max_failure_backoff: float = 60.0,
        reclaim_disconnected_after: float | None = None,
    ) -> None:
        if name is None:
            raise TypeError("Election() needs a name: Election(dsn, 'scheduler')")
        check_lock_name(name, "name")
        grace = None if grace_period is None else check_seconds(grace_period, "grace_period")
        backoff = check_seconds(failure_backoff, "failure_backoff")
        max_backoff = check_seconds(max_failure_backoff, "max_failure_backoff")
        if max_backoff < backoff:
            raise InvalidArgument(
                "{max_failure_backoff} ({most:g}s) must not be shorter than {failure_backoff} ({least:g}s)",
                most=max_backoff,
                least=backoff,
            )
        # The Mutex's settings, and its on_lost: the election's own, which ends the term.
        settings = Settings.from_arguments({**locals(), "on_lost": self._on_lost})
        self._mutex = Mutex._made(name, client_for(dsn, pool, async_pool, client), settings)
        timing = settings.timing
        self._grace = timing.heartbeat_interval if grace is None else grace
        self._campaign = Campaign(
            self._mutex,
            ElectionEvents(
                lock_name=name, instance_id=self._mutex.instance_id, hook=guard(metrics), grace_period=self._grace
            ),
            TermPolicy(backoff, max_backoff, rejoin_pause=max(0.25, 2 * timing.poll_interval)),
            self._grace,
        )
        reading = (
            LockTable(client=self._mutex.client, table=table, operation_timeout=timing.operation_timeout),
            name,
            timing.alert_threshold,
            timing.stale_threshold,
        )
        self._leaders, self._leaders_async = LeaderReader(*reading), AsyncLeaderReader(*reading)
        self._relay: Relay | None = None
        self._running = threading.Lock()
        self._close_when_done = False

    # -- introspection -------------------------------------------------------------

    @property
    def name(self) -> str:
        """The election's name: the name of its lock in the table."""
        return self._mutex.lock_name

    @property
    def instance_id(self) -> str:
        """This candidate's id, as the table (and `leader`) shows it while it leads."""
        return self._mutex.instance_id

    @property
    def grace_period(self) -> float:
        return self._grace

    @property
    def leading(self) -> bool:
        """True while this candidate leads and its term has not been told to end. Never touches the database."""
        term = self._campaign.term
        return term is not None and term.leadership.held

    @property
    def leadership(self) -> Leadership | None:
        """The current term, while ``lead`` runs (None otherwise)."""
        term = self._campaign.term
        return None if term is None else term.leadership

    @property
    def stopped(self) -> bool:
        """True once `stop` was called: an Election does not campaign again after it."""
        return self._campaign.stop_requested

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else "leading" if self.leading else "not leading"
        return f"<Election name={self.name!r} instance_id={self.instance_id!r} {state}>"

    # -- what run and run_async share (their own are `AsyncElectionMethods` and its twin) -----

    def _enter(self) -> None:
        if not self._running.acquire(blocking=False):
            raise MutexError(f"election {self.name!r} is running already: one run() or run_async() at a time")
        # Started here, never in stop(): a signal handler may not start a thread.
        self._relay = Relay(self._campaign.stop_now, self._campaign.resign_now, name=self.name)

    def _leave(self) -> None:
        relay, self._relay = self._relay, None
        if relay is not None:
            relay.close(self._mutex.config.operation_timeout)

    def _on_lost(self, error: LockNotHeldError) -> None:
        """The Mutex lost its lock (on the client's event thread): tell the term it belongs to, at once."""
        self._campaign.on_lost(error)

    # -- ending ------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop campaigning, for good; if leading, tell ``lead`` to stop, and release the moment it returns.

        Returns at once: call it from any thread, from a signal handler, or
        from the event loop of `run_async`. A campaign waiting for the lock
        ends at once, or when the statement it has in flight ends (within
        ``operation_timeout``); the next candidate is woken by the release.
        """
        self._campaign.request_stop()
        relay = self._relay
        if relay is None or not relay.send(Relay.STOP):
            self._campaign.stop_now()

    def resign(self) -> bool:
        """Give up the current term and keep campaigning: another candidate takes over at once.

        ``lead`` is told (as for `stop`), the lock is released the moment it
        returns, and this candidate campaigns again only after a short pause
        (twice ``poll_interval``, at least 0.25 s), so a waiting candidate wins.
        Returns False if this candidate was not leading. Safe from any thread.
        """
        term = self._campaign.term
        if term is None or term.endings:
            return False
        relay = self._relay
        if relay is None or not relay.send(Relay.RESIGN):
            self._campaign.resign_now()
        return True
