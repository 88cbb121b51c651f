"""Turn SIGTERM into an orderly exit, so a stopped process releases its locks at once.

Python's default action for SIGTERM (a Kubernetes pod stop, ``systemctl stop``,
a rolling deploy) ends the process on the spot: no ``with`` block is left, no
``atexit`` callback runs, and every lock it held stays until another instance
reclaims it after ``stale_threshold``. `exit_on_sigterm` makes SIGTERM raise
`SystemExit` in the main thread instead, as Ctrl-C raises `KeyboardInterrupt`:
``with`` blocks release on the way out and the exit's release deletes the rest.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from types import FrameType

from .errors import MutexError

logger = logging.getLogger("postgres_mutex")

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""The exit status a shell reports for a process ended by SIGTERM (143)."""


class _OrderlyExit:
    """The handler `exit_on_sigterm` installs: the first SIGTERM raises `SystemExit`, later ones wait for it."""

    def __init__(self) -> None:
        self.exiting = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.exiting:
            # The exit is under way (its releases included): a second SIGTERM must
            # not cut it short. The sender's SIGKILL still ends the process.
            logger.info("SIGTERM again while exiting: the exit goes on")
            return
        self.exiting = True
        logger.info("SIGTERM: exiting, releasing every lock held")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            sys.exit(SIGTERM_EXIT_CODE)
        # Raised here, the SystemExit would end whichever task the signal
        # interrupted (a heartbeat, a user's task) and be kept in it as its
        # result, to come out again while asyncio.run cancels the others, so
        # that their ``async with`` blocks never release. Raised from a loop
        # callback it ends the loop itself, as Ctrl-C under asyncio.run does.
        loop.call_soon_threadsafe(_exit)


def _exit() -> None:
    sys.exit(SIGTERM_EXIT_CODE)


_handler = _OrderlyExit()


def exit_on_sigterm() -> None:
    """Make SIGTERM end the process as `sys.exit(143)` would, releasing every lock held at once.

    Call it once, early, from the main thread (Python delivers signals to it).
    On SIGTERM the main thread raises `SystemExit`: the ``with`` blocks it is
    in release their locks, and the interpreter's exit releases those held
    elsewhere (other threads, entered acquisitions), within one
    ``operation_timeout``. A second SIGTERM during that exit is ignored.

    It never replaces a handler the application installed (nor SIG_IGN):
    raises `MutexError` naming it, so two shutdown plans cannot silently
    fight; have that handler raise `SystemExit` itself. Calling it again is
    harmless. An asyncio application is covered too: when the main thread
    runs an event loop, the `SystemExit` is raised from one of the loop's
    callbacks rather than inside whichever task the signal interrupted, so
    `asyncio.run` ends with it, cancelling every task, whose ``async with``
    blocks release.
    """
    if threading.current_thread() is not threading.main_thread():
        raise MutexError("exit_on_sigterm() must be called from the main thread: Python runs signal handlers there")
    current = signal.getsignal(signal.SIGTERM)
    if current is _handler:
        return
    if current is not signal.SIG_DFL:
        if current is signal.SIG_IGN:
            described = "SIG_IGN"
        elif current is None:
            described = "one installed outside Python"
        else:
            described = repr(current)
        raise MutexError(
            f"SIGTERM already has a handler ({described}): exit_on_sigterm() does not replace it; "
            "have that handler raise SystemExit (sys.exit) so that locks are released on the way out"
        )
    signal.signal(signal.SIGTERM, _handler)
