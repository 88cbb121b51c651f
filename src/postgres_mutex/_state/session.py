"""`Session`: the lease of a client's holds, and the one thread that tells what happens to them.

etcd's ``concurrency.Session`` is the model: one object keeps the lease, and
the primitives (`Mutex`, `Election`) are built on it side by side. Here a
lease is per hold, renewed by the heartbeats of the engine that acquired it,
and the session keeps what every hold of the client has in common:

- the heartbeat groups of each engine (the holds renewed by one statement),
  changed only under `state_lock`;
- lease expiry: a hold whose lease ran out is declared lost on time, by the
  session's event thread, even while a heartbeat is stuck on the network; so
  is a hold that turned in doubt, or that went two thirds of its trust
  without a heartbeat (`_state.locks`);
- that event thread, which calls what users gave the library (``on_lost``,
  metrics hooks) in order, off the heartbeat: a slow callback never delays one.

The session never opens a connection: the engines do, and report to it.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._base.clock import MAX_SLICE, now, slice_until
from .._base.threads import start_thread
from .locks import LEASE_EXPIRED, HeartbeatGroup, Hold, HoldStatus, StateLock

if TYPE_CHECKING:
    from ..errors import LockNotHeldError

logger = logging.getLogger("postgres_mutex")

Groups = dict[object, HeartbeatGroup]
"""An engine's heartbeat groups, by what their holds share (table, interval, what they report)."""


class Session:
    """The holds of one client: their heartbeat groups, their leases, and the thread that reports on them.

    Every change to a group happens under `state_lock`, which the client's
    lock states share.
    """

    def __init__(self) -> None:
        self.state_lock: StateLock = threading.Lock()
        self._groups: dict[object, Groups] = {}
        self._events = _EventThread(self)

    def groups_of(self, engine: object) -> Groups:
        """The heartbeat groups of ``engine``: it adds and removes them, under `state_lock`.

        Called as the engine is made, which the client does under `state_lock`
        already (so it does not take it again).
        """
        return self._groups.setdefault(engine, {})

    def drop(self, engine: object) -> None:
        """``engine`` was closed or left behind: its holds are no longer the session's to keep."""
        with self.state_lock:
            self._groups.pop(engine, None)

    def kept(self, hold: Hold) -> None:
        """``hold`` was added to a group: its lease is kept from now on (looked at again within a second)."""
        events = self._events
        if hold.lease_deadline - now() < MAX_SLICE:
            events.nudge()
        elif events.thread is None:  # `ensure`, inline: a hold is kept on every acquire
            events.ensure()

    def forget(self, hold: Hold) -> None:
        """Stop renewing ``hold`` (released, lost, or being released).

        A hold released while in doubt, before the event thread told it so, is told now: from here
        on the event thread no longer looks at it, and the doubt is the holder's notice that
        another instance may take the lock over before the release's reply comes.
        """
        with self.state_lock:
            group = hold.group
            if group is not None:
                group.discard(hold)
                hold.group = None
            untold = (
                hold.status is HoldStatus.ENDED
                and not hold.doubt_told
                and hold.doubt_deadline <= now() < hold.lease_deadline
            )
            if untold:
                hold.doubt_told = True
        if untold:
            self._events.post(hold.lock.events.in_doubt)

    def post(self, report: Callable[[], object]) -> None:
        """Run ``report`` on the event thread: user callbacks, in order, off the heartbeat."""
        self._events.post(report)

    def post_from_finalizer(self, report: Callable[[], object]) -> None:
        """`post` from a finalizer, which may run in any thread at any moment: it never waits on a lock."""
        self._events.post_from_finalizer(report)

    def expire(self) -> float | None:
        """Declare lost every hold whose lease ran out, and tell doubts and leases running out; on the event
        thread, on time. Returns when something is next due about a hold (None: nothing is held).

        One pass over the holds, which looks closer only at those with something due: with
        thousands of holds, this pass is most of the event thread's work.
        """
        current = now()
        with self.state_lock:
            held = self._held()
        due: float | None = None
        lost: list[tuple[Hold, LockNotHeldError]] = []
        for hold in held:
            hold_due = _next_due(hold)
            if hold_due <= current:
                self._expire(hold, current, lost)
                if hold.status is not HoldStatus.HELD:
                    continue
                hold_due = _next_due(hold)
            due = hold_due if due is None or hold_due < due else due
        # Every holder whose lease ran out is told (on_lost) before any loss is logged or counted: a
        # notice waits on no log handler's I/O, nor on the other losses' (a partition ends thousands).
        for hold, error in lost:
            hold.lock.events.tell_lost(error)
        for hold, error in lost:
            hold.lock.events.record_lost(error)
        return due

    def _expire(self, hold: Hold, current: float, lost: list[tuple[Hold, LockNotHeldError]]) -> None:
        lock = hold.lock
        if hold.lease_deadline <= current:
            error = lock.lose(hold, LEASE_EXPIRED, only_if_expired=True)
            if error is not None:
                self.forget(hold)
                lost.append((hold, error))
            return
        left = lock.tell_running_out(hold)
        if left is not None:
            lock.events.running_out(left)
        if lock.tell_doubt(hold):
            lock.events.in_doubt()

    def stop(self) -> None:
        """End the event thread once what was posted before has run."""
        self._events.stop()

    def _held(self) -> list[Hold]:
        return [
            hold
            for groups in self._groups.values()
            for group in groups.values()
            for hold in group.holds
            if hold.status is HoldStatus.HELD
        ]


class _EventThread:
    """Keeps the leases of a session's holds and runs its callbacks, in order, on one thread.

    It exists while something is held or to be reported, and ends when idle.
    """

    def __init__(self, session: Session) -> None:
        self._session = weakref.ref(session)
        self._queue: queue.SimpleQueue[Callable[[], object] | _Stop | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def post(self, report: Callable[[], object]) -> None:
        self._queue.put(report)
        self._ensure()

    def post_from_finalizer(self, report: Callable[[], object]) -> None:
        # The queue's put is safe there; the thread lock may be held by this very thread (a collection
        # inside `_ensure`), so it is waited on only briefly: whoever holds it then starts the thread,
        # or ends it only once the queue is empty.
        self._queue.put(report)
        if self._lock.acquire(timeout=_FINALIZER_WAIT):
            self._lock.release()
            self.ensure()

    def nudge(self) -> None:
        self._queue.put(None)
        self._ensure()

    def ensure(self) -> None:
        # The thread clears ``thread`` however it ends (`_run`): one that is set runs, and is not
        # asked (is_alive is a few calls, and a hold is kept on every acquire).
        if self.thread is None:
            self._ensure()

    def stop(self) -> None:
        self._queue.put(_Stop())

    def _ensure(self) -> None:
        inline = False
        with self._lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = start_thread(self._run, "postgres-mutex-events")
                inline = self.thread is None
        if inline:
            # The interpreter is shutting down and starts no thread: tell now, in order.
            self._report_now()

    def _report_now(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if callable(item):
                try:
                    item()
                except Exception:
                    logger.exception("a postgres-mutex callback failed")

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # However it ended (stopped, its session gone, a defect): the next `ensure` starts another.
            with self._lock:
                thread = self.thread
                if thread is not None and thread.ident == threading.get_ident():
                    self.thread = None

    def _serve(self) -> None:
        idle_since: float | None = None
        due: float | None = None
        looked_at = 0.0
        look = True
        while True:
            session = self._session()
            if session is None:
                return
            if look:
                due, looked_at = session.expire(), now()
            del session
            if due is not None or not self._queue.empty():
                idle_since = None
            else:
                # Nothing held, nothing to tell: end after a while (locks come and go in bursts).
                idle_since = idle_since if idle_since is not None else now()
                if now() - idle_since >= _LINGER:
                    with self._lock:
                        if self._queue.empty():
                            self.thread = None
                            return
            try:
                item = self._queue.get(timeout=MAX_SLICE if due is None else max(slice_until(due), 0.001))
            except queue.Empty:
                item = None
            if isinstance(item, _Stop):
                return
            if item is not None:
                try:
                    item()
                except Exception:
                    logger.exception("a postgres-mutex callback failed")
            # A report (a heartbeat round's, say) moves holds' due times later, but for a hold it
            # confirms after a doubt, whose next doubt is due again: that one is looked at within a
            # slice (its lease, and so `held`, only moved later). A hold kept with an earlier due
            # time nudges (None). So the holds are looked at again only when nudged, when something
            # is due, or a slice after the last look.
            look = item is None or due is None or now() >= min(due, looked_at + MAX_SLICE)


def _next_due(hold: Hold) -> float:
    """When the event thread must next look at ``hold``: its lease's end, its doubt, two thirds of its trust."""
    # `Hold.running_out_at` inline: the event thread asks it of every hold at each look.
    lease, doubt = hold.lease_deadline, hold.doubt_deadline
    due = lease if hold.doubt_told or lease <= doubt else doubt
    if not hold.running_out_told:
        renewed = hold.renewed_at
        running_out = renewed + ((lease if lease <= doubt else doubt) - renewed) * 2 / 3
        if running_out < due:
            due = running_out
    return due


_FINALIZER_WAIT = 0.1
"""How long a finalizer waits for the event thread's lock, which its own thread may hold."""

_LINGER = 10.0
"""How long the event thread stays once nothing is held (holds come and go in bursts)."""


class _Stop:
    """Tells the event thread to end."""
