"""`Relay`: carries `Election.stop` and `Election.resign` out of a signal handler, to a thread of its own.

A signal handler runs in the main thread between two bytecodes, possibly
while that thread holds the internal lock of the very event it waits on
(``leadership.ended.wait()``, the campaign's wait): setting that event from
the handler would wait for itself forever. The handler only writes a byte to
a pipe (no lock taken); the relay's thread reads it and sets the events.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger("postgres_mutex")


class Relay:
    """A pipe and the thread that reads it: `send` from anywhere, a signal handler included."""

    STOP = b"s"
    RESIGN = b"r"
    _QUIT = b"q"

    def __init__(self, stop: Callable[[], None], resign: Callable[[], None], *, name: str) -> None:
        self._read, self._write = os.pipe()
        self._stop, self._resign = stop, resign
        self._name = name
        self._thread = threading.Thread(target=self._run, name="postgres-mutex-election-relay", daemon=True)
        self._thread.start()

    def send(self, what: bytes) -> bool:
        """Pass ``what`` on; False if the relay is closed (then the caller acts itself)."""
        try:
            os.write(self._write, what)
        except OSError:
            return False
        return True

    def _run(self) -> None:
        try:
            while True:
                try:
                    received = os.read(self._read, 64)
                except OSError:
                    return
                if self.STOP in received:
                    self._stop()
                elif self.RESIGN in received:
                    self._resign()
                if not received or self._QUIT in received:
                    return
        finally:
            # Closed by the thread that reads it, never under it: a descriptor
            # closed while read could be reused by a file of the user's.
            with contextlib.suppress(OSError):
                os.close(self._read)

    def close(self, timeout: float) -> bool:
        """Act on what was sent before, then end the thread; False (and a warning) if that took past ``timeout``.

        Past it, the thread is left to finish on its own: what it carries
        (a stop, a resignation) only sets events, so it is late, not lost.
        The write end stays open while anyone may still hold this relay (a
        `send` after this fails, and its caller acts itself): closed with it,
        its descriptor number could be reused by a file of the user's.
        """
        self.send(self._QUIT)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return True
        logger.warning(
            "election %r: a stop() or resign() passed on from a signal handler was still being acted on "
            "%.3gs (operation_timeout) after the run ended; the run returns without waiting for it",
            self._name,
            timeout,
        )
        return False

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._write)
