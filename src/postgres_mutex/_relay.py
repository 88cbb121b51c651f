"""`Relay`: carries `Election.stop` and `Election.resign` out of a signal handler, to a thread of its own.

A signal handler runs in the main thread between two bytecodes, possibly
while that thread holds the internal lock of the very event it waits on
(``leadership.ended.wait()``, the campaign's wait): setting that event from
the handler would wait for itself forever. The handler only writes a byte to
a pipe (no lock taken); the relay's thread reads it and sets the events.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable


class Relay:
    """A pipe and the thread that reads it: `send` from anywhere, a signal handler included."""

    STOP = b"s"
    RESIGN = b"r"
    _QUIT = b"q"

    def __init__(self, stop: Callable[[], None], resign: Callable[[], None]) -> None:
        self._read, self._write = os.pipe()
        self._stop, self._resign = stop, resign
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

    def close(self) -> None:
        """Act on what was sent before, then end the thread.

        The write end stays open while anyone may still hold this relay (a
        `send` after this fails, and its caller acts itself): closed with it,
        its descriptor number could be reused by a file of the user's.
        """
        self.send(self._QUIT)
        self._thread.join()
        os.close(self._read)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._write)
