# Generated from closing_async.py by tools/async_to_sync.py: do not edit.
# Change the async module and run `python tools/async_to_sync.py`.
"""What closing a Mutex does with its lock: release it if held, or say loudly why it cannot.

0.1.0's ``close()`` left a held lock held; releasing it is right, but it
changes what an old caller sees, so it is said with a warning. A release that
fails on close is logged, not raised: closing must go on to let go of the
client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._state.locks import Phase
from ..errors import MutexError

if TYPE_CHECKING:
    from .._state.locks import LockState

logger = logging.getLogger("postgres_mutex")


def release_on_close(
    lock: LockState,
    release: Callable[[], None],
    *,
    has_sync: bool,
) -> None:
    """``close()``'s part: ``release`` the lock if this Mutex holds it."""
    if lock.phase is Phase.HOLDING:
        if lock.held:
            # 0.1.0's close() left the lock held; releasing it now is right, but say so.
            logger.warning("close() releases lock %r, which this Mutex still held", lock.lock_name)
        # With only an ``async_pool``, ``close()`` has no way to send the release.
        if not has_sync:
            logger.warning(
                "lock %r is still held and only an async_pool is available to release it: use "
                "aclose(); the lock stays until another instance reclaims it after stale_threshold",
                lock.lock_name,
            )
            return
        try:
            release()
        except MutexError as exc:
            logger.warning("releasing lock %r on close: %s", lock.lock_name, exc)
