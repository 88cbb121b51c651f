"""The short thresholds the tests run with: one table, read by the fixtures, the worker processes and the CLI tests.

Short thresholds keep crash and loss tests to seconds; the ratios between them
are what the library cares about. This module imports nothing of the suite's,
so a worker process (``python -m tests.support.workers``) reads it without pytest.
"""

from __future__ import annotations

FAST: dict[str, float] = {
    "heartbeat_interval": 0.1,
    "alert_threshold": 0.6,
    "stale_threshold": 1.5,
    "poll_interval": 0.05,
    "operation_timeout": 2.0,
}

_CLI_FLAGS = ("heartbeat_interval", "alert_threshold", "stale_threshold")


def cli_flags() -> list[str]:
    """The thresholds of `FAST` as ``postgres-mutex run`` flags (``--heartbeat-interval 0.1`` ...)."""
    return [part for key in _CLI_FLAGS for part in (f"--{key.replace('_', '-')}", f"{FAST[key]:g}")]
