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
comes, and sleeps again until the next one: it does not wake once per
statement, which would cost a thread switch (and the GIL) each time. A
deadline stored earlier than the moment it sleeps until wakes it.
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

from .acompat import start_thread
from .clock import now, slice_until

logger = logging.getLogger("postgres_mutex")


class Cutter:
    """Shuts one connection's socket down when an armed deadline passes.

    Holds a duplicate of the connection's descriptor: shutting it down affects
    the shared socket, yet stays harmless if the connection closed its own
    first. `close` must be called when the connection is discarded, or the
    duplicate would keep the socket open.
    """

    __slots__ = ("__weakref__", "_lock", "_sock", "_until", "_watched_by", "fired")

    def __init__(self, fileno: int) -> None:
        self._sock: socket.socket | None = socket.socket(fileno=os.dup(fileno))
        self._lock = threading.Lock()
        self._until = math.inf
        """When the statement under way is due (infinity: nothing is armed)."""
        self._watched_by: _Watchdog | None = None
        self.fired = False
        """True once a deadline cut the socket: the connection is unusable."""

    def arm(self, seconds: float) -> float:
        """Cut the socket in ``seconds`` unless `disarm` is called with the returned ticket first.

        One statement at a time per connection: arming again replaces the deadline.
        """
        at = now() + seconds
        self._until = at  # armed: the watchdog reads it when it looks
        watchdog = _instance
        if watchdog is None or self._watched_by is not watchdog:
            _watchdog().watch(self, at)  # the first deadline of this connection (in this process)
        elif at < watchdog.sleeping_until:
            watchdog.wake()
        return at

    def disarmed(self, ticket: float) -> bool:
        """Whether ``ticket`` can no longer cut (disarmed, or the cutter closed): a ticket never re-arms."""
        return self._until != ticket

    def disarm(self, ticket: float) -> None:
        with self._lock:
            if self._until == ticket:
                self._until = math.inf

    def disarm_all(self) -> None:
        """Disarm whatever is armed: for the one statement at a time its connection runs."""
        with self._lock:
            self._until = math.inf

    def due_at(self) -> float:
        return self._until

    def due(self, current: float) -> None:
        """Called by the watchdog: cut the socket if a deadline still armed has passed at ``current``."""
        with self._lock:
            if self._until <= current:
                self._cut()

    def cut(self) -> None:
        """Shut the socket down now: whatever is blocked on it fails at once."""
        with self._lock:
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

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
            self._until = math.inf
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
    (`sleeping_until`), so a cutter armed after it looked at it wakes it, and one armed
    before it looked is seen.
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
                return
        if at < self.sleeping_until:
            self.wake()

    def wake(self) -> None:
        self._wake.put(None)

    def _run(self) -> None:
        while True:
            self.sleeping_until = math.inf  # looking: a deadline armed from now on wakes it again
            current = now()
            due: list[Cutter] = []
            earliest = math.inf
            with self._lock:
                for cutter in list(self._cutters):
                    at = cutter.due_at()
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
                self._wake.get(timeout=None if earliest == math.inf else slice_until(earliest))
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


def _forget_after_fork() -> None:
    # The thread does not survive fork(); the child starts its own on first use.
    global _instance, _instance_lock
    _instance = None
    _instance_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
