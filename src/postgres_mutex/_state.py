"""The holder's view of one lock: held, lost, and the local lease.

Thread-safe and free of I/O. The sync path (caller plus heartbeat thread) and
the async path (caller plus heartbeat task) both drive the same `LockState`.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime

from opentelemetry.trace import SpanContext

from ._metrics import MetricsDispatch
from ._rules import AlertGate
from ._settings import Timing
from ._watchdog import Timer
from .errors import LockAlreadyHeldError, LockNotHeldError

logger = logging.getLogger("postgres_mutex")

LostCallback = Callable[[LockNotHeldError], object]


class CleanupGuard:
    """Keeps a delete-any-row-of-ours statement from racing a new acquire of the same Mutex.

    Such a clean-up (of a row an unanswered statement left) is scoped by
    instance_id alone, so if it reached the server after a new acquire it
    would delete the new hold. Each acquire supersedes the clean-ups begun
    before it and waits for one in flight; a superseded clean-up never sends.
    """

    def __init__(self, lock: threading.Lock, epoch: int, current: Callable[[], int]) -> None:
        self.lock = lock
        self.epoch = epoch
        self._current = current

    @property
    def superseded(self) -> bool:
        return self._current() != self.epoch


LEASE_EXPIRED = "its lease ran out: no heartbeat succeeded for stale_threshold - heartbeat_interval"
ROW_GONE = "its row was deleted or taken over by another instance"

# The lease clock counts time the machine spends suspended (CLOCK_BOOTTIME on
# Linux): a holder frozen across a suspend must not wake up believing in a
# lease the server's clock has long run past.
_LEASE_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def lease_clock() -> float:
    """Seconds on the clock leases are measured with (never the wall clock)."""
    return time.clock_gettime(_LEASE_CLOCK)


class Status(enum.Enum):
    IDLE = "idle"
    ACQUIRING = "acquiring"
    HELD = "held"
    LOST = "lost"
    RELEASING = "releasing"


class LockState:
    """Status, lease and loss bookkeeping for one (lock_name, instance_id).

    The lease is measured from the moment the last successful acquire or
    heartbeat statement was *sent*; it is one heartbeat interval shorter than
    ``stale_threshold``, so the holder always learns it lost the lock before
    anyone else may reclaim the row.

    Each hold is identified by the ``acquired_at`` the server stamped on its
    row (the *token*): heartbeats and releases are scoped to it, so a
    statement of an earlier hold that arrives late can never touch a later one.
    """

    def __init__(
        self,
        *,
        lock_name: str,
        instance_id: str,
        timing: Timing,
        metrics: MetricsDispatch,
        on_lost: LostCallback | None,
    ) -> None:
        self.lock_name = lock_name
        self.instance_id = instance_id
        self.timing = timing
        self.metrics = metrics
        self.alert_gate = AlertGate(timing.alert_threshold)
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._status = Status.IDLE
        self._lease_deadline = 0.0
        self._lease_timer: Timer | None = None
        self._generation = 0
        self._token: datetime | None = None
        self._lost_reason = ""
        # Who held the lock at this Mutex's last contended attempt, for messages.
        self.last_holder: str | None = None
        # The span of the acquire that began the current hold: heartbeats link to it.
        self.hold_span_context: SpanContext | None = None
        self._cleanup_lock = threading.Lock()
        self._cleanup_epoch = 0
        # A statement that may have inserted our row went unanswered (or was
        # interrupted): the row may exist. The next acquire takes it back;
        # giving up, closing and exiting remove it.
        self.orphan_suspected = False

    # -- queries ---------------------------------------------------------

    @property
    def status(self) -> Status:
        return self._status

    @property
    def held(self) -> bool:
        return self._status is Status.HELD and lease_clock() < self._lease_deadline

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def token(self) -> datetime | None:
        """The current (or last) hold's ``acquired_at``."""
        return self._token

    @property
    def lease_deadline(self) -> float:
        return self._lease_deadline

    @property
    def may_have_row(self) -> bool:
        """Whether a row of ours may be in the table, so exit and close must try to delete it."""
        return self._status in (Status.HELD, Status.LOST, Status.RELEASING) or self.orphan_suspected

    def is_current(self, generation: int) -> bool:
        return self._status is Status.HELD and self._generation == generation

    # -- transitions -------------------------------------------------------

    def cleanup_guard(self) -> CleanupGuard:
        """A guard for a clean-up beginning now: superseded by any later acquire."""
        return CleanupGuard(self._cleanup_lock, self._cleanup_epoch, lambda: self._cleanup_epoch)

    def supersede_cleanups(self) -> threading.Lock:
        """Before an acquire: no clean-up begun earlier may send; returns the lock one in flight holds."""
        self._cleanup_epoch += 1
        return self._cleanup_lock

    def orphan_cleaned(self, guard: CleanupGuard) -> None:
        """A clean-up ran: nothing of ours is left, unless an acquire began since (it may leave a new one)."""
        with guard.lock:
            if not guard.superseded:
                self.orphan_suspected = False

    def begin_acquire(self) -> None:
        self.check_lease()
        with self._lock:
            if self._status in (Status.HELD, Status.ACQUIRING, Status.RELEASING):
                raise LockAlreadyHeldError(
                    f"this Mutex already holds or is acquiring lock {self.lock_name!r} "
                    f"(instance_id {self.instance_id!r}); use a separate Mutex per concurrent holder"
                )
            self._status = Status.ACQUIRING

    def abort_acquire(self) -> None:
        with self._lock:
            if self._status is Status.ACQUIRING:
                self._status = Status.IDLE

    def acquired(self, sent_at: float, token: datetime) -> int:
        """Record a won acquire whose statement was sent at ``sent_at``; returns the hold's generation."""
        with self._lock:
            self._generation += 1
            self._status = Status.HELD
            self._lease_deadline = sent_at + self.timing.lease
            self._token = token
            self._lost_reason = ""
            self.orphan_suspected = False
            self._arm_lease_timer()
            return self._generation

    def renewed(self, generation: int, sent_at: float) -> bool:
        """Extend the lease after a heartbeat sent at ``sent_at`` succeeded."""
        with self._lock:
            if self._status is not Status.HELD or self._generation != generation:
                return False
            self._lease_deadline = max(self._lease_deadline, sent_at + self.timing.lease)
            self._arm_lease_timer()
            return True

    def _arm_lease_timer(self) -> None:
        # The loss is declared when the lease runs out, whatever the heartbeat
        # is doing (it may be stuck connecting): on_lost and the metrics call
        # then come before anyone else may reclaim the row.
        if self._lease_timer is not None:
            self._lease_timer.cancel()
        self._lease_timer = Timer(max(0.0, self._lease_deadline - lease_clock()), self.check_lease)

    def _cancel_lease_timer(self) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None

    def require_held(self) -> int:
        """Return the current generation, or raise `LockNotHeldError` (marking a run-out lease lost)."""
        self.check_lease()
        with self._lock:
            if self._status is Status.HELD:
                return self._generation
            raise self._not_held_error()

    def check_lease(self) -> None:
        """Mark the lock lost if its lease has run out."""
        if self._status is Status.HELD and lease_clock() >= self._lease_deadline:
            self.lose(LEASE_EXPIRED, only_if_expired=True)

    def lose(
        self, reason: str, generation: int | None = None, *, only_if_expired: bool = False
    ) -> LockNotHeldError | None:
        """Mark a held lock lost, once; fire ``on_lost`` and the metrics call.

        Returns the error describing the loss, or None if the lock was not held
        (already lost, being released, or a newer hold than ``generation``), or
        if ``only_if_expired`` and a heartbeat renewed the lease meanwhile.
        """
        with self._lock:
            if self._status is not Status.HELD or (generation is not None and generation != self._generation):
                return None
            if only_if_expired and lease_clock() < self._lease_deadline:
                return None
            self._status = Status.LOST
            self._lost_reason = reason
            self._cancel_lease_timer()
            error = self._not_held_error()
        self._report_lost(error)
        return error

    def lost_while_releasing(self, reason: str) -> LockNotHeldError:
        """The release found the row gone although the lease was valid: report it like any loss."""
        with self._lock:
            self._lost_reason = reason
            error = self._not_held_error()
        self._report_lost(error)
        return error

    def _report_lost(self, error: LockNotHeldError) -> None:
        logger.error("lost lock %r (instance_id %r): %s", self.lock_name, self.instance_id, error.reason)
        self.metrics("lost", self.lock_name, instance_id=self.instance_id, reason=error.reason)
        if self._on_lost is not None:
            try:
                self._on_lost(error)
            except Exception:
                logger.warning("on_lost callback for lock %r raised; ignoring it", self.lock_name, exc_info=True)

    def begin_release(self) -> Status:
        """Stop treating the lock as held (the heartbeat stops renewing it); return the status it had.

        A lease that ran out is reported lost first.
        """
        self.check_lease()
        with self._lock:
            previous = self._status
            if previous in (Status.HELD, Status.LOST):
                self._status = Status.RELEASING
                self._cancel_lease_timer()
            return previous

    def released(self) -> None:
        with self._lock:
            if self._status is Status.RELEASING:
                self._status = Status.IDLE

    def reset_after_fork(self, instance_id: str) -> None:
        """In a forked child: nothing inherited is held by this process."""
        self._lock = threading.Lock()
        self._cleanup_lock = threading.Lock()
        self._status = Status.IDLE
        self._lease_deadline = 0.0
        self._lease_timer = None
        self._token = None
        self.orphan_suspected = False
        self.instance_id = instance_id
        self.alert_gate = AlertGate(self.timing.alert_threshold)

    def not_held_error(self, reason: str | None = None) -> LockNotHeldError:
        with self._lock:
            return self._not_held_error(reason)

    def _not_held_error(self, reason: str | None = None) -> LockNotHeldError:
        reason = reason or self._lost_reason or "this Mutex does not hold the lock"
        return LockNotHeldError(
            f"lock {self.lock_name!r} is not held by instance {self.instance_id!r}: {reason}",
            lock_name=self.lock_name,
            instance_id=self.instance_id,
            reason=reason,
        )
