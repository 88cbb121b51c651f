"""Deadlines that hold even on a network that silently stops forwarding.

A socket whose peer stops answering (no RST, no FIN) blocks a psycopg call
indefinitely, and cancelling an asyncio task only makes psycopg try a
server-side cancel over the same dead network. What reliably ends the call is
shutting the socket down: the blocked read fails at once and psycopg raises
`OperationalError`. One daemon thread per process does that for every armed
deadline, sync and async alike; the connection is broken afterwards and its
owner replaces it.

Arming a deadline costs a heap push: each connection keeps one duplicate of
its socket (a `Cutter`) for its whole life, and a deadline that ends normally
is disarmed by bumping a counter. Disarmed deadlines leave the heap at the
next push, and the thread sleeps until the earliest live one is due: it does
not wake once per statement, which would cost a thread switch (and the GIL)
each time.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import os
import queue
import socket
import struct
import threading

from ._acompat import start_thread
from ._clock import now, slice_until

logger = logging.getLogger("postgres_mutex")


class Cutter:
    """Shuts one connection's socket down when an armed deadline passes.

    Holds a duplicate of the connection's descriptor: shutting it down affects
    the shared socket, yet stays harmless if the connection closed its own
    first. `close` must be called when the connection is discarded, or the
    duplicate would keep the socket open.
    """

    __slots__ = ("_armed", "_lock", "_sock", "fired")

    def __init__(self, fileno: int) -> None:
        self._sock: socket.socket | None = socket.socket(fileno=os.dup(fileno))
        self._lock = threading.Lock()
        self._armed = 0
        self.fired = False
        """True once a deadline cut the socket: the connection is unusable."""

    def arm(self, seconds: float) -> int:
        """Cut the socket in ``seconds`` unless `disarm` is called with the returned ticket first."""
        with self._lock:
            self._armed += 1
            ticket = self._armed
        _watchdog().push(now() + seconds, self, ticket)
        return ticket

    def disarmed(self, ticket: int) -> bool:
        """Whether ``ticket`` can no longer cut (disarmed, or the cutter closed): a ticket never re-arms."""
        return self._armed != ticket

    def disarm(self, ticket: int) -> None:
        with self._lock:
            if self._armed == ticket:
                self._armed += 1

    def disarm_all(self) -> None:
        """Disarm whatever is armed: for the one statement at a time its connection runs."""
        with self._lock:
            self._armed += 1

    def due(self, ticket: int) -> None:
        """Called by the watchdog: cut the socket if this ticket is still armed."""
        with self._lock:
            if self._armed == ticket:
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
            self._armed += 1
        if sock is not None:
            sock.close()


class _Watchdog:
    """One thread, one heap of (due time, cutter, ticket); cuts each that is still armed when due.

    Pushed to from the callers' threads, where a signal handler's exception may land at any
    moment: only primitives written in C are held there (a `threading.Lock` in a ``with``
    statement, a `queue.SimpleQueue`), whose release no exception can skip. (A
    `threading.Condition`'s is Python code: an exception landing at its start left it held,
    and every later statement waited on it for good.)
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Cutter, int]] = []
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._sleeping_until = math.inf
        """When the thread wakes by itself next (infinity: it is not asleep on a deadline)."""

    def push(self, at: float, cutter: Cutter, ticket: int) -> None:
        with self._lock:
            self._drop_disarmed()
            heapq.heappush(self._heap, (at, next(self._counter), cutter, ticket))
            if self._thread is None:
                # None at interpreter exit if it was never started: then only the
                # connect timeout and the server's statement_timeout bound this one.
                self._thread = start_thread(self._run, "postgres-mutex-watchdog")
                return
            if at >= self._sleeping_until:
                return
            self._sleeping_until = at  # one wake-up per earlier deadline is enough
        self._wake.put(None)

    def _drop_disarmed(self) -> None:
        # Statements mostly end long before their deadline: the heap's top is
        # usually the previous one's, done with.
        heap = self._heap
        while heap and heap[0][2].disarmed(heap[0][3]):
            heapq.heappop(heap)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._drop_disarmed()
                due = self._heap[0] if self._heap else None
                self._sleeping_until = math.inf if due is None else due[0]
                if due is not None and now() >= due[0]:
                    heapq.heappop(self._heap)
            if due is None or now() < due[0]:
                with contextlib.suppress(queue.Empty):
                    self._wake.get(timeout=None if due is None else slice_until(due[0]))
                continue
            try:
                due[2].due(due[3])
            except Exception:  # never let one deadline stop the others from firing
                logger.exception("postgres-mutex watchdog could not cut off an operation")


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
