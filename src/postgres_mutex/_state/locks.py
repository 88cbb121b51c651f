"""What each Mutex knows about its lock, and the holds its client keeps alive.

Ownership is simple on purpose: every change to a `LockState` or a `Hold`
happens under its client's one `StateLock` (taken for an instant, never
across I/O), so the caller's thread, the heartbeat loop, the listener and the
event thread always see one consistent picture. Nothing here does I/O.

A *hold* is one acquisition, from the statement that won the row to its
release or loss. It is identified by the ``acquired_at`` the server stamped
on the row: heartbeats and releases are scoped to it, so a statement of an
earlier hold that arrives late can never touch a later one. Its *lease* is
measured from the moment the last successful acquire or heartbeat statement
was sent; it is one heartbeat interval shorter than ``stale_threshold``, so
the holder always learns it lost the lock before anyone else may reclaim it.

A holder that opted in to ``reclaim_disconnected_after`` (R) may be reclaimed
sooner, once its session has ended and its heartbeat is older than R. It
cannot see its own session from outside, so it trusts its hold for R minus one
heartbeat interval after the last heartbeat that succeeded was sent: past that
the hold is *in doubt*. (A failed heartbeat alone changes nothing: the server
stamped the last one that succeeded no earlier than it was sent, so nobody may
reclaim the row before R has passed since then, whatever ended the session.)
A hold in doubt is not held (`held` is false, `require_held` raises) but not
lost either: it is still heartbeated, and the next heartbeat that finds its
row confirms it (it is held again) or finds the row gone (it is lost). Its
lease runs as before.

A *stray row* is a row of ours that an acquire whose reply never came may
have left in the table, or may still leave: the statement can go on running
on the server until ``stray_row_may_land_until``. A *clean-up* deletes, in
the background, a row of ours nobody waits for: a stray row, or a held row a
release could not delete. Each acquire starts a new *generation* of its lock;
a stray row's clean-up from an earlier one is *superseded*, never sent (the
acquire takes any row of ours back itself), and an acquire waits while a
clean-up is on the wire, so the two never cross.
"""

from __future__ import annotations

import enum
import math
import threading
from datetime import datetime
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import SpanContext

from .._base.clock import now
from .._observe.tracing import INSTANCE_ID, LOCK_NAME, AttributeValue
from ..errors import LockAlreadyHeldError, LockNotHeldError
from .alerts import AlertGate
from .kind import MUTEX, LockKind

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._observe.tracing import Tracing
    from .._sql import Names
    from .events import LockEvents
    from .settings import Timing

LEASE_EXPIRED = "its lease ran out: no heartbeat succeeded for stale_threshold - heartbeat_interval"
ROW_GONE = "its row was deleted or taken over by another instance"
RELEASED_ELSEWHERE = "release() was called from another thread or task while the block holding it ran"
INTERRUPTED = "the acquire that won it was interrupted before it returned: its row is deleted in the background"
NOT_HELD = "this Mutex does not hold the lock"
IN_DOUBT = (
    "its hold is in doubt: no heartbeat succeeded for reclaim_disconnected_after - heartbeat_interval, and another "
    "instance may reclaim it if its session ended; the next heartbeat confirms it or finds it lost"
)

StateLock = threading.Lock


class Phase(enum.Enum):
    IDLE = "idle"
    ACQUIRING = "acquiring"
    HOLDING = "holding"
    RELEASING = "releasing"


class HoldStatus(enum.Enum):
    HELD = "held"
    """Renewed by heartbeats while its lease lasts."""
    LOST = "lost"
    """Its lease ran out or its row was gone: never renewed again."""
    ENDED = "ended"
    """Released (or being released): no longer renewed."""


class Hold:
    """One acquisition of one lock by one Mutex."""

    __slots__ = (
        "acquired_at",
        "doubt_deadline",
        "doubt_told",
        "generation",
        "group",
        "lease_deadline",
        "lock",
        "owner",
        "paused",
        "plain",
        "reason",
        "renewed_at",
        "row_name",
        "running_out_told",
        "span_context",
        "status",
        "token",
    )

    def __init__(
        self,
        lock: LockState,
        acquired_at: datetime,
        token: int | None,
        sent_at: float,
        owner: object,
        span_context: SpanContext | None,
        row_name: str | None,
        plain: bool,
    ) -> None:
        # Made by `LockState.won` alone, which passes each argument by position: one per acquire.
        self.lock = lock
        self.plain = plain
        """Acquired without a minimum hold: its row has no ``hold_until``, and its release may delete it outright."""
        self.row_name = lock.lock_name if row_name is None else row_name
        """The ``lock_name`` of its row: the lock's own, or the one its kind chose (a semaphore's permit)."""
        self.acquired_at = acquired_at
        self.token = token
        self.renewed_at = sent_at
        """When the last acquire or heartbeat statement that succeeded for it was sent."""
        self.lease_deadline = sent_at + lock.lease
        self.doubt_deadline = sent_at + lock.doubt
        """When it turns in doubt without a successful heartbeat (never, for a holder that did not opt in)."""
        self.doubt_told = False
        """Its doubt was reported (it is reported once, and its end once)."""
        self.running_out_told = False
        """Two thirds of its trust ran out without a heartbeat, and that was reported."""
        self.status = HoldStatus.HELD
        self.reason = ""
        self.owner = owner
        """The thread or task that acquired it: a release from elsewhere is reported to it."""
        self.span_context = span_context
        self.group: HeartbeatGroup | None = None
        """The heartbeat group of the engine that renews it."""
        self.paused = False
        """Heartbeats skip it, as they would a frozen process's: how tests freeze a holder in-process."""
        self.generation = lock.generation
        """The acquire that won it (`LockState.generation`)."""

    @property
    def trusted_until(self) -> float:
        """Until when it is held, without another heartbeat: its lease, or sooner its doubt."""
        return min(self.lease_deadline, self.doubt_deadline)

    @property
    def held(self) -> bool:
        return self.status is HoldStatus.HELD and now() < self.trusted_until

    @property
    def in_doubt(self) -> bool:
        return self.status is HoldStatus.HELD and self.doubt_deadline <= now() < self.lease_deadline

    def running_out_at(self) -> float:
        """When two thirds of the time it is trusted without a heartbeat have gone."""
        return self.renewed_at + (self.trusted_until - self.renewed_at) * 2 / 3

    def error(self, reason: str | None = None) -> LockNotHeldError:
        return self.lock.not_held_error(reason or self.reason or NOT_HELD)


class LockState:
    """One holder's lock: its identity, its kind, settings, how its events are told, and its current hold.

    What differs with what is held (a mutex, a semaphore's permit, a read/write lock's mode) is its
    `LockKind`'s to say. A hold's row may be named otherwise than the lock (a semaphore's is a row per
    permit), and each hold carries its row's ``lock_name``: statements address the hold's row by it, while
    names, metrics, spans and the wake-up channel are the lock's own.
    """

    def __init__(
        self,
        *,
        names: Names,
        lock_name: str,
        instance_id: str,
        timing: Timing,
        events: LockEvents,
        tracing: Tracing,
        state_lock: StateLock,
        kind: LockKind = MUTEX,
    ) -> None:
        self.kind = kind
        """What is held, and all that differs with it (`LockKind`)."""
        self.names = names
        self.tracing = tracing
        self.lock_name = lock_name
        self.instance_id = instance_id
        self.timing = timing
        self.events = events
        self.channel = names.channel(lock_name, kind.noun)
        self.alert_gate = AlertGate(timing.alert_threshold)
        self._lock = state_lock
        self.phase = Phase.IDLE
        self.hold: Hold | None = None
        self.last_holder: str | None = None
        """Who held the lock at this Mutex's last contended attempt, for messages."""
        self.gave_way_at: float | None = None
        """When this Mutex's last release (sent then) woke a waiting process other than this one: its next
        blocking acquire lets that waiter go first (`_state.flows`), as a queue would, rather than take
        the lock back before the waiter it woke can try."""
        self.stray_row_possible = False
        """An acquire of ours went unanswered: a stray row may be in the table."""
        self.stray_row_may_land_until = 0.0
        """Until then an unanswered acquire of ours may still be running on the server, and land."""
        self.generation = 0
        """Bumped by every acquire: a stray row's clean-up begun earlier is superseded."""
        self.acquirer: object = None
        """Who began the current (or last) acquire: only it ends that acquire (`abort_acquire`, `abandon_acquire`)."""
        self.releaser: object = None
        """Who began the release under way: only it ends it (`end_release`)."""
        self.cleanup_sender: object = None
        """The stray row's clean-up on the wire, if any: an acquire waits for it, so the two never cross."""
        self._cleanup_until = 0.0
        """When that clean-up can no longer land, whether or not its sender is still there to say so."""
        self.lease = timing.lease
        """How long a hold is held after the last statement that renewed it was sent (`Timing.lease`)."""
        doubt = timing.doubt
        self.doubt = math.inf if doubt is None else doubt
        """How long a hold is trusted after it, if its holder opted in to reclaim_disconnected_after, else
        infinity. Both read once here: the settings compute them, and every acquire reads them."""
        self.engine: Any = None
        """The sync engine this lock's last acquire ran on, kept for the next: resolved once, as long as it
        stays open (see `_io.acquisition_async`); forgotten in a forked child, whose engines are its own."""
        self.async_engine: Any = None
        """Likewise for the last async acquire: an event loop's engine, kept while it is that loop's."""
        self._name_itself()

    def _name_itself(self) -> None:
        """What an uncontended cycle sends and says, made once (and again when the instance_id changes)."""
        self.acquire_action = self.describe("acquire")
        self.release_action = self.describe("release")
        self.plain_acquire_params: Mapping[str, object] = {
            "lock_name": self.lock_name,
            "instance_id": self.instance_id,
            "stale_seconds": self.timing.stale_threshold,
        }
        """The parameters of an acquire's plain statement (`_sql.Statements.acquire_plain`)."""

    # -- queries ---------------------------------------------------------------

    @property
    def held(self) -> bool:
        hold = self.hold
        return self.phase is Phase.HOLDING and hold is not None and hold.held

    def lease_remaining(self) -> float | None:
        """Seconds the current hold stays held without another heartbeat; None if not held."""
        with self._lock:
            hold = self.hold
            if self.phase is not Phase.HOLDING or hold is None or not hold.held:
                return None
            return max(0.0, hold.trusted_until - now())

    @property
    def row_name(self) -> str:
        """The ``lock_name`` of the row an acquire writes, when known before it: a read/write lock's is."""
        return self.kind.row_name(self.lock_name, self.instance_id)

    def params(self) -> dict[str, object]:
        hold = self.hold
        params: dict[str, object] = {
            "lock_name": self.row_name if hold is None else hold.row_name,
            "instance_id": self.instance_id,
            "stale_seconds": self.timing.stale_threshold,
            "reclaim_seconds": self.timing.reclaim_disconnected_after,
            "channel": self.channel,
            "own_slot": None,  # the release wakes any registered process (`Listener.releasing`)
            "acquired_at": None if hold is None else hold.acquired_at,
            "ended_how": "released",
            "alert_seconds": self.timing.alert_threshold,
            "hold_seconds": None,  # an acquire's minimum hold, which the acquire sets
        }
        params.update(self.kind.params(self.lock_name, self.row_name, self.timing))
        return params

    def span_attributes(self, **extra: AttributeValue) -> dict[str, AttributeValue]:
        """What a span of an operation on it carries: the lock's name, the instance, the mode held, ``extra``."""
        return {LOCK_NAME: self.lock_name, INSTANCE_ID: self.instance_id, **self.events.span_mode(), **extra}

    def describe(self, verb: str) -> str:
        return f"{verb} of {self.kind} {self.lock_name!r} (instance_id {self.instance_id!r})"

    def still_busy(self, holder: str | None, held: int | None, waited: float) -> str:
        """Why a blocking acquire timed out, in the words of what this is (its kind's)."""
        return self.kind.still_busy(self.lock_name, holder, held, waited)

    def not_held_error(self, reason: str) -> LockNotHeldError:
        said = self.kind.not_held(self.lock_name, self.instance_id)
        return LockNotHeldError(
            f"{said}: {reason}",
            lock_name=self.lock_name,
            instance_id=self.instance_id,
            reason=reason,
        )

    # -- transitions (each under the client's state lock) ---------------------

    def begin_acquire(self, acquirer: object) -> int:
        """Start an acquire for ``acquirer``; returns its generation, superseding earlier clean-ups.

        Raises `LockAlreadyHeldError`. ``acquirer`` names the acquire, whatever
        becomes of the returned value: an exception can land before the caller
        stores it, and the caller still ends its own acquire, and only its own.
        """
        with self._lock:
            if self.phase is not Phase.IDLE:
                raise LockAlreadyHeldError(self.kind.already_held(self.lock_name, self.instance_id))
            self.phase = Phase.ACQUIRING
            self.generation += 1
            self.acquirer = acquirer
            return self.generation

    def attempt_sent(self) -> bool:
        """An acquire's statement goes now: until a reply says otherwise it may leave a stray row (an
        interruption must clean up too). Returns whether a stray row was possible before it."""
        with self._lock:
            before = self.stray_row_possible
            self.stray_row_possible = True
            return before

    def in_line(self) -> None:
        """A fair lock's waiter is queued (`LockKind.queues`): a release may hand it a row of ours at any time,
        so an acquire that ends without the lock leaves the line as it deletes a stray row."""
        with self._lock:
            self.stray_row_possible = True

    def attempt_unanswered(self, statement_timeout: float) -> None:
        """No reply came: the statement may run on the server, and land, for up to twice its timeout."""
        with self._lock:
            self.stray_row_may_land_until = max(self.stray_row_may_land_until, now() + 2 * statement_timeout)

    def attempt_refused(self, possible_before: bool) -> None:
        """The server answered with an error: the statement did nothing, nothing new may stray."""
        with self._lock:
            self.stray_row_possible = possible_before

    def attempt_contended(self, holder: str | None) -> None:
        """The statement ran and the row is ``holder``'s: nothing of ours is in the table, unless an
        unanswered attempt lands later."""
        with self._lock:
            self.stray_row_possible = now() < self.stray_row_may_land_until
            self.last_holder = holder

    def stray_row_cleaned(self, generation: int) -> None:
        """A clean-up of ``generation`` deleted any stray row once none could land any more."""
        with self._lock:
            if generation == self.generation:
                self.stray_row_possible = False

    def abort_acquire(self, acquirer: object) -> None:
        """``acquirer``'s acquire ended without the lock (a later acquire's is left alone)."""
        with self._lock:
            if self.phase is Phase.ACQUIRING and self.acquirer is acquirer:
                self.phase = Phase.IDLE

    def abandon_acquire(self, acquirer: object) -> tuple[int, Hold | None, bool] | None:
        """``acquirer``'s acquire ended by an exception before its caller got the hold: undo it.

        Whatever the acquire had reached (a statement sent, a hold won, renewed
        or not), nothing of it stays: the phase is idle again, and a hold it
        won is ended (no heartbeat renews it), its row now a stray row for the
        background to delete. Returns the acquire's generation, the hold it
        ended (for the caller to stop renewing) and whether a stray row may be
        in the table; None for an acquire that already ended, or another's
        (so it is safe to call twice).
        """
        with self._lock:
            if self.acquirer is not acquirer or self.phase not in (Phase.ACQUIRING, Phase.HOLDING):
                return None
            hold = self.hold
            if hold is None or hold.generation != self.generation or hold.status is not HoldStatus.HELD:
                hold = None
            else:
                hold.status = HoldStatus.ENDED
                hold.reason = INTERRUPTED
                self.stray_row_possible = True
            self.phase = Phase.IDLE
            return self.generation, hold, self.stray_row_possible

    def won(
        self,
        *,
        acquired_at: datetime,
        token: int | None,
        sent_at: float,
        owner: object,
        span_context: SpanContext | None,
        row_name: str | None = None,
        plain: bool = False,
    ) -> Hold:
        with self._lock:
            hold = Hold(self, acquired_at, token, sent_at, owner, span_context, row_name, plain)
            self.hold = hold
            self.phase = Phase.HOLDING
            self.stray_row_possible = False
            return hold

    def lose(self, hold: Hold, reason: str, *, only_if_expired: bool = False) -> LockNotHeldError | None:
        """Mark ``hold`` lost, once; returns the error to report, or None if it was not held any more.

        ``only_if_expired``: only if its lease has run out (a heartbeat may have renewed it meanwhile).
        """
        with self._lock:
            if hold.status is not HoldStatus.HELD:
                return None
            if only_if_expired and now() < hold.lease_deadline:
                return None
            hold.status = HoldStatus.LOST
            hold.reason = reason
            return hold.error()

    def renew(self, hold: Hold, sent_at: float) -> float | None:
        """Extend the lease after a heartbeat sent at ``sent_at`` landed. Returns None if the hold is no longer
        held; else how long it had been in doubt, if its doubt was told (0.0 if it was not in doubt)."""
        with self._lock:
            if hold.status is not HoldStatus.HELD or now() >= hold.lease_deadline:
                return None
            current = now()
            doubted_since = hold.doubt_deadline
            hold.renewed_at = max(hold.renewed_at, sent_at)
            hold.lease_deadline = max(hold.lease_deadline, sent_at + self.timing.lease)
            doubt = self.timing.doubt
            if doubt is not None:
                hold.doubt_deadline = max(hold.doubt_deadline, sent_at + doubt)
            # A heartbeat sent before a freeze, answered after it, may leave the hold in doubt still.
            confirmed = 0.0
            if hold.doubt_told and current < hold.doubt_deadline:
                hold.doubt_told = False
                confirmed = max(current - doubted_since, 0.0)
            if current < hold.running_out_at():
                hold.running_out_told = False
            return confirmed

    def tell_doubt(self, hold: Hold) -> bool:
        """Whether ``hold`` turned in doubt and that is yet to be told (once, until a heartbeat confirms it)."""
        with self._lock:
            if hold.doubt_told or not hold.in_doubt:
                return False
            hold.doubt_told = True
            return True

    def tell_running_out(self, hold: Hold) -> float | None:
        """Seconds left, if two thirds of ``hold``'s trust ran out without a heartbeat and that is yet to be told."""
        with self._lock:
            current = now()
            if hold.running_out_told or hold.status is not HoldStatus.HELD or current < hold.running_out_at():
                return None
            hold.running_out_told = True
            return max(0.0, hold.trusted_until - current)

    def require_held(self) -> Hold:
        """The current hold, if held; else raise `LockNotHeldError` saying why."""
        with self._lock:
            hold = self.hold
            if self.phase is Phase.HOLDING and hold is not None:
                if hold.held:
                    return hold
                if hold.in_doubt:
                    reason = IN_DOUBT
                else:
                    reason = hold.reason or (LEASE_EXPIRED if hold.status is HoldStatus.HELD else NOT_HELD)
            else:
                reason = hold.reason if hold is not None and hold.reason else NOT_HELD
        raise self.not_held_error(reason)

    def require_renewable(self) -> Hold:
        """The current hold if a heartbeat may still renew it (held, or in doubt); else raise as `require_held`."""
        with self._lock:
            hold = self.hold
            if self.phase is Phase.HOLDING and hold is not None and hold.in_doubt:
                return hold
        return self.require_held()

    def begin_release(self, caller: object, releaser: object) -> Hold | None:
        """Stop holding: the hold is no longer renewed. Returns it (None if there was none).

        A release from another thread or task than the one that acquired is
        recorded on the hold, so the block holding it learns it ran unlocked.
        ``releaser`` names the release, for `end_release`.
        """
        with self._lock:
            hold = self.hold
            if self.phase is not Phase.HOLDING or hold is None:
                return None
            self.phase = Phase.RELEASING
            self.releaser = releaser
            # A hold whose lease ran out stays HELD: the release reports it lost, once.
            if hold.status is HoldStatus.HELD and now() < hold.lease_deadline:
                hold.status = HoldStatus.ENDED
                if caller is not hold.owner:
                    hold.reason = RELEASED_ELSEWHERE
            return hold

    def released_and_woke(self, woke: str | None, sent_at: float) -> None:
        """A release sent at ``sent_at`` deleted the row and notified ``woke``: a slot's channel if it woke a
        waiting process other than this one, which this Mutex's next blocking acquire then lets go first.

        Only where the lock has one hold (a Mutex, a Semaphore of one permit): with more, the hold freed is
        the woken waiter's while another may be free for this one, which would wait for nothing (a Semaphore
        of 3 permits looped on by 4 processes changed hands at less than half its rate)."""
        woke_another = woke and woke != self.channel and self.kind.single_hold
        self.gave_way_at = sent_at if woke_another else None

    def row_gone(self, hold: Hold) -> LockNotHeldError:
        """A release found ``hold``'s row deleted or taken over: the error that says so."""
        with self._lock:
            hold.reason = ROW_GONE
        return hold.error()

    def end_release(self, releaser: object) -> Hold | None:
        """``releaser``'s release is over; returns the hold it began to release (None if it began none).

        The hold stays readable (`require_held` says how it ended) until the next acquire.
        """
        with self._lock:
            if self.phase is not Phase.RELEASING or self.releaser is not releaser:
                return None
            self.phase = Phase.IDLE
            self.releaser = None
            return self.hold

    # -- a stray row's clean-up on the wire: its turn ----------------------------------

    def take_cleanup_turn(self, generation: int, sender: object, seconds: float) -> bool:
        """A stray row's clean-up of ``generation`` goes on the wire now, bounded by ``seconds``: may it?

        Only if no acquire began since (it takes any row of ours back itself).
        Taken at the moment of sending, after any wait for the connection, so
        an acquire that begins later waits for this statement and no other.
        The turn ends when `give_back_cleanup_turn` says the reply came, or by
        itself once the statement can no longer land (twice its deadline: the
        client cuts it at one, the server's statement_timeout ends it before):
        a sender that vanished (an event loop that ended mid-statement, an
        exception raised before it could give the turn back) holds no acquire
        up for longer, and no thread lock is held across the statement.
        """
        with self._lock:
            if generation != self.generation:
                return False
            self.cleanup_sender = sender
            self._cleanup_until = now() + 2 * seconds
            return True

    def give_back_cleanup_turn(self, sender: object) -> None:
        """``sender``'s clean-up was answered: it can no longer cross an acquire."""
        with self._lock:
            if self.cleanup_sender is sender:
                self.cleanup_sender = None

    def cleanup_on_the_wire_until(self) -> float | None:
        """Until when a stray row's clean-up may still land (an acquire must not be sent before); None: none may."""
        with self._lock:
            if self.cleanup_sender is None:
                return None
            if now() >= self._cleanup_until:
                self.cleanup_sender = None
                return None
            return self._cleanup_until

    def reset_after_fork(self, instance_id: str, state_lock: StateLock) -> None:
        """In a forked child: nothing inherited is held by this process."""
        self._lock = state_lock
        self.phase = Phase.IDLE
        self.hold = None
        self.stray_row_possible = False
        self.instance_id = instance_id  # a read/write lock's row_name follows it
        self.engine = self.async_engine = None  # the parent's: an acquire resolves the child's own
        self._name_itself()
        self.events.instance_id = instance_id
        self.alert_gate = type(self.alert_gate)(self.timing.alert_threshold)  # a watcher's to alert, if it was
        self.cleanup_sender = None


Facts = tuple[float, float, float, bool]
"""What the heartbeat reads of a hold, fixed for the hold's life (`_state.heartbeat_flows.facts`): its
``operation_timeout``, how often its row's own heartbeat is renewed while it follows its group's lease (-1: it may
not follow one), its ``stale_threshold``, and whether its heartbeats are told to nobody (`LockEvents.quiet`)."""


class HeartbeatGroup:
    """The holds of one engine on one table that share a heartbeat interval: renewed by one statement."""

    __slots__ = ("counts", "holds", "interval", "key", "next_beat", "quiet_retry", "tracing")

    def __init__(self, key: object, interval: float, tracing: Tracing) -> None:
        self.key = key
        self.interval = interval
        self.tracing = tracing
        self.holds: dict[Hold, Facts] = {}
        """Its holds, in the order they were kept, each with what the heartbeat reads of it
        (`_state.heartbeat_flows.facts`); changed by `add` and `discard` alone, under the state lock."""
        self.counts: dict[Facts, int] = {}
        """How many of `holds` have each `Facts`: what a heartbeat round reads of them all, in a few entries
        rather than a pass over thousands of holds (`_state.heartbeat_flows.fit`)."""
        self.next_beat = now() + interval
        self.quiet_retry = False
        """The last heartbeat failed on a connection the server had closed while idle, and was retried at once."""

    def add(self, hold: Hold, facts: Facts) -> None:
        if hold not in self.holds:
            self.holds[hold] = facts
            self.counts[facts] = self.counts.get(facts, 0) + 1

    def discard(self, hold: Hold) -> None:
        facts = self.holds.pop(hold, None)
        if facts is not None:
            left = self.counts[facts] - 1
            if left:
                self.counts[facts] = left
            else:
                del self.counts[facts]

    def live(self) -> list[Hold]:
        return [hold for hold in self.holds if hold.status is HoldStatus.HELD and not hold.paused]
