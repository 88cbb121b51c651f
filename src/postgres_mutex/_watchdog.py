"""Deadlines that hold even on a network that silently stops forwarding.

A socket whose peer stops answering (no RST, no FIN) blocks a psycopg call
indefinitely, and cancelling an asyncio task only makes psycopg try a
server-side cancel over the same dead network. What reliably ends the call is
shutting the socket down: the blocked read fails at once and psycopg raises
`OperationalError`. One daemon thread per process does that for every armed
deadline, for sync and async connections alike; the connection is broken
afterwards and its owner replaces it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from types import TracebackType

logger = logging.getLogger("postgres_mutex")


class Deadline:
    """An armed deadline on one socket; use as a context manager around one operation."""

    __slots__ = ("_fired", "_lock", "_sock", "at")

    def __init__(self, fileno: int, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        # A duplicate of the descriptor: shutting it down affects the shared
        # socket, yet stays harmless if the connection closes its own first.
        self._sock: socket.socket | None = socket.socket(fileno=os.dup(fileno))
        self._fired = False
        self._lock = threading.Lock()

    @property
    def fired(self) -> bool:
        """True if the deadline passed and the socket was shut down."""
        return self._fired

    def fire(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
            if sock is None:
                return
            self._fired = True
        try:
            # Linger 0: when the connection's own descriptor is closed too, the
            # kernel resets the connection and discards unsent data, rather
            # than deliver a cut-off statement late if the network comes back.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the peer: the operation is failing anyway
        finally:
            sock.close()

    def disarm(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> Deadline:
        _watchdog().arm(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.disarm()


class Timer:
    """Run ``callback`` (in a thread of its own) after ``seconds``, unless cancelled first.

    Used for what must happen on time whatever the I/O is doing, such as a
    lease running out while a heartbeat is stuck connecting.
    """

    __slots__ = ("_callback", "_lock", "at")

    def __init__(self, seconds: float, callback: Callable[[], object]) -> None:
        self.at = time.monotonic() + seconds
        self._callback: Callable[[], object] | None = callback
        self._lock = threading.Lock()
        _watchdog().arm(self)

    def cancel(self) -> None:
        with self._lock:
            self._callback = None

    def fire(self) -> None:
        with self._lock:
            callback, self._callback = self._callback, None
        if callback is not None:
            # Off the watchdog's thread: a slow callback must not delay a deadline.
            threading.Thread(target=callback, name="postgres-mutex-timer", daemon=True).start()


class _Watchdog:
    """One thread, one heap of deadlines and timers; fires each that is still armed when due."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Deadline | Timer]] = []
        self._counter = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: Deadline | Timer) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline.at, next(self._counter), deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="postgres-mutex-watchdog", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is deadline:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                at, _, deadline = self._heap[0]
                delay = at - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                heapq.heappop(self._heap)
            try:
                deadline.fire()
            except Exception:  # never let one deadline stop the others from firing
                logger.exception("postgres-mutex watchdog could not cut off an operation")


_instance: _Watchdog | None = None
_instance_lock = threading.Lock()


def _watchdog() -> _Watchdog:
    global _instance
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
