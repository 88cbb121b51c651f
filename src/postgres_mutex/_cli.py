"""The ``postgres-mutex`` command: what flock(1) gives one machine, for a fleet.

Every subcommand reaches PostgreSQL through ``--dsn``, else the environment
variable ``POSTGRES_MUTEX_DSN``, else libpq's own ``PG*`` variables and
``.pgpass``. Errors a user can cause end in one line on stderr and a non-zero
exit, never a traceback, and nothing printed ever contains a password.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from types import FrameType
from typing import NoReturn, TextIO

from ._version import __version__
from .errors import DatabaseError, LockAcquisitionTimeout, LockNotHeldError, MutexError
from .table import LockTable

logger = logging.getLogger("postgres_mutex")

EXIT_BUSY = 75
"""The lock is held elsewhere (or ``--wait --timeout`` ran out): EX_TEMPFAIL, try again later."""
EXIT_LOST = 76
"""The lock was lost while the command ran; the command was stopped."""
EXIT_UNAVAILABLE = 69
"""PostgreSQL could not be used (unreachable, table missing, privilege missing): EX_UNAVAILABLE."""
EXIT_USAGE = 2
"""Bad arguments."""


class _UsageError(Exception):
    """A mistake on the command line: one line, exit 2."""


def _say(message: str, stream: TextIO | None = None) -> None:
    print(f"postgres-mutex: {message}", file=stream or sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    """argparse, with errors as one line (and a pointer to --help) instead of the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _seconds(argument: str) -> Callable[[str], float]:
    """A number of seconds on the command line: finite, positive (zero allowed for --timeout).

    Ranges (thresholds that must nest, upper bounds) are the library's to
    check; its messages are put in the flags' words by `_in_cli_words`.
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


# The library names its arguments; a user of the command knows the flags.
_FLAG_WORDS = [
    (re.compile(r"\bcall create_schema\(\) or create it\b"), "run 'postgres-mutex init', or create it"),
    (re.compile(r"\bcreate_schema\(\)"), "'postgres-mutex init'"),
    (re.compile(r"\bLockTable\.migrate\(\)(?: \(or 'postgres-mutex migrate'\))?"), "'postgres-mutex migrate'"),
    (
        re.compile(r"\bLockTable\.migrate\(history=True\)(?: \(or 'postgres-mutex migrate --history'\))?"),
        "'postgres-mutex migrate --history'",
    ),
    (re.compile(r"^history_retention must be"), "--history-retention must be"),
    (re.compile(r"\bpass blocking=True\b"), "pass --wait"),
    (re.compile(r"\bdrop timeout\b"), "drop --timeout"),
    (
        re.compile(r"^dsn is not a valid connection string"),
        "the connection string (--dsn or POSTGRES_MUTEX_DSN) is not valid",
    ),
    (re.compile(r"^table must be"), "--table must be"),
    (re.compile(r"^timeout must be"), "--timeout must be"),
    *(
        (re.compile(rf"\b{name}\b"), flag)
        for name, flag in (
            ("lock_name", "--lock"),
            ("instance_id", "--instance-id"),
            ("heartbeat_interval", "--heartbeat-interval"),
            ("alert_threshold", "--alert-threshold"),
            ("stale_threshold", "--stale-threshold"),
            ("operation_timeout", "--operation-timeout"),
            ("lock_names", "--lock"),
        )
    ),
]


def _in_cli_words(message: str) -> str:
    for pattern, words in _FLAG_WORDS:
        message = pattern.sub(words, message)
    return message


def _exit_code(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 255:
        raise argparse.ArgumentTypeError(f"exit codes are 0 to 255, got {value}")
    return value


def _dsn(args: argparse.Namespace) -> str:
    # An empty string lets libpq take everything from PG* variables and .pgpass.
    return str(args.dsn or os.environ.get("POSTGRES_MUTEX_DSN", ""))


# -- run ----------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    from . import Mutex
    from ._supervisor import Supervisor

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise _UsageError("run needs a command after --, e.g. postgres-mutex run --lock job -- ./job.sh")
    if args.timeout is not None and not args.wait and not args.restart:
        raise _UsageError("--timeout applies only to a wait: pass --wait, or drop --timeout")
    # A lost lock is declared one heartbeat interval before anyone may reclaim
    # it: the command must be gone (SIGKILL included) within that interval.
    kill_after = args.heartbeat_interval / 2 if args.kill_after is None else args.kill_after
    if kill_after >= args.heartbeat_interval:
        raise _UsageError(
            f"--kill-after ({kill_after:g}s) must be shorter than --heartbeat-interval "
            f"({args.heartbeat_interval:g}s): the command must be gone before anyone may reclaim the lock"
        )
    if args.restart:
        return _run_restarting(args, command, kill_after)
    lost = threading.Event()
    # Until the command runs, SIGTERM or SIGHUP ends the wait cleanly (nothing left in the table).
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    mutex = Mutex(
        _dsn(args),
        args.lock,
        table=args.table,
        instance_id=args.instance_id,
        on_lost=lambda error: lost.set(),
        heartbeat_interval=args.heartbeat_interval,
        alert_threshold=args.alert_threshold,
        stale_threshold=args.stale_threshold,
        operation_timeout=args.operation_timeout,
    )
    try:
        holding = mutex.acquire(blocking=args.wait, timeout=args.timeout)
        try:
            acquired = holding.__enter__()
        except LockAcquisitionTimeout as exc:
            _say(f"lock {args.lock!r} still held by {exc.holder or 'another instance'} after {args.timeout:g}s")
            return int(args.conflict_exit_code)
        if not acquired:
            _say(f"lock {args.lock!r} is held by {mutex.last_holder or 'another instance'}; not running")
            return int(args.conflict_exit_code)
        # The command does not need our connection string (nor its password);
        # it gets the hold's fencing token, to pass on to what it writes to.
        env = {key: value for key, value in os.environ.items() if key != "POSTGRES_MUTEX_DSN"}
        if mutex.token is not None:
            env["POSTGRES_MUTEX_TOKEN"] = str(mutex.token)
        supervisor = Supervisor(command, env=env, lock_lost=lambda: lost.is_set() or not mutex.held)
        try:
            code, lost_it = supervisor.run(kill_after, _say)
        except BaseException:
            holding.__exit__(*sys.exc_info())
            raise
        try:
            holding.__exit__(None, None, None)
        except LockNotHeldError:
            lost_it = True
        except DatabaseError as exc:
            _say(f"the lock's row could not be deleted ({exc})")
        if lost_it:
            _say(f"lost lock {args.lock!r} while the command ran; exiting {args.lost_exit_code}")
            return int(args.lost_exit_code)
        return code
    finally:
        mutex.close()


class CommandError(Exception):
    """The command exited non-zero under --restart: the election backs off before campaigning again."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the command exited with status {code}")


class _WithoutTraceback(logging.Filter):
    """The election logs a failed ``lead`` with its traceback; a command's exit status needs none."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], CommandError):
            record.exc_info = None
            record.exc_text = None
        return True


def _run_restarting(args: argparse.Namespace, command: list[str], kill_after: float) -> int:
    """``run --restart``: keep the command running on exactly one of the runners, through an `Election`.

    Each term runs the command once: a lost lock stops it (as without
    --restart) and the runner campaigns again; a command that exits is run
    again, at once after status 0 (once another runner had its chance), after
    a back-off otherwise. SIGTERM, SIGINT or SIGHUP is passed to a running
    command; the runner then stops campaigning, releases the lock as soon as
    the command is gone, and exits: with the command's status, or 128+N if no
    command was running.
    """
    from ._supervisor import FORWARDED, Supervisor
    from .election import Election, Leadership

    if args.timeout is not None:
        raise _UsageError("--restart campaigns until the runner is stopped: drop --timeout")
    election = Election(
        _dsn(args),
        args.lock,
        table=args.table,
        instance_id=args.instance_id,
        heartbeat_interval=args.heartbeat_interval,
        alert_threshold=args.alert_threshold,
        stale_threshold=args.stale_threshold,
        operation_timeout=args.operation_timeout,
        failure_backoff=args.restart_delay,
        max_failure_backoff=max(args.restart_delay, _MAX_RESTART_DELAY),
    )
    signals: list[int] = []
    status: list[int] = []  # the last command's, if a signal came while it ran

    def stop(signum: int, frame: FrameType | None) -> None:
        signals.append(signum)
        election.stop()

    def lead(leadership: Leadership) -> None:
        # The command does not need our connection string (nor its password);
        # it gets the term's fencing token, to pass on to what it writes to.
        env = {key: value for key, value in os.environ.items() if key != "POSTGRES_MUTEX_DSN"}
        if leadership.token is not None:
            env["POSTGRES_MUTEX_TOKEN"] = str(leadership.token)
        token = "" if leadership.token is None else f" (token {leadership.token})"
        _say(f"holding lock {args.lock!r}{token}: running the command")
        supervisor = Supervisor(command, env=env, lock_lost=leadership.ended.is_set)
        code, lost_it = supervisor.run(kill_after, _say)
        if supervisor.received:
            signals.extend(supervisor.received)
            status.append(code)
            election.stop()
        elif lost_it:
            _say(f"lost lock {args.lock!r} while the command ran; waiting for the lock again")
        elif code != 0:
            raise CommandError(code)
        else:
            _say("the command exited with status 0; running it again once this runner holds the lock again")

    quiet = _WithoutTraceback()
    logger.addFilter(quiet)
    previous = {signum: signal.signal(signum, stop) for signum in FORWARDED}
    try:
        election.run(lead)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        logger.removeFilter(quiet)
        election.close()
    if status:
        return status[-1]
    first = signals[0] if signals else int(signal.SIGTERM)
    _say(f"stopped by signal {signal.Signals(first).name}")
    return 128 + first


_MAX_RESTART_DELAY = 60.0
"""The longest back-off between restarts of a command that keeps failing."""


class _Interrupted(BaseException):
    """SIGTERM or SIGHUP before the command started: unwind like Ctrl-C, releasing everything."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(signum)


# -- status, init, migrate, release ----------------------------------------------------


def _table(args: argparse.Namespace) -> LockTable:
    return LockTable(_dsn(args), table=args.table, operation_timeout=args.operation_timeout)


def _cmd_status(args: argparse.Namespace) -> int:
    if not args.alert_threshold < args.stale_threshold:
        raise _UsageError("--alert-threshold must be shorter than --stale-threshold")
    observations = _table(args).holders(
        args.lock or None, alert_threshold=args.alert_threshold, stale_threshold=args.stale_threshold
    )
    rows = [
        {
            "lock_name": seen.lock_name,
            "holder": seen.holder,
            "held_for_seconds": round(seen.seconds_held, 3),
            "seconds_since_heartbeat": round(seen.seconds_since_heartbeat, 3),
            "state": "reclaimable" if seen.reclaimable else "alerting" if seen.alerting else "ok",
            "token": seen.token,
        }
        for seen in observations
    ]
    if args.json:
        json.dump(
            {
                "table": args.table,
                "alert_threshold": args.alert_threshold,
                "stale_threshold": args.stale_threshold,
                "locks": rows,
            },
            sys.stdout,
            indent=2,
        )
        print()
        return 0
    if not rows:
        print(f"no lock is held in table {args.table}")
        return 0
    table: list[tuple[str, ...]] = [("LOCK", "HOLDER", "HELD FOR", "SINCE HEARTBEAT", "STATE", "TOKEN")]
    table += [
        (
            str(row["lock_name"]),
            str(row["holder"]),
            _duration(float(row["held_for_seconds"])),  # type: ignore[arg-type]
            _duration(float(row["seconds_since_heartbeat"])),  # type: ignore[arg-type]
            str(row["state"]),
            "-" if row["token"] is None else str(row["token"]),
        )
        for row in rows
    ]
    _print_columns(table)
    return 0


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _history_retention(args: argparse.Namespace) -> float | None:
    if args.history_retention is not None and not args.history:
        raise _UsageError("--history-retention applies to a history: pass --history with it")
    return args.history_retention  # type: ignore[no-any-return]


def _cmd_init(args: argparse.Namespace) -> int:
    table = _table(args)
    tokens = table.create(history=args.history, history_retention=_history_retention(args))
    print(
        f"table {table.name} is ready"
        + (" with its history" if args.history else "")
        + ("" if tokens else " (without fencing tokens: run 'postgres-mutex migrate')")
    )
    return 0


def _cmd_migrate(args: argparse.Namespace) -> int:
    table = _table(args)
    changed = table.migrate(history=args.history, history_retention=_history_retention(args))
    what = "fencing tokens and a history" if args.history else "fencing tokens"
    print(f"table {table.name} {'now has' if changed else 'already had'} {what}")
    return 0


_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _since(text: str) -> datetime | timedelta:
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _cmd_history(args: argparse.Namespace) -> int:
    records = _table(args).history(args.lock, since=args.since, limit=args.limit)
    if args.json:
        json.dump(
            {
                "table": args.table,
                "holds": [
                    {
                        "lock_name": record.lock_name,
                        "token": record.token,
                        "holder": record.holder,
                        "acquired_at": record.acquired_at.isoformat(),
                        "ended_at": None if record.ended_at is None else record.ended_at.isoformat(),
                        "ended_how": record.ended_how,
                        "ended_by": record.ended_by,
                        "held_for_seconds": round(record.held_for, 3),
                        "alerts": record.alerts,
                    }
                    for record in records
                ],
            },
            sys.stdout,
            indent=2,
        )
        print()
        return 0
    if not records:
        about = f" for lock {args.lock!r}" if args.lock else ""
        print(f"no hold recorded in the history of table {args.table}{about}")
        return 0
    lines: list[tuple[str, ...]] = [("LOCK", "TOKEN", "HOLDER", "ACQUIRED (UTC)", "HELD FOR", "ENDED", "ALERTS")]
    for record in records:
        ended = record.ended_how or "holding"
        if record.ended_by is not None:
            ended += f" by {record.ended_by}"
        lines.append(
            (
                record.lock_name,
                "-" if record.token is None else str(record.token),
                record.holder,
                record.acquired_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"),
                _duration(record.held_for),
                ended,
                str(record.alerts),
            )
        )
    _print_columns(lines)
    return 0


def _print_columns(lines: list[tuple[str, ...]]) -> None:
    widths = [max(len(line[column]) for line in lines) for column in range(len(lines[0]))]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


def _cmd_release(args: argparse.Namespace) -> int:
    if not args.force:
        raise _UsageError(
            f"refusing to release lock {args.name!r} without --force: its holder may still be running. "
            "Use it only when you know the holder is gone"
        )
    removed = _table(args).force_release(args.name)
    if removed is None:
        print(f"lock {args.name!r} is not held: nothing to release")
        return 1
    token = "" if removed.token is None else f", token {removed.token}"
    print(
        f"released lock {args.name!r}, held by {removed.holder}{token} "
        f"(last heartbeat {_duration(removed.seconds_since_heartbeat)} ago)"
    )
    return 0


# -- watch ------------------------------------------------------------------------


def _cmd_watch(args: argparse.Namespace) -> int:
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise _UsageError("watch needs prometheus-client: pip install 'postgres-mutex[prometheus]'") from None
    from .prometheus import PrometheusMetrics
    from .watcher import StaleWatcher

    host, _, port_text = args.listen.rpartition(":")
    if not host or not port_text.isdecimal() or not port_text.isascii() or int(port_text) > 65535:
        raise _UsageError(f"--listen must be HOST:PORT with a port from 0 to 65535, got {args.listen!r}")
    if not args.alert_threshold < args.stale_threshold:
        raise _UsageError("--alert-threshold must be shorter than --stale-threshold")
    registry = CollectorRegistry()
    watcher = StaleWatcher(
        _dsn(args),
        table=args.table,
        lock_names=args.lock or None,
        alert_threshold=args.alert_threshold,
        stale_threshold=args.stale_threshold,
        interval=args.interval,
        operation_timeout=args.operation_timeout,
        metrics=PrometheusMetrics(registry),
    )
    try:
        server, thread = start_http_server(int(port_text), addr=host, registry=registry)
    except OSError as exc:
        raise _UsageError(f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}
    _say(f"watching table {args.table} every {args.interval:g}s; metrics on http://{args.listen}/metrics")
    watcher.start()
    try:
        stop.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        watcher.close()
        server.shutdown()
        thread.join(5)
    return 0


# -- the parser ---------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    connection = _Parser(add_help=False)
    group = connection.add_argument_group("connection")
    group.add_argument(
        "--dsn",
        help="libpq connection string (default: $POSTGRES_MUTEX_DSN, else libpq's PG* variables and .pgpass)",
    )
    group.add_argument("--table", default="mutex_lock", help="lock table, optionally schema-qualified")
    group.add_argument(
        "--operation-timeout",
        type=_seconds("--operation-timeout"),
        help="deadline of each database statement, seconds (default: the library's: 5, or less for short thresholds)",
    )
    group.add_argument("-v", "--verbose", action="store_true", help="log what the library does")

    thresholds = _Parser(add_help=False)
    group = thresholds.add_argument_group("thresholds (seconds)")
    group.add_argument("--heartbeat-interval", type=_seconds("--heartbeat-interval"), default=10.0)
    group.add_argument("--alert-threshold", type=_seconds("--alert-threshold"), default=30.0)
    group.add_argument("--stale-threshold", type=_seconds("--stale-threshold"), default=600.0)

    parser = _Parser(
        prog="postgres-mutex",
        description="A distributed mutex on the PostgreSQL you already run.",
        epilog="Run 'postgres-mutex COMMAND --help' for each command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")

    def add(name: str, summary: str, examples: str, parents: Sequence[_Parser]) -> _Parser:
        sub: _Parser = commands.add_parser(
            name,
            help=summary,
            description=summary,
            epilog="examples:\n" + examples,
            parents=list(parents),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        return sub

    run = add(
        "run",
        "Run a command while holding a lock; release it when the command ends.",
        "  postgres-mutex run --lock nightly-report -- ./report.sh --full\n"
        "  postgres-mutex run --lock nightly-report --wait --timeout 300 -- ./report.sh\n"
        "  postgres-mutex run --lock scheduler --wait --restart -- ./scheduler  # one active replica\n\n"
        "exit codes:\n"
        "  the command's own (128+N if it died of signal N)\n"
        f"  {EXIT_BUSY}   the lock is held elsewhere (or --wait --timeout ran out); see --conflict-exit-code\n"
        f"  {EXIT_LOST}   the lock was lost while the command ran; the command was stopped; see --lost-exit-code\n"
        f"  {EXIT_UNAVAILABLE}   PostgreSQL could not be used (unreachable, table missing, no privilege)\n"
        f"  {EXIT_USAGE}    bad arguments\n"
        "  126/127 the command could not be run / was not found\n"
        "  with --restart: the running command's status once the runner is stopped by a signal, "
        "else 128+N (signal N)",
        [connection, thresholds],
    )
    run.add_argument("--lock", required=True, help="the lock's name (1 to 64 characters)")
    run.add_argument("--wait", action="store_true", help="wait for the lock instead of giving up at once")
    run.add_argument("--timeout", type=_seconds("--timeout"), help="with --wait: give up after this many seconds")
    run.add_argument(
        "--conflict-exit-code",
        type=_exit_code,
        default=EXIT_BUSY,
        help=f"exit code when the lock is busy (default {EXIT_BUSY}), like flock's -E",
    )
    run.add_argument(
        "--lost-exit-code",
        type=_exit_code,
        default=EXIT_LOST,
        help=f"exit code when the lock is lost while the command runs (default {EXIT_LOST})",
    )
    run.add_argument(
        "--kill-after",
        type=_seconds("--kill-after"),
        help="after a lost lock: seconds between SIGTERM and SIGKILL "
        "(default half the heartbeat interval; must be shorter than it)",
    )
    run.add_argument(
        "--restart",
        action="store_true",
        help="keep the command running on exactly one of the runners of this lock: wait for the lock (implies "
        "--wait), run the command, and when it exits or loses the lock, wait for the lock and run it again; "
        "until the runner gets SIGTERM, SIGINT or SIGHUP",
    )
    run.add_argument(
        "--restart-delay",
        type=_seconds("--restart-delay"),
        default=1.0,
        help="with --restart: seconds before running a command that exited non-zero again, "
        f"doubling after each failure in a row up to {_MAX_RESTART_DELAY:g}s (default 1); each runner's own: "
        "while it waits, another runner may take the lock and run the command",
    )
    run.add_argument("--instance-id", help="this holder's id in the table (default: <hostname>-<random>)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    run.set_defaults(handler=_cmd_run)

    status = add(
        "status",
        "Show every held lock: holder, held for, seconds since heartbeat, state (server clock).",
        "  postgres-mutex status\n  postgres-mutex status --json | jq '.locks[] | select(.state != \"ok\")'",
        [connection],
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--lock", action="append", help="only this lock (repeatable)")
    status.add_argument("--alert-threshold", type=_seconds("--alert-threshold"), default=30.0)
    status.add_argument("--stale-threshold", type=_seconds("--stale-threshold"), default=600.0)
    status.set_defaults(handler=_cmd_status)

    watch = add(
        "watch",
        "Run the stale-holder watcher and serve its Prometheus metrics until stopped.",
        "  postgres-mutex watch --listen 127.0.0.1:9464\n  postgres-mutex watch --interval 2 --alert-threshold 60",
        [connection],
    )
    watch.add_argument("--listen", default="127.0.0.1:9464", help="HOST:PORT for /metrics (default 127.0.0.1:9464)")
    watch.add_argument("--interval", type=_seconds("--interval"), default=5.0, help="seconds between reads")
    watch.add_argument("--lock", action="append", help="only this lock (repeatable)")
    watch.add_argument("--alert-threshold", type=_seconds("--alert-threshold"), default=30.0)
    watch.add_argument("--stale-threshold", type=_seconds("--stale-threshold"), default=600.0)
    watch.set_defaults(handler=_cmd_watch)

    history_options = _Parser(add_help=False)
    group = history_options.add_argument_group("history")
    group.add_argument("--history", action="store_true", help="also keep a history of every hold (<table>_history)")
    group.add_argument(
        "--history-retention",
        type=_seconds("--history-retention"),
        help="with --history: seconds a hold stays in the history after it ended (default 30 days)",
    )

    init = add(
        "init",
        "Create the lock table if it does not exist.",
        "  postgres-mutex init\n  postgres-mutex init --history --history-retention 604800",
        [connection, history_options],
    )
    init.set_defaults(handler=_cmd_init)

    migrate = add(
        "migrate",
        "Add fencing tokens (and, with --history, a history) to a lock table; online, idempotent, as its owner.",
        "  postgres-mutex migrate\n  postgres-mutex migrate --table ops.mutex_lock\n  postgres-mutex migrate --history",
        [connection, history_options],
    )
    migrate.set_defaults(handler=_cmd_migrate)

    history = add(
        "history",
        "Show the holds the history recorded, newest first: who held a lock, when, and how it ended.",
        "  postgres-mutex history --lock ledger-sync --since 2026-12-02T03:00\n"
        "  postgres-mutex history --since 2h --json | jq '.holds[] | select(.ended_how == \"reclaimed\")'",
        [connection],
    )
    history.add_argument("--lock", help="only this lock")
    history.add_argument(
        "--since", type=_since, help="holds not ended by then: an ISO 8601 moment, or an age (90s, 15m, 2h, 7d)"
    )
    history.add_argument("--limit", type=_positive_int, default=100, help="at most this many holds (default 100)")
    history.add_argument("--json", action="store_true", help="machine-readable output")
    history.set_defaults(handler=_cmd_history)

    release = add(
        "release",
        "Remove a lock's row whoever holds it: for an operator who knows the holder is gone.",
        "  postgres-mutex release nightly-report --force",
        [connection],
    )
    release.add_argument("name", help="the lock's name")
    release.add_argument("--force", action="store_true", help="required: confirms the holder is gone")
    release.set_defaults(handler=_cmd_release)

    demo = add(
        "demo",
        "Watch a fleet contend, crash, alert and recover, on a throwaway PostgreSQL (or --dsn).",
        "  postgres-mutex demo\n  postgres-mutex demo --dsn postgresql://localhost/scratch",
        [],
    )
    demo.add_argument("--dsn", help="use this server instead of a throwaway one")
    demo.add_argument("--workers", type=int, default=3, choices=range(2, 9), metavar="N", help="2 to 8 (default 3)")
    demo.add_argument("-v", "--verbose", action="store_true", help=argparse.SUPPRESS)
    demo.set_defaults(handler=_cmd_demo, table="mutex_lock", operation_timeout=None)
    return parser


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import DemoError, run_demo

    try:
        return run_demo(dsn=args.dsn, workers=args.workers)
    except DemoError as exc:
        raise _UsageError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``postgres-mutex`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    # Commands that run on (run, watch) report retries and alerts as they happen;
    # one-shot commands end in one error line, which those warnings would only repeat.
    quiet = logging.WARNING if args.subcommand in ("run", "watch") else logging.ERROR
    logging.basicConfig(
        level=logging.INFO if args.verbose else quiet,
        format="postgres-mutex: %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    started = time.monotonic()
    try:
        return int(args.handler(args))
    except _UsageError as exc:
        _say(f"error: {exc}")
        return EXIT_USAGE
    except (ValueError, TypeError) as exc:
        # The library's own validation: it names the argument, which is a flag here.
        _say(f"error: {_in_cli_words(str(exc))}")
        return EXIT_USAGE
    except DatabaseError as exc:
        _say(f"error: {_in_cli_words(str(exc))}")
        return EXIT_UNAVAILABLE
    except MutexError as exc:
        _say(f"error: {_in_cli_words(str(exc))}")
        return 1
    except KeyboardInterrupt:
        _say(f"interrupted after {time.monotonic() - started:.1f}s")
        return 128 + signal.SIGINT
    except _Interrupted as exc:
        _say(f"stopped by signal {signal.Signals(exc.signum).name} after {time.monotonic() - started:.1f}s")
        return 128 + exc.signum
