"""The one clock postgres-mutex measures time with: leases, deadlines and waits.

``CLOCK_BOOTTIME`` on Linux: monotonic (a wall-clock jump changes nothing) and,
unlike ``time.monotonic``, it keeps counting while the machine is suspended. A
holder frozen across a suspend must wake up knowing its lease ran out, since
the server's clock (which decides staleness) kept running. Elsewhere it falls
back to ``CLOCK_MONOTONIC``.

Waits in the standard library (``Event.wait``, ``asyncio.sleep``) run on
``time.monotonic``, which stops during a suspend: anything that must happen on
time on this clock waits in slices of at most `MAX_SLICE` seconds and re-reads
the clock, so a suspend delays it by one slice at most.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)

MAX_SLICE = 1.0
"""Longest single wait before the clock is read again."""


now: Callable[[], float] = functools.partial(time.clock_gettime, _CLOCK)
"""Seconds on the library's clock (never the wall clock).

A partial of the C function, not a function of ours: read a dozen times per
lock cycle, it costs no Python call.
"""


def slice_until(deadline: float) -> float:
    """How long to wait now for ``deadline``: what is left, at most `MAX_SLICE`, never negative."""
    return max(0.0, min(MAX_SLICE, deadline - now()))
