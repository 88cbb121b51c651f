"""Starting the library's daemon threads, which the interpreter may refuse.

Its own module, below `acompat` and `watchdog`, because the deadline thread
and the event thread start the same way as the engine's loops and need
nothing else of the paired primitives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def start_thread(target: Callable[[], object], name: str) -> threading.Thread | None:
    """Start a daemon thread running ``target``; None if the interpreter refuses new threads.

    Python 3.12 refuses them once it is shutting down, in ``atexit`` callbacks
    included, where the exit's release runs: callers then do the work in the
    calling thread, or leave it to that release.
    """
    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:
        return None
    return thread
