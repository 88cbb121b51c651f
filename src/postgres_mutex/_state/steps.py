"""The steps a flow asks an engine for: the vocabulary between the flows and the engines.

A flow (`_state.flows`, `_state.heartbeat_flows`, `_state.admin_flows`) is a generator that
yields these and receives each one's result; an engine performs them on a
connection. Nothing here does I/O: a step is a description.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from .._base.clock import now
from ..errors import LockNotHeldError

if TYPE_CHECKING:
    from .._sql import Names, Statement
    from .locks import Hold, LockState

T = TypeVar("T")

BRIEF_WAIT = 0.25
"""How long a heartbeat waits for a row another session holds locked (once it found it so), and a
forced release in each of its tries: brief, so the client's other statements are not held up."""


# -- the steps a flow asks for ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Execute:
    """Run one statement within ``timeout`` seconds; the engine sends back a `Result`.

    Failures come back as `DatabaseError` thrown into the flow. ``urgent``
    statements (the heartbeat worker's: heartbeats and clean-ups) go before
    others waiting for the connection.
    """

    statement: Statement
    params: Mapping[str, object]
    timeout: float
    action: str
    urgent: bool = False
    stray_row: Cleanup | None = None
    """For the clean-up of a stray row (any row carrying our id): the engine
    takes the lock's clean-up turn as it sends it (`LockState.take_cleanup_turn`),
    and does not send it (raising `CleanupSuperseded`) if an acquire began since."""


class CleanupSuperseded(Exception):
    """A clean-up was not sent: an acquire began after it, and takes the row back itself."""


class Result(NamedTuple):
    """What a statement answered. A named tuple: the engine makes one per statement, in one C call."""

    rowcount: int
    rows: tuple[tuple[Any, ...], ...] = ()
    sent_at: float = 0.0
    """When the statement was sent: after any wait for the connection, so leases count from there."""

    @property
    def row(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait ``seconds``; the engine sends back False if it is shutting down."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Shape:
    """The statements for a table, in the shape it has; the engine inspects the table once and remembers.

    ``timeout`` bounds that one inspection, as it bounds the statement that needs it.
    """

    names: Names
    timeout: float
    fresh: bool = False
    """Inspect the table again even if the engine knows its shape (it changed since)."""
    urgent: bool = False
    """Inspect it as an urgent statement (`Execute.urgent`): the heartbeat worker's."""


@dataclass(frozen=True, slots=True)
class Listen:
    """Start hearing releases on ``channel``; the engine sends back True once it listens anew, when a release
    may have gone unheard since the last attempt: the flow tries again at once.

    False where listening is impossible (a pool) or did not come about in
    ``timeout`` seconds: the flow then polls. False too where the channel was
    listened on since before ``since`` and nothing was heard there since: no
    release went unseen by the attempt sent then, and the flow waits.
    """

    channel: str
    timeout: float
    who: str | None = None
    """The waiter's instance id, for a waiter in line (`LockKind.queues`): a release that hands it the lock
    names it."""
    since: float | None = None
    """When the flow's last attempt was sent (`Result.sent_at`), if it knows."""
    one_hold: bool = False
    """The lock has one hold (a Mutex, not a semaphore): a woken waiter's attempt stands for every release after."""


@dataclass(frozen=True, slots=True)
class WaitForRelease:
    """Wait up to ``seconds`` for the release announced on the channel `Listen` subscribed to (or just wait).

    With a ``stop``, the wait also ends the moment it is set. With ``shared_until``, the wait is a poll's
    pause on a lock with one hold: another waiter of this process that attempts meanwhile makes that poll for
    both (its attempt sees what this one's would), so the wait goes on until a pause after the process's last
    attempt there, until ``shared_until`` at the latest.
    """

    seconds: float
    stop: StopSignal | None = None
    shared_until: float | None = None


class StopSignal:
    """A flag that ends a blocking acquire at once: an election's ``stop()``, from any thread.

    The acquire checks it before each attempt; the engine's wait for a
    release registers a waker on it, so setting it wakes the wait at once
    rather than after ``poll_interval``. No lock: setting it may happen in a
    signal handler that interrupted the very thread that waits, and list
    operations are atomic under the GIL.
    """

    __slots__ = ("_set", "_wakers")

    def __init__(self) -> None:
        self._set = False
        self._wakers: list[Callable[[], object]] = []

    def set(self) -> None:
        self._set = True
        for wake in list(self._wakers):
            wake()

    def is_set(self) -> bool:
        return self._set

    @contextmanager
    def waking(self, wake: Callable[[], object]) -> Iterator[None]:
        """While the block runs, setting the signal calls ``wake`` (at once, if it is set already)."""
        self._wakers.append(wake)
        try:
            if self._set:
                wake()
            yield
        finally:
            self._wakers.remove(wake)


@dataclass(frozen=True, slots=True)
class StopListening:
    """Stop hearing the channel `Listen` subscribed to (the engine UNLISTENs when nobody else waits on it)."""


@dataclass(frozen=True, slots=True)
class Releasing:
    """This process is about to release a hold of ``channel``'s lock: the engine answers the release's
    ``own_slot`` (`Listener.releasing`; 0 if its listener is not registered there, None without a listener),
    so that it wakes another process's waiter rather than this one's lingering registration."""

    channel: str


@dataclass(frozen=True, slots=True)
class Keep:
    """Renew ``hold`` with the engine's heartbeats from now on."""

    hold: Hold


@dataclass(frozen=True, slots=True)
class Forget:
    """Stop renewing ``hold``."""

    hold: Hold


@dataclass(eq=False)
class Cleanup:
    """A row of ours that may remain in the table, to delete in the background.

    ``acquired_at`` scopes the delete to one hold (a failed release, a lost
    lease); None means a stray row: any row carrying our id, which an acquire
    whose reply never came may have left. Such a clean-up belongs to the lock's
    ``generation`` of its time: once an acquire began since, it is
    `superseded`. The row is gone once a delete succeeds at or after
    ``conclusive_from``, the moment after which no statement of ours can still
    be running on the server.
    """

    lock: LockState
    acquired_at: datetime | None
    generation: int
    conclusive_from: float
    give_up_at: float
    due: float = field(default_factory=now)
    ended_how: str = "released"
    """How the history records the hold this row belonged to, if the table keeps one."""
    row_name: str | None = None
    """The ``lock_name`` of the hold's row (a semaphore's permit), when ``acquired_at`` names one."""

    @property
    def superseded(self) -> bool:
        """A stray row's clean-up, and an acquire began since: that acquire takes any row of ours back itself."""
        return self.acquired_at is None and self.generation != self.lock.generation


@dataclass(frozen=True, slots=True)
class Tell:
    """Report a loss: the engine hands it to the client's event thread (``on_lost`` runs there)."""

    lock: LockState
    error: LockNotHeldError


@dataclass(frozen=True, slots=True)
class Schedule:
    """Hand ``cleanup`` to the background; the flow does not wait for it."""

    cleanup: Cleanup


Op = Execute | Pause | Shape | Listen | WaitForRelease | StopListening | Releasing | Keep | Forget | Tell | Schedule
Flow = Generator[Op, Any, T]
