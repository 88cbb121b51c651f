"""How a statement the caller gave up on is stopped, whichever connection it runs on.

The engine interrupts its statements, and the listener its own: both stop
one the same way, on the server first, then on the socket (`Cutter`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg
from psycopg import pq

from .._base.watchdog import Cutter

# The longest wait for the server to take a cancel request for an interrupted statement.
_CANCEL_TIMEOUT = 1.0


async def interrupt(conn: psycopg.AsyncConnection[Any], cutter: Cutter, timeout: float) -> None:
    """Stop a statement the caller gave up on: on the server first, then on the socket.

    Left alone, it could go on waiting on the server (behind another session's
    row lock, say) and land later: an orphan row, or a lock taken by nobody.
    A cancel request (bounded, and skipped when the network is known dead)
    stops it there; the connection is then cut and replaced either way.
    """
    if not cutter.fired and conn.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
        with contextlib.suppress(Exception):
            await conn.cancel_safe(timeout=min(_CANCEL_TIMEOUT, timeout))
    cutter.cut()
