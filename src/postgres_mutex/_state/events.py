"""Every lock event, reported in one place: the log line, the hook call and the span annotation.

The flows decide *that* something happened (acquired, contended, reclaimed,
lost, ...); `LockEvents` decides how it is told. Nothing else in the library
logs a lock event, calls the metrics hook for one, or annotates a span with
one, so each is reported once, the same way, whichever path saw it.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Sequence
from typing import TypedDict

from opentelemetry.trace import Span

from .._observe.hooks import ExtendedMetricsHook, LockObservation, silent
from .._observe.tracing import MODE, NO_SPAN, OUTCOME, PERMIT, AttributeValue, mark_error, set_outcome
from ..errors import LockNotHeldError
from ..metric_names import RECLAIM_REASONS
from .kind import MUTEX, LockKind
from .outcome import AcquireResult, Outcome

logger = logging.getLogger("postgres_mutex")

_ACQUIRED = Outcome.ACQUIRED

LostCallback = Callable[[LockNotHeldError], object]

STALE, DISCONNECTED = RECLAIM_REASONS
"""Why a row was taken over from another instance: silent past ``stale_threshold``; or its holder opted in
to ``reclaim_disconnected_after``, its database session had ended and its heartbeat was older than that."""


def reclaim_reason(result: AcquireResult, stale_threshold: float) -> str:
    """Why ``result`` (a reclaim) took the row: a heartbeat younger than ``stale_threshold`` in the statement's
    snapshot can only have been reclaimed for a disconnected session (a row only gets younger meanwhile)."""
    age = result.heartbeat_age
    return DISCONNECTED if age is not None and age < stale_threshold else STALE


def noun_of(seen: LockObservation) -> str:
    """What a row seen holds, in the words messages use (`LockKind.noun`): a lock, a semaphore, a read/write lock."""
    if seen.mode is not None:
        return "read/write lock"
    return "lock" if seen.semaphore is None else "semaphore"


class ModeKeyword(TypedDict, total=False):
    mode: str


def mode_keyword(mode: str | None) -> ModeKeyword:
    """``mode=`` for the hook calls about a read/write lock's holder only: hooks of any other lock get the
    calls they always got (the README's), to the keyword."""
    return {} if mode is None else {"mode": mode}


def describe(noun: str, name: str, *, permit: int | None = None, mode: str | None = None) -> str:
    """What is held, as log lines name it: ``lock 'job'``, ``semaphore 'api' (permit 2)``,
    ``read/write lock 'catalogue' (read)``; never a row's name, with its separator."""
    said = f"{noun} {name!r}"
    if permit is not None:
        return f"{said} (permit {permit})"
    return said if mode is None else f"{said} ({mode})"


class LockEvents:
    """How the events of one lock, held by one instance, are reported.

    A semaphore's or read/write lock's events are told under its own name, in its own words (`describe`),
    with the permit its hold took or the mode it holds.
    """

    __slots__ = (
        "alert_threshold",
        "hook",
        "instance_id",
        "kind",
        "lock_name",
        "on_doubt",
        "on_lost",
        "permit",
        "quiet",
        "stale_threshold",
        "told_unnamed",
    )

    def __init__(
        self,
        *,
        lock_name: str,
        instance_id: str,
        hook: ExtendedMetricsHook,
        on_lost: LostCallback | None,
        alert_threshold: float,
        stale_threshold: float,
        kind: LockKind = MUTEX,
    ) -> None:
        self.lock_name = lock_name
        self.kind = kind
        self.permit: int | None = None
        """The permit the semaphore's last hold took (its row's number), for log lines."""
        self.instance_id = instance_id
        self.hook = hook
        self.quiet = silent(hook)
        """No hook listens: an event told on no span (`NO_SPAN`) and logged at DEBUG alone may be skipped
        whole when DEBUG is off (an uncontended cycle's acquired, acquire_ended and released)."""
        self.on_lost = on_lost
        self.alert_threshold = alert_threshold
        self.stale_threshold = stale_threshold
        self.on_doubt: Callable[[], object] | None = None
        """What an `Election` does when its leader's hold turns in doubt: the term ends (set by the election)."""
        self.told_unnamed = False

    @property
    def what(self) -> str:
        return describe(self.kind.noun, self.lock_name, permit=self.permit, mode=self.kind.mode)

    def span_mode(self) -> dict[str, AttributeValue]:
        """The span attribute of a read/write lock's holder: its mode (none for any other)."""
        mode = self.kind.mode
        return {} if mode is None else {MODE: mode}

    # -- acquiring -------------------------------------------------------------

    def sessions_unnamed(self, table: str) -> None:
        """``reclaim_disconnected_after`` on a table without the session columns: said once per Mutex."""
        if not self.told_unnamed:
            self.told_unnamed = True
            logger.warning(
                "%s: the lock table %s has no session columns, so reclaim_disconnected_after cannot name "
                "this holder's session: it is not reclaimed early. Run LockTable.migrate() (or 'postgres-mutex "
                "migrate') to add them",
                self.what,
                table,
            )

    def attempt_failed(self, span: Span, error: BaseException, *, retrying_in: float | None) -> None:
        """One attempt of an acquire failed; it is retried after ``retrying_in`` seconds (None: not retried)."""
        _event(span, "error", error=type(error).__name__)
        if retrying_in is not None:
            logger.warning("%s; retrying in %.3gs", error, retrying_in)

    def acquired(self, span: Span, result: AcquireResult, *, expected_own_row: bool, row: str | None = None) -> None:
        """Acquired; ``row``: the ``lock_name`` of the row won, whose number is a semaphore's permit."""
        if row is not None:
            self.permit = self.kind.permit_of(row)
        if self.quiet and span is NO_SPAN and result.outcome is _ACQUIRED and not logger.isEnabledFor(logging.DEBUG):
            return  # nobody listens: the hook is a no-op, no span records, the log line would be dropped
        _event(span, result.outcome.value, holder=result.holder, token=result.token)
        if result.outcome is Outcome.RECLAIMED:
            assert result.holder is not None
            reason = reclaim_reason(result, self.stale_threshold)
            if reason == DISCONNECTED:
                logger.warning(
                    "reclaimed %s from %r, whose database session had ended, silent for %.1fs "
                    "(its reclaim_disconnected_after)",
                    self.what,
                    result.holder,
                    result.heartbeat_age or 0.0,
                )
            else:
                logger.warning(
                    "reclaimed %s from %r, silent for %.1fs (stale_threshold %gs)",
                    self.what,
                    result.holder,
                    result.heartbeat_age or 0.0,
                    self.stale_threshold,
                )
            _event(span, "reclaim_reason", name="postgres_mutex.reclaim", reason=reason)
            self.hook.stale_reclaimed(
                self.lock_name,
                instance_id=self.instance_id,
                previous_holder=result.holder,
                token=result.token,
                reason=reason,
                # The mode of the hold taken over, as the reply names it: a writer takes over dead readers.
                **mode_keyword(None if self.kind.mode is None else result.holder_mode or self.kind.mode),
            )
        elif result.outcome is Outcome.REACQUIRED and not expected_own_row:
            logger.warning(
                "%s already carried this %s's instance_id %r; took it back. "
                "A restarted process reusing its id, or an id shared by two live processes?",
                self.what,
                self.kind.holder_type,
                self.instance_id,
            )
        elif logger.isEnabledFor(logging.DEBUG):  # `what` is made for the record alone
            logger.debug("acquired %s (instance_id %r)", self.what, self.instance_id)
        if span.is_recording() and result.token is not None:
            span.set_attribute("postgres_mutex.token", result.token)
        if span.is_recording() and self.permit is not None:
            span.set_attribute(PERMIT, self.permit)
        self.hook.acquired(self.lock_name, instance_id=self.instance_id, token=result.token)

    def contended(self, span: Span, result: AcquireResult, *, alert: bool) -> None:
        """The lock is held elsewhere; ``alert``: its holder went silent past the alert threshold (once per episode)."""
        _event(span, "contended", holder=result.holder, heartbeat_age=result.heartbeat_age)
        self.hook.contended(self.lock_name, instance_id=self.instance_id)
        if alert:
            assert result.holder is not None
            assert result.heartbeat_age is not None
            self.alert(result.holder, result.heartbeat_age, span, mode=result.holder_mode)

    def waiting(self) -> None:
        """A blocking acquire waits for a release (the waiters gauge counts it until `stopped_waiting`)."""
        self.hook.waiting(self.lock_name, instance_id=self.instance_id, **mode_keyword(self.kind.mode))

    def stopped_waiting(self) -> None:
        self.hook.stopped_waiting(self.lock_name, instance_id=self.instance_id, **mode_keyword(self.kind.mode))

    def alert(
        self, holder: str, seconds_since_heartbeat: float, span: Span | None = None, *, mode: str | None = None
    ) -> None:
        """A contender found ``holder`` silent; ``mode``: the mode it holds, for a read/write lock."""
        if span is not None:
            _event(span, "alert", holder=holder, heartbeat_age=seconds_since_heartbeat, name="postgres_mutex.alert")
        what = describe(self.kind.noun, self.lock_name, mode=mode)
        report_alert(self.hook, what, self.lock_name, holder, seconds_since_heartbeat, self.alert_threshold, mode)

    def acquire_ended(self, span: Span, outcome: str, *, attempts: int, waited: float, holder: str | None) -> None:
        """How a whole acquire ended: acquired, reclaimed, contended, timeout, error or cancelled."""
        if self.quiet and span is NO_SPAN:
            return  # nothing to record it on, nobody to tell
        set_outcome(
            span,
            outcome,
            attempts=attempts,
            wait_seconds=waited,
            previous_holder=holder if outcome == "reclaimed" else None,
            holder=holder if outcome in ("contended", "timeout") else None,
        )
        if outcome != "cancelled":
            self.hook.acquire_wait(self.lock_name, instance_id=self.instance_id, seconds=waited, outcome=outcome)

    # -- holding ---------------------------------------------------------------

    def heartbeat_renewed(self, latency: float) -> None:
        self.hook.heartbeat_latency(self.lock_name, instance_id=self.instance_id, seconds=latency)

    def heartbeat_failed(self, error: BaseException, *, log: bool = True) -> None:
        """A heartbeat failed; ``log`` is False for all but one of the locks a failed statement carried."""
        if log:
            logger.warning("%s; retrying until the lease runs out", error)
        self.hook.heartbeat_failed(self.lock_name, instance_id=self.instance_id, error=error)

    def running_out(self, seconds_left: float) -> None:
        """Two thirds of the time the hold is trusted went by without a successful heartbeat."""
        logger.warning(
            "%s (instance_id %r): no heartbeat has succeeded for two thirds of the time the hold is trusted "
            "without one; %.1fs left",
            self.what,
            self.instance_id,
            seconds_left,
        )
        self.hook.lease_running_out(self.lock_name, instance_id=self.instance_id, seconds_left=seconds_left)

    def in_doubt(self) -> None:
        """The hold turned in doubt (see `_state.locks`): not held until a heartbeat confirms it, or finds it lost.

        Told first, then logged: the notice never waits on a log handler.
        """
        if self.on_doubt is not None:
            self.on_doubt()
        self.hook.hold_in_doubt(self.lock_name, instance_id=self.instance_id)
        logger.warning(
            "%s (instance_id %r): %s",
            self.what,
            self.instance_id,
            "hold in doubt: not held until a "
            "heartbeat confirms it (another instance may reclaim it if this process's database session ended)",
        )

    def confirmed(self, seconds: float) -> None:
        """A heartbeat found the row of a hold in doubt still this holder's: held again."""
        logger.warning(
            "%s (instance_id %r): a heartbeat confirmed the hold after %.1fs in doubt; held again",
            self.what,
            self.instance_id,
            seconds,
        )
        self.hook.hold_confirmed(self.lock_name, instance_id=self.instance_id, seconds_in_doubt=seconds)

    def lost(self, error: LockNotHeldError) -> None:
        """Called once per loss, from the client's event thread (never from the heartbeat): told, then recorded."""
        self.tell_lost(error)
        self.record_lost(error)

    def tell_lost(self, error: LockNotHeldError) -> None:
        """``on_lost``: the holder's notice, before the loss is logged or counted (it waits on neither)."""
        if self.on_lost is not None:
            try:
                self.on_lost(error)
            except Exception:
                logger.warning("on_lost callback for %s raised; ignoring it", self.what, exc_info=True)

    def record_lost(self, error: LockNotHeldError) -> None:
        """The hook's ``lost`` call and the ERROR line."""
        self.hook.lost(self.lock_name, instance_id=self.instance_id, reason=error.reason)
        logger.error("lost %s (instance_id %r): %s", self.what, self.instance_id, error.reason)

    # -- releasing -------------------------------------------------------------

    def released(self, span: Span, *, deleted: bool) -> None:
        if self.quiet and span is NO_SPAN and not logger.isEnabledFor(logging.DEBUG):
            return  # nobody listens (see `acquired`)
        set_outcome(span, "released" if deleted else "not_found")
        if deleted:
            if logger.isEnabledFor(logging.DEBUG):  # `what` is made for the record alone
                logger.debug("released %s (instance_id %r)", self.what, self.instance_id)
            self.hook.released(self.lock_name, instance_id=self.instance_id)

    def released_after_loss(self, span: Span) -> None:
        set_outcome(span, "lost")
        mark_error(span, "the lock had been lost before it was released")

    def release_failed(self, error: BaseException, *, was_held: bool) -> None:
        logger.warning("%s", error)
        if was_held:
            self.hook.release_failed(self.lock_name, instance_id=self.instance_id, error=error)

    def abandoned(self) -> None:
        """A hold was won by an acquire interrupted before it returned: it ended there, its row goes."""
        logger.info(
            "%s: the acquire that won it was interrupted before it returned; its row is deleted in the background",
            self.what,
        )
        self.hook.released(self.lock_name, instance_id=self.instance_id)

    def row_removed(self) -> None:
        logger.info("%s: removed the row an unanswered statement may have left", self.what)

    def row_may_remain(self, error: BaseException) -> None:
        logger.debug("%s; trying again in the background", error)


def report_alert(
    hook: ExtendedMetricsHook,
    what: str,
    lock_name: str,
    holder: str,
    seconds_since_heartbeat: float,
    alert_threshold: float,
    mode: str | None = None,
) -> None:
    """A holder silent past the alert threshold, seen by a contender or a watcher: once per episode.

    ``what`` names it in the log line (`describe`); ``lock_name`` and ``mode`` label it for the hook.
    """
    logger.warning(
        "%s: holder %r has not heartbeated for %.1fs (alert_threshold %gs)",
        what,
        holder,
        seconds_since_heartbeat,
        alert_threshold,
    )
    hook.alert(lock_name, holder=holder, seconds_since_heartbeat=seconds_since_heartbeat, **mode_keyword(mode))


class WatcherEvents:
    """How a stale-holder watcher's events are reported."""

    def __init__(
        self,
        hook: ExtendedMetricsHook,
        *,
        watched: frozenset[str] | None,
        alert_threshold: float,
        stale_threshold: float,
    ) -> None:
        self.hook = hook
        self.watched = watched
        self.alert_threshold = alert_threshold
        self.stale_threshold = stale_threshold

    def alert(self, seen: LockObservation) -> None:
        """``seen``'s holder is silent: told under the name users gave (a semaphore's or read/write lock's,
        not its row's), with its permit or mode."""
        what = describe(noun_of(seen), seen.name, permit=seen.permit, mode=seen.mode)
        report_alert(
            self.hook, what, seen.name, seen.holder, seen.seconds_since_heartbeat, self.alert_threshold, seen.mode
        )

    def observed(self, observations: Sequence[LockObservation]) -> None:
        self.hook.observed(
            observations,
            watched=self.watched,
            alert_threshold=self.alert_threshold,
            stale_threshold=self.stale_threshold,
        )

    def failed(self, error: BaseException) -> None:
        logger.warning("%s; the watcher keeps trying", error)
        self.hook.watcher_failed(error=error)

    def stopped(self) -> None:
        self.hook.watcher_stopped(watched=self.watched)


class ElectionEvents:
    """How the events of one candidate in one election are reported: log line, hook call, span annotation.

    A term is one span, ``postgres_mutex.election.term``, current while
    ``lead`` runs (its own spans are the term's children); how the term was
    told to end, an overrun of the grace period and a failure of ``lead`` are
    events on it, and how it ended is its outcome.
    """

    __slots__ = ("grace_period", "hook", "instance_id", "lock_name")

    def __init__(self, *, lock_name: str, instance_id: str, hook: ExtendedMetricsHook, grace_period: float) -> None:
        self.lock_name = lock_name
        self.instance_id = instance_id
        self.hook = hook
        self.grace_period = grace_period

    def started(self) -> None:
        logger.info("campaigning in election %r (instance_id %r)", self.lock_name, self.instance_id)
        self.hook.election_started(self.lock_name, instance_id=self.instance_id)

    def stopped(self) -> None:
        logger.info("stopped campaigning in election %r (instance_id %r)", self.lock_name, self.instance_id)
        self.hook.election_stopped(self.lock_name, instance_id=self.instance_id)

    def term_began(self, span: Span, token: int | None) -> None:
        logger.info("leading election %r (instance_id %r, token %s)", self.lock_name, self.instance_id, token)
        if span.is_recording() and token is not None:
            span.set_attribute("postgres_mutex.token", token)
        self.hook.election_term_began(self.lock_name, instance_id=self.instance_id, token=token)

    def ending(self, span: Span, ending: str, reason: str) -> None:
        """``lead`` was told to stop leading: the term ends once it returns."""
        log = logger.warning if ending == "lost" else logger.info
        log("election %r: telling lead to stop leading: %s", self.lock_name, reason)
        _event(span, ending, name="postgres_mutex.election.ending", reason=reason)

    def grace_overrun(self, span: Span, seconds: float, reason: str) -> None:
        """``lead`` still runs ``grace_period`` after it was told to stop: said loudly, once per term."""
        logger.error(
            "election %r: lead is still running %.1fs after it was told to stop leading (%s), past grace_period "
            "(%gs); the lock is released only when it returns. A lead must watch leadership.ended (or call "
            "leadership.ensure_held()) and return promptly",
            self.lock_name,
            seconds,
            reason,
            self.grace_period,
        )
        _event(span, "grace_overrun", name="postgres_mutex.election.grace_overrun", seconds=seconds)
        mark_error(span, f"lead ran past grace_period ({self.grace_period:g}s) after it was told to stop leading")
        self.hook.election_grace_overrun(self.lock_name, instance_id=self.instance_id, seconds=seconds, reason=reason)

    def returned_late(self, seconds: float) -> None:
        logger.warning("election %r: lead returned %.1fs after it was told to stop leading", self.lock_name, seconds)

    def lead_failed(self, span: Span, error: BaseException, backoff: float) -> None:
        logger.error(
            "election %r: lead raised %s: %s; campaigning again in %.3gs",
            self.lock_name,
            type(error).__name__,
            error,
            backoff,
            exc_info=error,
        )
        _event(span, "failed", name="postgres_mutex.election.lead_failed", error=type(error).__name__)
        mark_error(span, f"lead raised {type(error).__name__}: {error}")
        self.hook.election_lead_failed(self.lock_name, instance_id=self.instance_id, error=error, backoff=backoff)

    def raised_after_end(self, error: BaseException) -> None:
        """``lead`` raised as its term ended (told to stop, or the lock lost): how it stopped, not a failure."""
        logger.info(
            "election %r: lead raised %s as its term ended (not counted as a failure): %s",
            self.lock_name,
            type(error).__name__,
            error,
        )

    def release_failed(self, error: BaseException) -> None:
        logger.warning("election %r: %s", self.lock_name, error)

    def term_ended(self, span: Span, ended: str, seconds: float, token: int | None) -> None:
        set_outcome(span, ended, term_seconds=seconds)
        logger.info("election %r: term with token %s ended (%s) after %.1fs", self.lock_name, token, ended, seconds)
        self.hook.election_term_ended(
            self.lock_name, instance_id=self.instance_id, ended=ended, seconds=seconds, token=token
        )


def _event(
    span: Span, outcome: str, *, name: str = "postgres_mutex.attempt", **attributes: AttributeValue | None
) -> None:
    if span.is_recording():
        values = {f"postgres_mutex.{key}": value for key, value in attributes.items() if value is not None}
        span.add_event(name, {OUTCOME: outcome, **values})


class Defects:
    """Unexpected failures of a background worker (each a defect): said loudly, once each.

    An ERROR with its traceback the first time a failure of its kind, message and place is met;
    past a few distinct ones, a worker failing in ever new ways says so at DEBUG only (the
    first ones show the defect). The worker itself goes on: a bug must not end the heartbeats
    or the wake-ups of every lock of the process.
    """

    LOGGED = 20

    def __init__(self, worker: str) -> None:
        self._worker = worker
        self._seen: set[tuple[str, str, str]] = set()

    def report(self, doing: str, exc: Exception, then: str) -> None:
        """``doing`` failed with ``exc``; ``then``: what the worker does next, in the log's words."""
        where = "".join(f"{frame.filename}:{frame.lineno}" for frame in traceback.extract_tb(exc.__traceback__)[-1:])
        key = (type(exc).__qualname__, str(exc), where)
        if key in self._seen or len(self._seen) >= self.LOGGED:
            logger.debug("postgres-mutex %s: %s failed again: %r", self._worker, doing, exc)
            return
        self._seen.add(key)
        logger.error(
            "postgres-mutex %s: %s failed unexpectedly; it goes on, %s (this error is logged once)",
            self._worker,
            doing,
            then,
            exc_info=exc,
        )
