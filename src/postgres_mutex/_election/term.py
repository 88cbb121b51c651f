"""A term of an election: its state (`Term`, the election's), its view (`Leadership`, ``lead``'s), and what follows it.

`Term` is what the election keeps of one term: the hold it leads with, how
and when it was told to end, whether ``lead`` has returned. `Leadership` is
the public face handed to ``lead``: the token, `Leadership.ended`, and the
checks (`Leadership.ensure_held`, `Leadership.fence`) that read the term and
never change it, but for a loss they are the first to find. `TermPolicy`
decides, with no I/O, how a term ended and how long to wait before the next
campaign, once for `Election.run` and `Election.run_async`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._base.acompat import Event
from .._base.clock import now
from .._state.locks import IN_DOUBT, LEASE_EXPIRED, HoldStatus
from ..errors import LockNotHeldError

if TYPE_CHECKING:
    import psycopg
    from opentelemetry.trace import Span

    from .._kinds.mutex import Mutex
    from .._state.locks import Hold, LockState


class Flag:
    """A flag like `threading.Event` that only the election sets: `is_set`, `wait`.

    A term's flag is also set by the clock: read or waited on once the term's
    lease has run out, it is set then, whether or not the loss was reported yet.
    Like every event of the term, it is one a signal handler's exception cannot
    wedge (`Event`): ``lead`` may be waiting on it when Ctrl-C or a job runner's
    time limit interrupts it, and the election must still be able to set it.
    """

    __slots__ = ("_event", "_settle")

    def __init__(self, event: Event | None = None, settle: Callable[[], float] | None = None) -> None:
        self._event = Event() if event is None else event
        self._settle = settle
        """Sets the flag if the clock says so; returns when to ask again (inf: only a report can set it)."""

    def is_set(self) -> bool:
        if self._settle is not None:
            self._settle()
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set, or ``timeout`` seconds; returns whether it is set (`threading.Event.wait`)."""
        if self._settle is None:
            return self._event.wait(timeout)
        deadline = math.inf if timeout is None else now() + timeout
        while True:
            due = min(self._settle(), deadline)
            if self._event.is_set():
                return True
            # Woken by a report, or at the lease's end to set it by the clock (a renewed lease moves it on).
            if self._event.wait(None if due == math.inf else max(0.0, due - now())):
                return True
            if now() >= deadline:
                return self._event.is_set()

    def __repr__(self) -> str:
        return f"<Flag {'set' if self.is_set() else 'clear'}>"


class Term:
    """One term, as the election keeps it: changed by the election only, read by its `Leadership`."""

    def __init__(self, mutex: Mutex, lock: LockState, hold: Hold, span: Span) -> None:
        self.lock = lock
        self.hold = hold
        self.span = span
        self.began = now()
        self.endings: list[tuple[str, str]] = []
        """Every (ending, reason) it was told, first one first: the first one is how it ends."""
        self.ended_at = 0.0
        self.returned = Event()
        """Set once ``lead`` has returned."""
        self.wake = Event()
        """Set when the term is told to end or ``lead`` returns: the watch thread waits on it."""
        self.task: asyncio.Future[Any] | None = None
        """An async ``lead``'s task, which the end of the term cancels."""
        self._ended = Event()
        self.leadership = Leadership(self, mutex, Flag(self._ended, self.settle))

    @property
    def ending(self) -> str | None:
        """How the term ends ("lost", "stopped", "resigned"), None while it does not."""
        return self.endings[0][0] if self.endings else None

    @property
    def reason(self) -> str | None:
        return self.endings[0][1] if self.endings else None

    @property
    def current(self) -> bool:
        """Whether the lock's hold is still this term's (not released, not replaced by a later one)."""
        return self.lock.hold is self.hold

    def end(self, ending: str, reason: str) -> bool:
        """Tell the term to end; the first call wins. No lock: a signal handler may call it."""
        entry = (ending, reason)
        self.endings.append(entry)
        if self.endings[0] is not entry:
            return False
        self.ended_at = now()
        self._ended.set()
        self.wake.set()
        return True

    def settle(self) -> float:
        """End the term as lost if its hold is no longer trusted by the clock, before any report says so.

        Every flag of the term is read after this, so they are one view: the
        moment the lease runs out (or the hold turns in doubt), ``held`` is
        False and ``ended`` set, ``lost`` True and ``reason`` says why. Returns
        when the clock may end the term next (inf: only a report can). No
        lock: any thread may call it, as `end`.
        """
        hold = self.hold
        if self.endings or self.returned.is_set() or not self.current or hold.status is HoldStatus.ENDED:
            return math.inf  # a term given back is not lost by its release
        if hold.in_doubt:
            # Another candidate may take the lock over once the leader's session ended: a leader steps down.
            self.end("lost", f"leadership was lost: {IN_DOUBT}")
        elif not hold.held:
            self.end("lost", f"leadership was lost: {hold.reason or LEASE_EXPIRED}")
        else:
            return hold.trusted_until
        return math.inf

    def finish(self) -> None:
        """``lead`` has returned."""
        self.returned.set()
        self.wake.set()


class Leadership:
    """One term of leadership, handed to ``lead``: its fencing token and how to learn that it ends.

    `ended` is set the moment the term must end: leadership was lost (then
    `lost` is True), or `Election.stop` or `Election.resign` was called. A
    loss is read from the clock: once the lease has run out, every flag says
    so, even before the client's event thread reports it.
    ``lead`` should then return promptly; the lock is released when it does.
    """

    def __init__(self, term: Term, mutex: Mutex, ended: Flag) -> None:
        self._term = term
        self._mutex = mutex
        self.ended = ended
        """Set when the term must end: lost, stopped or resigned. ``lead`` returns once it is set."""

    @property
    def name(self) -> str:
        """The election's name (its lock's name)."""
        return self._mutex.lock_name

    @property
    def instance_id(self) -> str:
        return self._mutex.instance_id

    @property
    def token(self) -> int | None:
        """This term's fencing token: greater than every earlier term's (None on a table without tokens)."""
        return self._term.hold.token

    @property
    def lost(self) -> bool:
        """True if the term ended because leadership was lost, rather than given up."""
        self._term.settle()
        return self._term.ending == "lost"

    @property
    def reason(self) -> str | None:
        """Why the term ends (None while it does not)."""
        self._term.settle()
        return self._term.reason

    @property
    def held(self) -> bool:
        """True while this term leads: its lock is held and it has not been told to end. Never touches the database.

        It turns False with `ended` set, `lost` and `reason` saying why, at once: all read the same clock.
        """
        return self._term.settle() < math.inf  # a due time: held now, and not told to end

    def ensure_held(self) -> None:
        """Raise `LockNotHeldError` unless this term still leads; call it between steps of the work.

        It raises once the term was told to end, whether leadership was lost
        or given up (`stop`, `resign`): the error's ``reason`` says which.
        Raising it out of ``lead`` ends the term quietly; it is not counted
        as a failure of ``lead``.
        """
        term = self._term
        self._require_current()
        term.settle()
        if term.endings:
            raise self._error(term.endings[0][1])

    def fence(self, conn: psycopg.Connection[Any]) -> int:
        """`Mutex.fence` for this term: in ``conn``'s open transaction, check that this term still holds the lock.

        Returns the token; raises `LockNotHeldError` if the lock changed
        hands since (roll the transaction back), which also ends the term as
        lost. A term told to end but not yet released still passes: until
        ``lead`` returns, the lock is its.
        """
        self._require_current()
        try:
            return self._check_token(self._mutex.fence(conn))
        except LockNotHeldError as exc:
            self._term.end("lost", f"leadership was lost: {exc.reason}")
            raise

    async def fence_async(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Async `fence`, on an `AsyncConnection`."""
        self._require_current()
        try:
            return self._check_token(await self._mutex.fence_async(conn))
        except LockNotHeldError as exc:
            self._term.end("lost", f"leadership was lost: {exc.reason}")
            raise

    @contextlib.contextmanager
    def fenced(self, conn: psycopg.Connection[Any]) -> Iterator[int]:
        """`Mutex.fenced` for this term: a transaction on ``conn``, fenced first; yields the token."""
        with conn.transaction():
            yield self.fence(conn)

    @contextlib.asynccontextmanager
    async def fenced_async(self, conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[int]:
        """Async `fenced`, on an `AsyncConnection`."""
        async with conn.transaction():
            yield await self.fence_async(conn)

    def __repr__(self) -> str:
        ending = self._term.ending
        state = "leading" if self.held else f"ended ({ending})" if ending else "not held"
        return f"<Leadership election={self.name!r} token={self.token} {state}>"

    def _require_current(self) -> None:
        if not self._term.current:
            raise self._error("this term is over: its lock was released")

    def _check_token(self, token: int) -> int:
        if token != self.token:
            raise self._error(f"this term is over: the lock is held with token {token} now")
        return token

    def _error(self, reason: str) -> LockNotHeldError:
        return LockNotHeldError(
            f"leadership of election {self.name!r} (token {self.token}) has ended: {reason}",
            lock_name=self.name,
            instance_id=self.instance_id,
            reason=reason,
        )


class TermPolicy:
    """What follows a term, decided once for `run` and `run_async` (no I/O): how it ended, and the pause."""

    def __init__(self, failure_backoff: float, max_failure_backoff: float, rejoin_pause: float) -> None:
        self.failure_backoff = failure_backoff
        self.max_failure_backoff = max_failure_backoff
        self.rejoin_pause = rejoin_pause
        self.failures = 0

    def ended(self, term: Term, told: str | None, error: BaseException | None) -> str:
        """How the term ended. ``told``: how it was told to end before ``lead`` returned (None: it was not)."""
        if told is not None:
            return told
        if error is not None and not (isinstance(error, LockNotHeldError) and term.ending == "lost"):
            return "failed"
        # A loss found only by the release counts as one, and so does lead's LockNotHeldError then.
        return term.ending or "returned"

    def pause_after(self, ended: str) -> float:
        """Seconds to wait before campaigning again.

        A failure backs off exponentially, up to the cap; giving the term up
        (``lead`` returned, `resign`) sits out a short pause so that another
        candidate, woken by the release, takes over; after a loss the
        candidate campaigns at once (it waits for the lock anyway).
        """
        if ended == "failed":
            self.failures += 1
            return min(self.max_failure_backoff, self.failure_backoff * 2.0 ** (self.failures - 1))
        self.failures = 0
        if ended in ("returned", "resigned"):
            return self.rejoin_pause
        return 0.0
