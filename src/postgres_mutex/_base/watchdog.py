"""Deadlines that hold even on a network that silently stops forwarding.

A socket whose peer stops answering (no RST, no FIN) blocks a psycopg call
indefinitely, and cancelling an asyncio task only makes psycopg try a
server-side cancel over the same dead network. What reliably ends the call is
shutting the socket down: the blocked read fails at once and psycopg raises
`OperationalError`. One daemon thread per process does that for every armed
deadline, sync and async alike; the connection is broken afterwards and its
owner replaces it.

Arming a deadline is a single store: each connection keeps one duplicate of
its socket (a `Cutter`) for its whole life, holding the moment its current
statement is due; a statement that ends normally stores infinity instead.
The thread looks at the cutters it watches when the earliest deadline it saw
comes, and at least once every `STORE_ARMS` seconds while it watches any: it
does not wake once per statement, which would cost a thread switch (and the
GIL) each time. A deadline at least `STORE_ARMS` away is armed by its store
alone (`Cutter.until`, once `Cutter.stores_arm`), since the thread looks
before it is due; a nearer one (`Cutter.arm`) wakes the thread if it sleeps
past it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import socket
import struct
import threading
import weakref

from .clock import MAX_SLICE, now
from .threads import start_thread

logger = logging.getLogger("postgres_mutex")


class Cutter:
    """Shuts one connection's socket down when an armed deadline passes.

    Holds a duplicate of the connection's descriptor: shutting it down affects
    the shared socket, yet stays harmless if the connection closed its own
    first. `close` must be called when the connection is discarded, or the
    duplicate would keep the socket open.
    """

    __slots__ = ("__weakref__", "_sock", "_watched_by", "fired", "lock", "stores_arm", "until")

    def __init__(self, fileno: int) -> None:
        self._sock: socket.socket | None = socket.socket(fileno=os.dup(fileno))
        self.lock = threading.Lock()
        """Held while a deadline is cut or disarmed: a statement disarmed in time is never cut after."""
        self.until = math.inf
        """When the statement under way is due (infinity: nothing is armed). A statement of at least
        `STORE_ARMS` seconds is armed by storing this alone, once `stores_arm`; disarming stores
        infinity, under `lock`. (The common statement's arm and disarm: no call.)"""
        self._watched_by: _Watchdog | None = None
        self.stores_arm = False
        """The watchdog's thread looks at this cutter at least every `STORE_ARMS` seconds (set by the
        first `arm`, in this process): a deadline that far off is armed by storing `until` alone."""
        self.fired = False
        """True once a deadline cut the socket: the connection is unusable."""

    def arm(self, seconds: float) -> float:
        """Cut the socket in ``seconds`` unless `disarm` is called with the returned ticket first.

        One statement at a time per connection: arming again replaces the deadline.
        """
        at = now() + seconds
        self.until = at  # armed: the watchdog reads it when it looks
        watchdog = _instance
        if watchdog is None or self._watched_by is not watchdog:
            _watchdog().watch(self, at)  # the first deadline of this connection (in this process)
        elif at < watchdog.sleeping_until:
            watchdog.wake()
        return at

    def disarm(self, ticket: float) -> None:
        with self.lock:
            if self.until == ticket:
                self.until = math.inf

    def due(self, current: float) -> None:
        """Called by the watchdog: cut the socket if a deadline still armed has passed at ``current``."""
        with self.lock:
            if self.until <= current:
                self._cut()

    def cut(self) -> None:
        """Shut the socket down now: whatever is blocked on it fails at once."""
        with self.lock:
            self._cut()

    def _cut(self) -> None:
        sock = self._sock
        if sock is None or self.fired:
            return
        self.fired = True
        try:
            # Linger 0: when the connection's own descriptor is closed too, the
            # kernel resets the connection and discards unsent data, rather than
            # deliver a cut-off statement late if the network comes back.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the peer: the operation is failing anyway

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        with self.lock:
            sock, self._sock = self._sock, None
            self.until = math.inf
        if sock is not None:
            sock.close()


class _Watchdog:
    """One thread; the cutters it watches (weakly); cuts each whose armed deadline has passed.

    Armed from the callers' threads, where a signal handler's exception may land at any
    moment: only primitives written in C are held there (a `threading.Lock` in a ``with``
    statement, a `queue.SimpleQueue`), whose release no exception can skip. (A
    `threading.Condition`'s is Python code: an exception landing at its start left it held,
    and every later statement waited on it for good.)

    No deadline is missed: the thread says it sleeps until infinity while it looks
    (`sleeping_until`), so a cutter armed by `Cutter.arm` after it looked at it wakes it, and
    one armed before it looked is seen. A deadline armed by its store alone is at least
    `STORE_ARMS` away, and the thread looks again within `STORE_ARMS` of the moment it began
    its last look, so before that deadline, however late in the look it was stored.
    """

    def __init__(self) -> None:
        self._cutters: weakref.WeakSet[Cutter] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.sleeping_until = math.inf
        """When the thread wakes by itself next (infinity: it is looking, or not asleep on a deadline)."""

    def watch(self, cutter: Cutter, at: float) -> None:
        """Watch ``cutter`` from now on; it was just armed for ``at``."""
        with self._lock:
            self._cutters.add(cutter)
            cutter._watched_by = self
            if self._thread is None:
                # None at interpreter exit if it was never started: then only the
                # connect timeout and the server's statement_timeout bound this one.
                self._thread = start_thread(self._run, "postgres-mutex-watchdog")
                cutter.stores_arm = self._thread is not None
                return
            cutter.stores_arm = True
        # A thread asleep with nothing to watch (infinity) looks at this one from now on.
        if at < self.sleeping_until or self.sleeping_until == math.inf:
            self.wake()

    def wake(self) -> None:
        self._wake.put(None)

    def disown(self) -> None:
        """In a forked child, where this thread is gone: its cutters are armed by `Cutter.arm` alone."""
        for cutter in list(self._cutters):
            cutter.stores_arm = False

    def _run(self) -> None:
        while True:
            self.sleeping_until = math.inf  # looking: a deadline armed from now on wakes it again
            current = now()
            due: list[Cutter] = []
            earliest = math.inf
            with self._lock:
                for cutter in list(self._cutters):
                    if cutter.closed:
                        continue
                    # Watching it: look again within STORE_ARMS (see `Cutter.stores_arm`).
                    earliest = min(earliest, current + STORE_ARMS)
                    at = cutter.until
                    if at <= current:
                        due.append(cutter)
                    elif at < earliest:
                        earliest = at
            for cutter in due:
                try:
                    cutter.due(current)
                except Exception:  # never let one deadline stop the others from firing
                    logger.exception("postgres-mutex watchdog could not cut off an operation")
            if due:
                continue
            self.sleeping_until = earliest
            with contextlib.suppress(queue.Empty):
                # At most STORE_ARMS (MAX_SLICE) away from `current`: the clock is read again in time.
                self._wake.get(timeout=None if earliest == math.inf else max(0.0, earliest - now()))
            with contextlib.suppress(queue.Empty):
                while True:  # the wake-ups that came meanwhile: this look answers them all
                    self._wake.get_nowait()


_instance: _Watchdog | None = None
_instance_lock = threading.Lock()


def _watchdog() -> _Watchdog:
    global _instance
    if _instance is None:
        with _instance_lock:
            if _instance is None:
                _instance = _Watchdog()
    return _instance


STORE_ARMS = MAX_SLICE
"""A deadline at least this far off is armed by storing `Cutter.until` alone, on a cutter that
`Cutter.stores_arm`: the watchdog's thread looks at its cutters at least this often."""


def _forget_after_fork() -> None:
    # The thread does not survive fork(); the child starts its own on first use, and a cutter
    # inherited is armed again by `Cutter.arm` alone, which makes the child's thread watch it.
    global _instance, _instance_lock
    if _instance is not None:
        _instance.disown()
    _instance = None
    _instance_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
