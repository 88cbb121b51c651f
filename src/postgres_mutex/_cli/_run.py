"""``postgres-mutex run``: a command under a lock (flock(1) for a fleet), a semaphore's permit, or a read/write
lock's mode; and ``--restart``: one running copy."""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from ..election import Election, Leadership
from ..errors import DatabaseError, LockAcquisitionTimeout, LockNotHeldError
from ..mutex import Mutex
from ..rwlock import RWLock
from ..semaphore import Semaphore
from ._common import MAX_RESTART_DELAY, UsageError, command_env, dsn, duration, say
from ._supervisor import FORWARDED, Supervisor

logger = logging.getLogger("postgres_mutex")


class Interrupted(BaseException):
    """SIGTERM or SIGHUP before the command started: unwind like Ctrl-C, releasing everything."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("run needs a command after --, e.g. postgres-mutex run --lock job -- ./job.sh")
    mode = "read" if args.read else "write" if args.write else None
    if mode is not None and args.permits is not None:
        raise UsageError(f"--{mode} makes --lock a read/write lock, --permits a semaphore: pass one of them, not both")
    if args.timeout is not None and not args.restart:
        args.wait = True  # a timeout says how long to wait: given alone, it asks for the wait (as flock -w does)
    # A lost lock is declared one heartbeat interval before anyone may reclaim
    # it: the command must be gone (SIGKILL included) within that interval.
    kill_after = args.heartbeat_interval / 2 if args.kill_after is None else args.kill_after
    if kill_after >= args.heartbeat_interval:
        raise UsageError(
            f"--kill-after ({kill_after:g}s) must be shorter than --heartbeat-interval "
            f"({args.heartbeat_interval:g}s): the command must be gone before anyone may reclaim the lock"
        )
    if args.hold_at_least is not None and (args.restart or args.permits is not None or mode is not None):
        other = "--restart" if args.restart else "--permits" if args.permits is not None else f"--{mode}"
        raise UsageError(f"--hold-at-least is a plain lock's minimum hold: it does not take {other}")
    if args.restart:
        if args.permits is not None:
            raise UsageError("--restart keeps one copy running: it does not take --permits")
        if mode is not None:
            raise UsageError(f"--restart keeps one copy running under a lock of its own: it does not take --{mode}")
        return _run_restarting(args, command, kill_after)
    lost = threading.Event()
    # Until the command runs, SIGTERM or SIGHUP ends the wait cleanly (nothing left in the table).
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    options = {
        "table": args.table,
        "instance_id": args.instance_id,
        "on_lost": lambda error: lost.set(),
        "heartbeat_interval": args.heartbeat_interval,
        "alert_threshold": args.alert_threshold,
        "stale_threshold": args.stale_threshold,
        "operation_timeout": args.operation_timeout,
        "reclaim_disconnected_after": args.reclaim_disconnected_after,
    }
    narrator = _Narrator(args)
    options["metrics"] = narrator
    mutex: Mutex | Semaphore | RWLock
    if mode is not None:
        mutex = RWLock(dsn(args), args.lock, **options)
        acquire = mutex.read if mode == "read" else mutex.write
    elif args.permits is None:
        mutex = Mutex(dsn(args), args.lock, hold_at_least=args.hold_at_least, **options)
        acquire = mutex.acquire
    else:
        mutex = Semaphore(dsn(args), args.lock, permits=args.permits, **options)
        acquire = mutex.acquire
    narrator.holder = lambda: mutex.last_holder
    try:
        holding = acquire(blocking=args.wait, timeout=args.timeout)
        try:
            acquired = holding.__enter__()
        except LockAcquisitionTimeout as exc:
            say(f"{_busy(args, exc.holder, still=True)} after {args.timeout:g}s")
            return int(args.conflict_exit_code)
        if not acquired:
            say(f"{_busy(args, mutex.last_holder)}; not running")
            return int(args.conflict_exit_code)
        if args.verbose:
            token = "" if mutex.token is None else f" (token {mutex.token})"
            say(f"holding {_what(args)}{token}: running {shlex.join(command)}")
        supervisor = Supervisor(
            command, env=command_env(mutex.token), lock_lost=lambda: lost.is_set() or not mutex.held
        )
        started = time.monotonic()
        try:
            code, lost_it = supervisor.run(kill_after, say)
        except BaseException:
            holding.__exit__(*sys.exc_info())
            raise
        try:
            holding.__exit__(None, None, None)
        except LockNotHeldError:
            lost_it = True
        except DatabaseError as exc:
            say(f"the lock's row could not be deleted ({exc})")
        if lost_it:
            say(f"lost {_what(args)} while the command ran; exiting {args.lost_exit_code}")
            return int(args.lost_exit_code)
        if args.verbose:
            took = duration(time.monotonic() - started)
            say(f"the command exited with status {code} after {took}; released {_what(args)}")
        return code
    finally:
        mutex.close()


class _Narrator:
    """What ``run`` tells a person while it waits for the lock: that it waits, for what, and who holds it.

    Said on stderr when stderr is a terminal, or with ``-v``: a job's log (stderr
    a file or a pipe) stays as it was unless asked. A metrics hook to the library,
    whose ``waiting`` is called once a blocking acquire finds the lock held.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._tell = bool(args.verbose) or sys.stderr.isatty()
        self.holder: Callable[[], str | None] = lambda: None

    def waiting(self, lock_name: str, *, instance_id: str, mode: str | None = None) -> None:
        if self._tell:
            limit = "" if self._args.timeout is None else f" up to {self._args.timeout:g}s"
            say(f"{_busy(self._args, self.holder())}; waiting{limit} for it")


def _what(args: argparse.Namespace) -> str:
    """What the runner holds, in the words of its flags: a lock, a semaphore's permit, a read/write lock's mode."""
    if args.read or args.write:
        return f"read/write lock {args.lock!r} ({'read' if args.read else 'write'})"
    if args.permits is not None:
        return f"a permit of semaphore {args.lock!r}"
    return f"lock {args.lock!r}"


def _busy(args: argparse.Namespace, holder: str | None, *, still: bool = False) -> str:
    """Why the command does not run: the lock's holder, that all of a semaphore's permits are taken, or who
    keeps a read/write lock from this mode."""
    someone = holder or "another instance"
    if args.read:
        return (
            f"read/write lock {args.lock!r} {'still' if still else 'is'} closed to readers: a writer holds it or "
            f"waits for it ({someone} among its holders)"
        )
    if args.write:
        return f"read/write lock {args.lock!r} {'still' if still else 'is'} held ({someone} among its holders)"
    if args.permits is None:
        return f"lock {args.lock!r} {'still' if still else 'is'} held by {holder or 'another instance'}"
    return (
        f"all {args.permits} permits of semaphore {args.lock!r} {'still' if still else 'are'} held "
        f"({holder or 'another instance'} among the holders)"
    )


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
    if args.timeout is not None:
        raise UsageError("--restart campaigns until the runner is stopped: drop --timeout")
    election = Election(
        dsn(args),
        args.lock,
        table=args.table,
        instance_id=args.instance_id,
        heartbeat_interval=args.heartbeat_interval,
        alert_threshold=args.alert_threshold,
        stale_threshold=args.stale_threshold,
        operation_timeout=args.operation_timeout,
        failure_backoff=args.restart_delay,
        max_failure_backoff=max(args.restart_delay, MAX_RESTART_DELAY),
        reclaim_disconnected_after=args.reclaim_disconnected_after,
    )
    signals: list[int] = []
    status: list[int] = []  # the last command's, if a signal came while it ran

    def stop(signum: int, frame: FrameType | None) -> None:
        signals.append(signum)
        election.stop()

    def lead(leadership: Leadership) -> None:
        token = "" if leadership.token is None else f" (token {leadership.token})"
        say(f"holding lock {args.lock!r}{token}: running the command")
        supervisor = Supervisor(command, env=command_env(leadership.token), lock_lost=leadership.ended.is_set)
        code, lost_it = supervisor.run(kill_after, say)
        if supervisor.received:
            signals.extend(supervisor.received)
            status.append(code)
            election.stop()
        elif lost_it:
            say(f"lost lock {args.lock!r} while the command ran; waiting for the lock again")
        elif code != 0:
            raise CommandError(code)
        else:
            say("the command exited with status 0; running it again once this runner holds the lock again")

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
    say(f"stopped by signal {signal.Signals(first).name}")
    return 128 + first
