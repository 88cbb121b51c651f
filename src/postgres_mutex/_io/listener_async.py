"""The listener of one engine: one LISTENing connection for every waiter, in dsn mode.

A waiter subscribes to its lock's channel and is told when a release is
notified there, so it tries again at once rather than at its next poll.
Each notification frees one hold (a mutex, or one permit of a semaphore), so
it wakes one waiter, the longest subscribed among those not yet woken. The
listener registers the process on each channel it LISTENs on, in a slot that
has a channel of its own, and a release notifies one registered process's
slot (`_sql.wake`): only that one hears it and wakes a waiter, so a release
costs one attempt and one delivery across the fleet, not one per waiter nor
one per process (no thundering herd). A notification on the lock's own
channel (nobody could register) wakes one waiter of each process. A waiter
that leaves without trying after its wake-up passes it on
(`Listener.wake_one`), to another process if none of this one's can use it; one
that leaves with the lock first takes what was heard already, most often the
release its own attempt saw as it won.
A notification with the payload `WAKE_ALL` (a change of a semaphore's N,
which may free many permits at once) wakes every waiter, and so does a lost
connection. Once the last waiter of a lock leaves, the listener
keeps its registration there a while (`_REGISTERED_LINGER` if it left with the
lock, until `_AFTER_RELEASE` after the process released it; else
`_AFTER_RELEASE`), then stops LISTENing on
the lock's channels: a process that waited on a lock is likely to wait on it
again soon (a loop over one contended lock), and registering anew would cost
each wait two round trips and an attempt. A process's own release does not
wake it (`releasing`); the first release of another it hears meanwhile, when
none of its waiters is there, is passed on, and ends the linger: a process
done with a lock costs the others one wake-up passed on at most.

A waiter whose listener LISTENed on the channel since before its last attempt
was sent, and heard nothing on it since, needs no attempt after subscribing:
every release the attempt did not see is yet to be heard (`Subscription.heard`).

A notification reaches its waiter with nobody in between: the waiter reads
the socket itself while it waits, or is woken by the callback that reads it
(`AReader` says which). The connection is opened for the first waiter and closed a while
after the last one; through a transaction-mode pooler nothing it sends is
prepared. While it is down, waiters poll; a listener that keeps failing is
reported.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq

from .._base.acompat import AEvent, AReader, AWaker, AWorker, asleep, auncancellable
from .._base.clock import MAX_SLICE, now
from .._base.connections import FAILURES, discard
from .._base.watchdog import Cutter
from .._sql import fair, lock, wake
from .._state.events import Defects
from .interrupt_async import interrupt

if TYPE_CHECKING:
    from .host import EngineHost

logger = logging.getLogger("postgres_mutex")

# How long the listener keeps its connection once nobody waits: waiters come
# in bursts, and each new connection costs the first waiter of a burst a moment.
# It LISTENs on nothing meanwhile, so no release wakes it.
_LISTENER_LINGER = 10.0

# A listener that fails this many times in a row is a fault to report (one
# lost connection is a failover or a restart, and waiters poll through it);
# while it goes on failing, the report repeats at most every _LISTENER_REPORT_EVERY.
_LISTENER_FAILURES_REPORTED = 3
_LISTENER_REPORT_EVERY = 60.0

# How long the listener stays registered on a lock's channel after its last waiter there left (most often
# with the lock: nobody else releases it meanwhile, and this process's own release does not wake it), and
# after this process's release of it. Long enough for a loop over one contended lock to come back and wait
# (no registration per wait); short enough that a process done with the lock is not chosen by others'
# releases for long: the first such wake-up, passed on (one statement, a round trip later for the waiter
# it reaches), ends the linger.
_REGISTERED_LINGER = 5.0
_AFTER_RELEASE = 0.1

# A poll due this soon is made now: an attempt a moment ago was this waiter's own.
_POLL_TOLERANCE = 0.001

# The most channels a listener registers on at once: each registration holds two entries of
# the server's shared lock table (64 per connection by default, for the whole server). A
# process that waits on more locks at once LISTENs on the others without registering.
MOST_REGISTERED = 32


class Subscription:
    """One waiter's interest in one lock's releases."""

    __slots__ = ("channel", "confirmed", "handed", "heard", "one_hold", "released", "who", "woken")

    def __init__(self, channel: str, who: str | None = None, *, one_hold: bool = False) -> None:
        self.channel = channel
        self.who = who
        """A waiter in line's acquire (a fair Mutex's ``wait_id``): a release that hands it the lock names it."""
        self.one_hold = one_hold
        """The lock has one hold (a Mutex): once this waiter is woken, its attempt sees any later release too."""
        self.heard = False
        """The listener LISTENed on the channel since before the waiter's last attempt was sent, and heard
        nothing there since: every release that attempt did not see is yet to be heard, so no attempt is due."""
        self.handed: tuple[int, int] | None = None
        """The hold a release handed this waiter: its token and ``acquired_at`` (µs since the epoch)."""
        self.confirmed = AEvent()
        """Set once the listener LISTENs on the channel: a release from then on is heard."""
        self.released = AEvent()
        """Set when this waiter is to try again: a release was announced (or may have been missed)."""
        self.woken = False
        """A release's wake-up was given to this waiter and no attempt has used it yet (under the state lock)."""


class Listener:
    """One LISTENing connection for every waiter of the engine; a release wakes only its lock's waiters."""

    def __init__(self, host: EngineHost, dsn: str, connect_kwargs: dict[str, Any]) -> None:
        self._host = host
        self._dsn = dsn
        self._kwargs = connect_kwargs
        # Per channel, in the order the waiters subscribed: the first not yet woken is woken next.
        self._subscriptions: dict[str, dict[Subscription, None]] = {}
        self._waker = AWaker()
        self._worker: AWorker | None = None
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._listening: set[str] = set()
        # The channels listened on where this process is registered (at most MOST_REGISTERED): their slots.
        self._registered: dict[str, int] = {}
        # Each registered channel's slot's channel, and the lock's channel it stands for.
        self._slot_channels: dict[str, str] = {}
        self._reader = AReader(self._waker)
        # The connection a waiter found failed (`_drain_here`), which the listener's thread replaces.
        self._failed: psycopg.AsyncConnection[Any] | None = None
        # Channels whose wake-up no waiter of this process could use: passed on by the worker.
        self._passing: list[str] = []
        self._backend_pid: int | None = None
        # Per channel listened on (under the state lock): since when it is, or a notification on it was last
        # heard, whichever is later (`Subscription.heard`). Dropped before its UNLISTEN is sent.
        self._quiet_since: dict[str, float] = {}
        # Per channel listened on whose last waiter left: until when its registration lingers.
        self._linger_until: dict[str, float] = {}
        # Per channel waited on (under the state lock): when this process's waiters last attempted, or a
        # waiter's poll was due (`poll_due`). Dropped with the channel's last waiter.
        self._attempted_at: dict[str, float] = {}
        self._closed = False
        self._defects = Defects("release listener")

    def subscribe(
        self, channel: str, who: str | None = None, since: float | None = None, *, one_hold: bool = False
    ) -> Subscription:
        """Subscribe a waiter to ``channel``'s releases; ``since``: when its last attempt was sent, if it knows.

        If the channel was listened on since before ``since`` and nothing was
        heard there since, the subscription is `Subscription.heard` at once.
        """
        subscription = Subscription(channel, who, one_hold=one_hold)
        with self._host.state_lock:
            quiet_since = self._quiet_since.get(channel)
            subscription.heard = since is not None and quiet_since is not None and quiet_since <= since
            self._linger_until.pop(channel, None)
            self._subscriptions.setdefault(channel, {})[subscription] = None
            if (self._worker is None or not self._worker.running) and not self._closed:
                self._worker = AWorker(self._run, name="postgres-mutex-listener")
        self._waker.wake()
        return subscription

    def unsubscribe(self, subscription: Subscription, *, holding: bool = False) -> None:
        """The waiter of ``subscription`` left; ``holding``: with the lock, which nobody else releases meanwhile."""
        conn = self._conn
        if holding and conn is not None and conn is not self._failed:
            # What was heard already is most often the release its own attempt saw as it won (the attempt
            # raced it): told to this waiter, still here, it is used. Read once nobody of this process
            # waits, it would be passed on, and end the registration's linger as a stranger's release does.
            self._reader.drain_if_free(self._drain_here, conn)
        with self._host.state_lock:
            waiting = self._subscriptions.get(subscription.channel)
            if waiting is not None:
                waiting.pop(subscription, None)
                if not waiting:
                    del self._subscriptions[subscription.channel]
                    self._attempted_at.pop(subscription.channel, None)
                    self._linger_until[subscription.channel] = now() + (
                        _REGISTERED_LINGER if holding else _AFTER_RELEASE
                    )
        self._waker.wake()

    def releasing(self, channel: str) -> int | None:
        """This process is about to release a hold of ``channel``'s lock: its slot there, which the release is
        not to wake, if it is registered; its negative if a waiter of this process sleeps there, which the
        release may wake (`_sql.wake.after_release`).

        With nobody of this process waiting there, the registration lingers
        `_AFTER_RELEASE` more at most: long enough for a loop to come back and
        wait, not so long that others' releases choose a process done with the lock.
        """
        with self._host.state_lock:
            waiting = self._subscriptions.get(channel)
            slot = self._registered.get(channel)
            if waiting is None:
                if channel in self._linger_until:
                    self._linger_until[channel] = min(self._linger_until[channel], now() + _AFTER_RELEASE)
            elif slot is not None and any(not subscription.woken for subscription in waiting):
                return -slot  # a waiter of this process sleeps (another Mutex of the name): it may be the one woken
        return slot

    def in_line_as(self, channel: str, wait_id: str) -> str:
        """A fair lock's waiter's ``wait_id`` for its next attempt: with this process's slot on ``channel``, if
        it holds one (its registration lingers from an earlier wait, or a waiter of it waits there now), so that
        a release handing it the lock tells this process alone (`_sql.fair.at_slot`)."""
        slot = self._registered.get(channel)
        return wait_id if slot is None else fair.at_slot(wait_id, slot)

    @property
    def listening(self) -> frozenset[str]:
        """The channels the connection LISTENs on right now (each until a while after its last waiter left)."""
        return frozenset(self._listening)

    async def wait(self, subscription: Subscription, timeout: float) -> None:
        """Wait until ``subscription``'s waiter is woken (`Subscription.released`) or ``timeout`` passes."""
        conn = self._conn
        fd = None
        if conn is not None and conn is not self._failed and not conn.closed and not self._closed:
            # Closed by the listener's thread meanwhile: the waiter waits on its event alone.
            with contextlib.suppress(psycopg.OperationalError):
                fd = conn.fileno()
        read = await self._reader.wait(subscription.released, fd, functools.partial(self._drain_here, conn), timeout)
        if (read and len(self._subscriptions) > 1) or self._conn is not conn:
            # Other waiters' releases arrive meanwhile: the listener reads the socket again.
            self._waker.wake()

    def wake(self, subscription: Subscription) -> None:
        """Wake ``subscription``'s waiter from any thread (an election's stop, say), wherever it waits."""
        subscription.released.set()
        self._reader.poke()

    def wake_one(self, channel: str) -> None:
        """Wake the longest waiting subscriber of ``channel`` not woken yet: one hold was freed.

        If no waiter of this process can use it, another process's may: the
        wake-up is passed on, since a release told this process alone.
        """
        if not self._wake_here(channel):
            with self._host.state_lock:
                if not self._closed:
                    self._passing.append(channel)
            self._waker.wake()

    def _wake_here(self, channel: str) -> bool:
        """Wake the longest waiting subscriber of ``channel`` not woken yet, if any (True then)."""
        with self._host.state_lock:
            waiting = self._subscriptions.get(channel, ())
            chosen = next((sub for sub in waiting if not sub.woken), None)
            if chosen is not None:
                # Marked under the lock: two releases heard at once must choose two different waiters.
                chosen.woken = True
            elif any(sub.one_hold for sub in waiting):
                # A waiter here is woken, its attempt not sent yet (that clears `woken`): of a lock with one
                # hold, that attempt sees this release too. Passed on, the wake-up would only go round.
                return True
        if chosen is None:
            return False
        self.wake(chosen)
        return True

    def take_wake(self, subscription: Subscription) -> bool:
        """An attempt is about to be sent: it uses the waiter's wake-up, if any (True then).

        A release announced from now on wakes the waiter again, so its next
        wait ends at once: nothing announced after the attempt left is lost.
        """
        with self._host.state_lock:
            woken, subscription.woken = subscription.woken, False
            self._attempted_at[subscription.channel] = now()
        subscription.released.clear()
        return woken

    def poll_due(self, subscription: Subscription, pause: float) -> float:
        """How much longer ``subscription``'s waiter may wait before it polls: 0 if no waiter of this process
        attempted on its channel within ``pause`` (this waiter polls then, and the others count that poll as
        theirs), else until a ``pause`` after the latest attempt there."""
        with self._host.state_lock:
            current = now()
            left = self._attempted_at.get(subscription.channel, -math.inf) + pause - current
            if left > _POLL_TOLERANCE:
                return left
            self._attempted_at[subscription.channel] = current
            return 0.0

    def take_handed(self, subscription: Subscription) -> tuple[int, int] | None:
        """The hold a release handed ``subscription``'s waiter (its token and ``acquired_at`` in µs), if any:
        taken, with the wake-up that told it, as an attempt takes a wake-up."""
        with self._host.state_lock:
            handed, subscription.handed = subscription.handed, None
        if handed is not None:
            self.take_wake(subscription)
        return handed

    def _released(self, channel: str, payload: str) -> None:
        chosen = self._slot_channels.get(channel)
        if chosen is not None and payload == wake.UNREGISTERED:
            return  # this process's own, as it gives the slot back: the releases before it were heard
        lock_channel = channel if chosen is None else chosen
        handing = payload.startswith(fair.WAKE_FAIR)
        with self._host.state_lock:
            # Heard: a waiter whose attempt was sent before now tries again once subscribed.
            if lock_channel in self._quiet_since:
                self._quiet_since[lock_channel] = now()
            # Heard with nobody here waiting: other processes wait on the lock, and the releases that chose this
            # one would each be passed on. The registration lingers no longer (one wake-up passed on at most).
            # Not for a fair lock's hand-off: it names its waiter, and nobody passes it on.
            ended = (
                lock_channel not in self._subscriptions
                and self._linger_until.get(lock_channel, 0.0) > now()
                and not handing
            )
            if ended:
                self._linger_until[lock_channel] = now()
        if ended:
            self._waker.wake()
        if handing:
            # A fair lock handed to one waiter (of this process, if it is here; told on its slot's channel if
            # its attempt named the slot, `_sql.fair.at_slot`): that one takes it.
            self._wake_named(lock_channel, payload)
            return
        if chosen is not None:
            # This process alone was told (its slot's channel): one waiter here, else another process's.
            self.wake_one(chosen)
            return
        if payload == wake.WAKE_EACH_PROCESS:
            # Every process was told: one waiter here tries, and nothing is passed on.
            self._wake_here(channel)
            return
        if payload != wake.WAKE_ALL:
            return  # another process's (named by a release of an earlier version)
        with self._host.state_lock:
            waiting = list(self._subscriptions.get(channel, ()))
            for subscription in waiting:
                subscription.woken = True
        for subscription in waiting:
            self.wake(subscription)

    def _wake_named(self, channel: str, payload: str) -> None:
        handed = fair.handed(payload)
        if handed is None:
            return
        who, token, acquired_us = handed
        with self._host.state_lock:
            named = [sub for sub in self._subscriptions.get(channel, ()) if sub.who == who]
            for subscription in named:
                subscription.woken = True
                subscription.handed = (token, acquired_us)
        for subscription in named:
            self.wake(subscription)

    def _wake_everyone(self) -> None:
        # The connection was lost: a release may have gone unheard. Every waiter retries now.
        with self._host.state_lock:
            waiting = [sub for subs in self._subscriptions.values() for sub in subs]
            for subscription in waiting:
                subscription.woken = True
        for subscription in waiting:
            self.wake(subscription)

    async def _run(self) -> None:
        listening, registered, slot_channels = self._listening, self._registered, self._slot_channels
        cutter: Cutter | None = None
        failures = 0
        reported_at: float | None = None
        idle_since: float | None = None
        try:
            while not self._closed:
                with self._host.state_lock:
                    wanted = set(self._subscriptions)
                    passing, self._passing = self._passing, []
                    at = now()
                    lingering = {c for c in listening - wanted if at < self._linger_until.get(c, 0.0)}
                    dropping = listening - wanted - lingering
                    for channel in dropping:
                        # From now on a waiter subscribing there tries again once it is listened on anew.
                        self._quiet_since.pop(channel, None)
                        self._linger_until.pop(channel, None)
                    for channel in [c for c in self._linger_until if c not in listening and c not in wanted]:
                        del self._linger_until[channel]  # never listened on, or lost with a connection
                    if wanted or listening or passing:
                        idle_since = None
                    elif idle_since is None:
                        idle_since = now()
                    elif now() - idle_since >= _LISTENER_LINGER:
                        # Nobody has waited for a while: close the connection until someone does.
                        self._worker = None
                        return
                try:
                    if self._conn is None or cutter is None:
                        self._conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True, **self._kwargs)
                        self._conn.add_notify_handler(lambda notify: self._released(notify.channel, notify.payload))
                        cutter = Cutter(self._conn.fileno())
                        self._backend_pid = self._conn.info.backend_pid
                        listening.clear()
                        registered.clear()
                        slot_channels.clear()
                        with self._host.state_lock:
                            self._quiet_since.clear()
                        if failures:
                            self._wake_everyone()
                    conn, pid = self._conn, self._conn.info.backend_pid
                    for channel in passing:
                        await self._execute(conn, cutter, wake.pass_on(channel, registered.get(channel)))
                    for channel in sorted(dropping):
                        # Nobody of this process waits there now: no release should wake it. A release
                        # that chose its slot first is heard still, and passed on (`_sql.wake.unregister`).
                        slot = registered.get(channel)
                        if slot is not None:
                            await self._execute(conn, cutter, wake.unregister(channel, slot))
                        await self._execute(conn, cutter, wake.stop_listening(channel, slot))
                        listening.discard(channel)
                        if slot is not None:
                            del registered[channel], slot_channels[wake.slot_channel(channel, slot)]
                    for channel in sorted(wanted - listening):
                        if len(registered) < MOST_REGISTERED:
                            row = await self._execute(conn, cutter, wake.register(channel, pid))
                            listening.add(channel)
                            if row is not None and row[0] is not None:
                                registered[channel] = row[0]
                                slot_channels[wake.slot_channel(channel, row[0])] = channel
                        else:
                            await self._execute(conn, cutter, lock.listen(channel))
                            listening.add(channel)
                        with self._host.state_lock:
                            # Committed: every release from now on is heard.
                            self._quiet_since[channel] = now()
                    self._confirm(listening)
                    failures, reported_at = 0, None
                    wait = MAX_SLICE
                    if lingering:
                        # Back when the first lingering registration is due to end.
                        ends = min(self._linger_until.get(c, 0.0) for c in lingering)
                        wait = max(0.001, min(wait, ends - now()))
                    busy_until = self._reader.busy_until()
                    if busy_until > now() and self._failed is not conn:
                        # A waiter reads the socket: this waits for a wake-up only, until that waiter's turn ends.
                        await self._waker.wait_readable(None, min(wait, busy_until - now()), self._drain_none)
                    else:
                        await self._waker.wait_readable(conn.fileno(), wait, functools.partial(self._drain_now, conn))
                except Exception as exc:
                    with self._host.state_lock:
                        # Not sent, or perhaps not: sent again once connected (twice costs one attempt).
                        self._passing[:0] = passing
                    failures += 1
                    if not isinstance(exc, FAILURES):
                        # A defect: said loudly, and the listener goes on as after a lost connection.
                        self._defects.report("listening for releases", exc, "on a new connection")
                    reason = self._host.redactor.redact(str(exc))
                    persistent = failures >= _LISTENER_FAILURES_REPORTED and (
                        reported_at is None or now() - reported_at >= _LISTENER_REPORT_EVERY
                    )
                    if persistent:
                        reported_at = now()
                        logger.warning(
                            "the release listener lost its connection (%s), %d times in a row; waiters poll "
                            "every poll_interval meanwhile, so a release reaches them later",
                            reason,
                            failures,
                        )
                    else:
                        logger.debug("the release listener lost its connection (%s); waiters poll meanwhile", reason)
                    if cutter is not None:
                        cutter.close()
                    cutter = None
                    self._drop()
                    with self._host.state_lock:
                        self._quiet_since.clear()
                    self._wake_everyone()
                    # Not a busy loop: a pause that grows, up to a few seconds.
                    await asleep(min(0.05 * 2**failures, 5.0))
        except BaseException:
            # Ended by something unexpected (or the loop's shutdown): the next waiter starts a new one.
            with self._host.state_lock:
                self._worker = None
            raise
        finally:
            if cutter is not None:
                cutter.close()
            self._drop()

    async def _execute(self, conn: psycopg.AsyncConnection[Any], cutter: Cutter, text: str) -> tuple[Any, ...] | None:
        """Run ``text`` (one or more statements); the first row of the last that answers rows, if any."""
        timeout = self._host.operation_timeout
        with self._reader.using():
            ticket = cutter.arm(timeout)
            try:
                # Never prepared (psycopg prepares a statement it has run five times): behind a
                # transaction-mode pooler a prepared statement would stay on a server connection
                # other clients share, and collide with theirs.
                cursor = await auncancellable(
                    conn.execute(text, prepare=False), functools.partial(interrupt, conn, cutter, timeout)
                )
                row = None
                while True:
                    if cursor.description:
                        row = await cursor.fetchone()
                    if not cursor.nextset():
                        return row
            finally:
                cutter.disarm(ticket)

    def _confirm(self, listening: set[str]) -> None:
        with self._host.state_lock:
            heard = [sub for channel in listening for sub in self._subscriptions.get(channel, ())]
        for subscription in heard:
            subscription.confirmed.set()

    def _drain_now(self, conn: psycopg.AsyncConnection[Any]) -> None:
        with self._reader.using():
            self._drain(conn)

    def _drain_none(self) -> None:
        pass

    def _drain_here(self, conn: psycopg.AsyncConnection[Any] | None) -> bool:
        """A waiter's read of the socket (`Reader`); False if the connection failed (its thread then looks)."""
        if conn is None or self._conn is not conn:
            return False
        try:
            self._drain(conn)
        except Exception:
            # Not read again by a waiter: the listener's thread finds the failure and reconnects.
            self._failed = conn
            self._waker.wake()
            return False
        return True

    def _drain(self, conn: psycopg.AsyncConnection[Any]) -> None:
        pgconn = conn.pgconn
        pgconn.consume_input()
        while (notify := pgconn.notifies()) is not None:
            self._released(notify.relname.decode(errors="replace"), notify.extra.decode(errors="replace"))
        if conn.broken or pgconn.status != pq.ConnStatus.OK:
            raise psycopg.OperationalError("the listener's connection was closed")

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._reader.poke()  # a waiter reading its socket stops
            with self._reader.using():  # and is not reading it as it closes
                discard(conn)

    async def close(self) -> None:
        self._closed = True
        self._waker.wake()
        with self._host.state_lock:
            worker = self._worker
        if worker is not None:
            await worker.join(self._host.operation_timeout + 1.0)
        self._drop()
        self._waker.close()
        self._reader.close()

    def abandon(self) -> None:
        self._closed = True
        self._drop()
