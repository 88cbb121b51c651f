"""What every subcommand shares: exit codes, one-line errors, the flags' words, argument types, columns."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import NoReturn, TextIO

from ..errors import Phrase

EXIT_BUSY = 75
"""The lock is held elsewhere (or ``--wait --timeout`` ran out): EX_TEMPFAIL, try again later."""
EXIT_LOST = 76
"""The lock was lost while the command ran; the command was stopped."""
EXIT_UNAVAILABLE = 69
"""PostgreSQL could not be used (unreachable, table missing, privilege missing): EX_UNAVAILABLE."""
EXIT_USAGE = 2
"""Bad arguments."""

MAX_RESTART_DELAY = 60.0
"""The longest back-off between restarts of a command that keeps failing (``run --restart``)."""


class UsageError(Exception):
    """A mistake on the command line: one line, exit 2."""


def say(message: str, stream: TextIO | None = None) -> None:
    print(f"postgres-mutex: {message}", file=stream or sys.stderr, flush=True)


CLI_WORDS: Mapping[str, str] = {
    "call create_schema()": "run 'postgres-mutex init'",
    "create_schema()": "'postgres-mutex init'",
    "LockTable.migrate()": "'postgres-mutex migrate'",
    "LockTable.migrate(history=True)": "'postgres-mutex migrate --history'",
    "history=True": "--history",
    "LockTable.create(celery_beat=True)": "'postgres-mutex init --celery-beat'",
    "LockTable.create(apscheduler=True)": "'postgres-mutex init --apscheduler'",
    "history_retention": "--history-retention",
    "celery_beat": "--celery-beat",
    "apscheduler": "--apscheduler",
    "pass blocking=True": "pass --wait",
    "timeout": "--timeout",
    "dsn": "--dsn (or POSTGRES_MUTEX_DSN)",
    "table": "--table",
    "lock_name": "--lock",
    "name": "--lock",
    "failure_backoff": "--restart-delay",
    "lock_names": "--lock",
    "instance_id": "--instance-id",
    "heartbeat_interval": "--heartbeat-interval",
    "alert_threshold": "--alert-threshold",
    "stale_threshold": "--stale-threshold",
    "operation_timeout": "--operation-timeout",
    "reclaim_disconnected_after": "--reclaim-disconnected-after",
    "hold_at_least": "--hold-at-least",
    "since": "--since",
    "limit": "--limit",
    "permit": "--permit",
    "writer": "--writer",
    "reader": "--reader",
}
"""The library's terms as a user of the command knows them: its flags and subcommands."""


def in_cli_words(error: BaseException) -> str:
    """The library's message for ``error``, naming flags and subcommands where it names arguments and calls."""
    phrase = getattr(error, "phrase", None)
    return phrase.render(CLI_WORDS) if isinstance(phrase, Phrase) else str(error)


class Parser(argparse.ArgumentParser):
    """argparse, with errors as one line (and a pointer to --help) instead of the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def seconds(argument: str) -> Callable[[str], float]:
    """A number of seconds on the command line: finite, positive (zero allowed for --timeout).

    Ranges (thresholds that must nest, upper bounds) are the library's to
    check; its errors name the arguments, which `in_cli_words` says as flags.
    """

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and argument != "--timeout"):
            raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
        return value

    return parse


def exit_code(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 255:
        raise argparse.ArgumentTypeError(f"exit codes are 0 to 255, got {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def permit_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a permit's number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"permits are numbered from 0, got {value}")
    return value


def dsn(args: argparse.Namespace) -> str:
    # An empty string lets libpq take everything from PG* variables and .pgpass.
    return str(args.dsn or os.environ.get("POSTGRES_MUTEX_DSN", ""))


def command_env(token: int | None) -> dict[str, str]:
    """The environment of a command run under a lock: without our connection string (nor its password),
    with the hold's fencing token, to pass on to what it writes to."""
    env = {key: value for key, value in os.environ.items() if key != "POSTGRES_MUTEX_DSN"}
    if token is not None:
        env["POSTGRES_MUTEX_TOKEN"] = str(token)
    return env


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def print_columns(lines: list[tuple[str, ...]]) -> None:
    widths = [max(len(line[column]) for line in lines) for column in range(len(lines[0]))]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since(text: str) -> datetime | timedelta:
    """``--since``: an ISO 8601 moment (without a zone: this machine's), or an age such as 90s, 15m, 2h, 7d.

    An age counts back from now by the server's clock, as every age here does.
    """
    relative = _RELATIVE.match(text.strip())
    if relative:
        return timedelta(seconds=float(relative.group(1)) * _UNIT_SECONDS[relative.group(2)])
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a moment or an age: {text!r} (examples: 2026-12-02T03:00, 2026-12-02 03:00+00:00, 90s, 15m, 2h, 7d)"
        ) from None
    return moment if moment.tzinfo is not None else moment.astimezone()
