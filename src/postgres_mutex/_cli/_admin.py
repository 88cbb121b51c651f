"""The operator's subcommands: ``status``, ``init``, ``migrate``, ``history``, ``release``, ``permits``, ``watch``."""

from __future__ import annotations

import argparse
import difflib
import json
import queue
import signal
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ..table import HoldRecord, LockTable
from ._common import UsageError, dsn, duration, print_columns, say

if TYPE_CHECKING:
    from .. import LockObservation


def _table(args: argparse.Namespace) -> LockTable:
    return LockTable(dsn(args), table=args.table, operation_timeout=args.operation_timeout)


def _check_thresholds(args: argparse.Namespace) -> None:
    if not args.alert_threshold < args.stale_threshold:
        raise UsageError("--alert-threshold must be shorter than --stale-threshold")


def cmd_status(args: argparse.Namespace) -> int:
    _check_thresholds(args)
    observations = _table(args).holders(
        args.lock or None, alert_threshold=args.alert_threshold, stale_threshold=args.stale_threshold
    )
    rows = [
        {
            "lock_name": seen.lock_name,
            "holder": seen.holder,
            "held_for_seconds": round(seen.seconds_held, 3),
            "seconds_since_heartbeat": round(seen.seconds_since_heartbeat, 3),
            "state": _state(seen),
            "held_until": None if seen.held_until is None else _moment(seen.held_until),
            "token": seen.token,
            "session": _session(seen),
            "reclaim_disconnected_after": seen.reclaim_disconnected_after,
            "semaphore": seen.semaphore,
            "permit": seen.permit,
            "rwlock": seen.rwlock,
            "mode": seen.mode,
        }
        for seen in observations
    ]
    if args.json:
        shown = {
            "table": args.table,
            "alert_threshold": args.alert_threshold,
            "stale_threshold": args.stale_threshold,
            "locks": rows,
        }
        json.dump(shown, sys.stdout, indent=2)
        print()
        return 0
    if not rows:
        if not args.lock:
            print(f"no lock is held in table {args.table}")
        for name in args.lock or ():
            print(f"no lock named {name!r} is held in table {args.table}{_similar(name, args)}")
        return 0
    lines: list[tuple[str, ...]] = [("LOCK", "HOLDER", "HELD FOR", "SINCE HEARTBEAT", "STATE", "TOKEN", "SESSION")]
    lines += [
        (
            _shown(seen),
            seen.holder,
            duration(round(seen.seconds_held, 3)),
            duration(round(seen.seconds_since_heartbeat, 3)),
            str(row["state"]) if seen.held_until is None else f"released, held until {row['held_until']}",
            "-" if seen.token is None else str(seen.token),
            str(row["session"] or "-"),
        )
        for seen, row in zip(observations, rows, strict=True)
    ]
    print_columns(lines)
    return 0


def _state(seen: LockObservation) -> str:
    """What ``status`` says of a hold: ok, alerting, reclaimable, or released (before its minimum hold ended)."""
    if seen.held_until is not None:
        return "released"
    return "reclaimable" if seen.reclaimable else "alerting" if seen.alerting else "ok"


def _moment(when: datetime) -> str:
    """A moment by the server's clock, in UTC to the second: what an operator compares with ``date -u``."""
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _similar(name: str, args: argparse.Namespace) -> str:
    """The names held in the table that are close to ``name`` (a typo, most likely), as the end of a line."""
    held = {seen.name for seen in _table(args).holders()}
    close = difflib.get_close_matches(name, sorted(held), n=3)
    return f"; held with a similar name: {', '.join(map(repr, close))}" if close else ""


def _shown(held: LockObservation | HoldRecord) -> str:
    """A row as an operator names it: the lock, a semaphore and its permit, or a read/write lock and its mode."""
    if held.semaphore is not None:
        return f"{held.semaphore} (permit {held.permit})"
    if held.rwlock is not None:
        return f"{held.rwlock} ({held.mode})"
    return held.lock_name


def _session(seen: LockObservation) -> str | None:
    """What ``status`` says of a holder's session: alive, ended, unknown (it opted in behind a pooler), or None
    (it did not opt in to ``reclaim_disconnected_after``)."""
    if seen.session_alive is not None:
        return "alive" if seen.session_alive else "ended"
    return None if seen.reclaim_disconnected_after is None else "unknown"


def _history_retention(args: argparse.Namespace) -> float | None:
    if args.history_retention is not None and not args.history:
        raise UsageError("--history-retention applies to a history: pass --history with it")
    return args.history_retention  # type: ignore[no-any-return]


def _integrations(args: argparse.Namespace) -> dict[str, bool | str]:
    return {"celery_beat": args.celery_beat, "apscheduler": args.apscheduler}


def _integrations_ready(args: argparse.Namespace) -> None:
    for flag, value, default in (
        ("Celery beat", args.celery_beat, "celery_beat_state"),
        ("APScheduler", args.apscheduler, "mutex_apscheduler_runs"),
    ):
        if value is not False:
            print(f"the {flag} table {default if value is True else value} is ready")


def cmd_init(args: argparse.Namespace) -> int:
    table = _table(args)
    tokens = table.create(history=args.history, history_retention=_history_retention(args), **_integrations(args))
    print(
        f"table {table.name} is ready"
        + (" with its history" if args.history else "")
        + ("" if tokens else " (without fencing tokens: run 'postgres-mutex migrate')")
    )
    _integrations_ready(args)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    table = _table(args)
    changed = table.migrate(history=args.history, history_retention=_history_retention(args), **_integrations(args))
    what = "fencing tokens and a history" if args.history else "fencing tokens"
    print(f"table {table.name} {'now has' if changed else 'already had'} {what}")
    _integrations_ready(args)
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    records = _table(args).history(args.lock, since=args.since, limit=args.limit)
    if args.json:
        holds = [
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
                "semaphore": record.semaphore,
                "permit": record.permit,
                "rwlock": record.rwlock,
                "mode": record.mode,
            }
            for record in records
        ]
        json.dump({"table": args.table, "holds": holds}, sys.stdout, indent=2)
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
                _shown(record),
                "-" if record.token is None else str(record.token),
                record.holder,
                record.acquired_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"),
                duration(record.held_for),
                ended,
                str(record.alerts),
            )
        )
    print_columns(lines)
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    if not args.force:
        raise UsageError(
            f"refusing to release {args.name!r} without --force: its holder may still be running. "
            "Use it only when you know the holder is gone"
        )
    table = _table(args)
    removed = table.force_release(args.name, permit=args.permit, writer=args.writer, reader=args.reader)
    if args.permit is not None:
        what = f"permit {args.permit} of semaphore {args.name!r}"
    elif args.writer:
        what = f"the writer of read/write lock {args.name!r}"
    elif args.reader is not None:
        what = f"reader {args.reader!r} of read/write lock {args.name!r}"
    else:
        what = f"lock {args.name!r}"
    if removed is None:
        holders = table.holders([args.name])
        if holders:
            print(f"{what} is not held: nothing to release")
            _say_holders(holders, args.name)
        else:
            similar = _similar(args.name, args)
            print(f"no lock named {args.name!r} is held in table {table.name}: nothing to release{similar}")
        return 1
    token = "" if removed.token is None else f", token {removed.token}"
    print(
        f"released {what}, held by {removed.holder}{token} "
        f"(last heartbeat {duration(removed.seconds_since_heartbeat)} ago)"
    )
    return 0


def cmd_permits(args: argparse.Namespace) -> int:
    table = _table(args)
    if not args.force:
        # An operator's check, not a guarantee (a permit may be taken meanwhile): the change itself
        # releases whoever holds a permit at or above N when it runs.
        above = sorted(
            seen.permit
            for seen in table.holders([args.name])
            if seen.semaphore == args.name and seen.permit is not None and seen.permit >= args.permits
        )
        if above:
            raise UsageError(
                f"refusing to change semaphore {args.name!r} to {args.permits} permits without --force: "
                f"permits {', '.join(map(str, above))} are held, and their holders would be released"
            )
    changed = table.set_permits(args.name, args.permits)
    was = "" if changed.previous is None else f" (was {changed.previous})"
    released = f"; released {changed.released} holder{'s' * (changed.released != 1)}" if changed.released else ""
    print(f"semaphore {args.name!r} now allows {changed.permits} at once{was}{released}")
    return 0


def _say_holders(holders: list[LockObservation], name: str) -> None:
    """The holders a release of NAME alone does not free: a semaphore's and a read/write lock's go one at a
    time, the operator's choice; say which there are and how to name one."""
    status = f"postgres-mutex status --lock {name} shows who holds which"
    permits = sorted(seen.permit for seen in holders if seen.permit is not None)
    if permits:
        print(
            f"semaphore {name!r} has holders of permits {', '.join(map(str, permits))}: release one "
            f"with --permit {permits[0]} ({status})"
        )
    rw = [seen for seen in holders if seen.rwlock is not None]
    if any(seen.mode == "write" for seen in rw):
        print(f"read/write lock {name!r} has a writer: release it with --writer ({status})")
    readers = sorted(seen.holder for seen in rw if seen.mode == "read")
    if readers:
        print(
            f"read/write lock {name!r} has readers {', '.join(readers)}: release one with --reader {readers[0]} "
            f"({status})"
        )


def cmd_watch(args: argparse.Namespace) -> int:
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise UsageError("watch needs prometheus-client: pip install 'postgres-mutex[prometheus]'") from None
    from ..prometheus import PrometheusMetrics
    from ..watcher import StaleWatcher

    host, _, port_text = args.listen.rpartition(":")
    if not host or not port_text.isdecimal() or not port_text.isascii() or int(port_text) > 65535:
        raise UsageError(f"--listen must be HOST:PORT with a port from 0 to 65535, got {args.listen!r}")
    _check_thresholds(args)
    registry = CollectorRegistry()
    watcher = StaleWatcher(
        dsn(args),
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
        raise UsageError(f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
    # The handler may run at any point of this thread, inside a wait included: a `threading.Event`
    # set there would wait for the lock its own `wait` holds, for good. A SimpleQueue's `put` and
    # `get` are single C calls, safe to interleave, and a signal that came first waits in the queue.
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()
    previous = {
        signum: signal.signal(signum, lambda received, _: signals.put(received))
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    say(f"watching table {args.table} every {args.interval:g}s; metrics on http://{args.listen}/metrics")
    watcher.start()
    try:
        signals.get()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        watcher.close()
        server.shutdown()
        thread.join(5)
    return 0
