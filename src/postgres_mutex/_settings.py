"""Validation of everything a user passes to `Mutex`, done once at construction.

Bad input raises `TypeError` (wrong type) or `ValueError` (wrong value) naming
the argument, so a misconfigured job fails at start-up rather than at 3 a.m.
when it first contends.
"""

from __future__ import annotations

import math
import secrets
import socket
from dataclasses import dataclass

# VARCHAR(64) in the table: PostgreSQL counts characters, not bytes.
MAX_NAME_LENGTH = 64


def check_name(value: object, argument: str) -> str:
    """Return ``value`` if it fits a VARCHAR(64) name column, else raise naming ``argument``."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    if not 1 <= len(value) <= MAX_NAME_LENGTH:
        raise ValueError(f"{argument} must be 1 to {MAX_NAME_LENGTH} characters long, got {len(value)}")
    if "\x00" in value:
        # PostgreSQL text cannot hold NUL; the server would reject it mid-flight.
        raise ValueError(f"{argument} must not contain a NUL character")
    return value


def check_seconds(value: object, argument: str, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float number of seconds, or raise naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{argument} must be a finite number of seconds, got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "greater than zero"
        raise ValueError(f"{argument} must be {bound}, got {value!r}")
    return seconds


def default_instance_id() -> str:
    """``<hostname>-<random>``: unique per Mutex, readable by a DBA in the table."""
    suffix = secrets.token_hex(4)
    host = socket.gethostname() or "host"
    return f"{host[: MAX_NAME_LENGTH - len(suffix) - 1]}-{suffix}"


@dataclass(frozen=True)
class Timing:
    """The validated thresholds of one Mutex, in seconds.

    ``lease`` is how long a holder trusts its lock after the last heartbeat it
    *sent*: one heartbeat interval short of ``stale_threshold``. The server
    stamps a heartbeat no earlier than it was sent, so the holder's lease always
    runs out before any other instance may reclaim the row.
    """

    heartbeat_interval: float
    alert_threshold: float
    stale_threshold: float
    poll_interval: float
    operation_timeout: float

    @classmethod
    def validate(
        cls,
        *,
        heartbeat_interval: object,
        alert_threshold: object,
        stale_threshold: object,
        poll_interval: object,
        operation_timeout: object,
    ) -> Timing:
        timing = cls(
            heartbeat_interval=check_seconds(heartbeat_interval, "heartbeat_interval"),
            alert_threshold=check_seconds(alert_threshold, "alert_threshold"),
            stale_threshold=check_seconds(stale_threshold, "stale_threshold"),
            poll_interval=check_seconds(poll_interval, "poll_interval"),
            operation_timeout=check_seconds(operation_timeout, "operation_timeout"),
        )
        if not timing.heartbeat_interval < timing.alert_threshold:
            raise ValueError(
                f"heartbeat_interval ({timing.heartbeat_interval:g}s) must be shorter than "
                f"alert_threshold ({timing.alert_threshold:g}s), or every heartbeat would alert"
            )
        if not timing.alert_threshold < timing.stale_threshold:
            raise ValueError(
                f"alert_threshold ({timing.alert_threshold:g}s) must be shorter than "
                f"stale_threshold ({timing.stale_threshold:g}s), so on-call hears before a reclaim"
            )
        if timing.lease < 2 * timing.heartbeat_interval:
            raise ValueError(
                f"stale_threshold ({timing.stale_threshold:g}s) must be at least three heartbeat_intervals "
                f"({timing.heartbeat_interval:g}s): the holder's lease (stale_threshold - heartbeat_interval) "
                "must leave room to retry a failed heartbeat"
            )
        return timing

    @property
    def lease(self) -> float:
        return self.stale_threshold - self.heartbeat_interval

    @property
    def heartbeat_retry(self) -> float:
        """Pause before retrying a failed heartbeat: soon, but not a busy loop."""
        return min(self.heartbeat_interval, 1.0)
