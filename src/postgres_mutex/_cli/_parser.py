"""The ``postgres-mutex`` command's parser: every subcommand, its flags, its examples and its exit codes."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ._common import (
    EXIT_BUSY,
    EXIT_LOST,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    MAX_RESTART_DELAY,
    Parser,
    exit_code,
    permit_number,
    positive_int,
    seconds,
    since,
)


def parser() -> argparse.ArgumentParser:
    """The ``postgres-mutex`` command's arguments: each subcommand with its options, examples and exit codes."""
    connection = Parser(add_help=False)
    group = connection.add_argument_group("connection")
    group.add_argument(
        "--dsn",
        help="libpq connection string (default: $POSTGRES_MUTEX_DSN, else libpq's PG* variables and .pgpass)",
    )
    group.add_argument("--table", default="mutex_lock", help="lock table, optionally schema-qualified")
    group.add_argument(
        "--operation-timeout",
        type=seconds("--operation-timeout"),
        help="deadline of each database statement, seconds (default: the library's: 5, or less for short thresholds)",
    )
    group.add_argument("-v", "--verbose", action="store_true", help="log what the library does")

    thresholds = Parser(add_help=False)
    group = thresholds.add_argument_group("thresholds (seconds)")
    group.add_argument("--heartbeat-interval", type=seconds("--heartbeat-interval"), default=10.0)
    group.add_argument("--alert-threshold", type=seconds("--alert-threshold"), default=30.0)
    group.add_argument("--stale-threshold", type=seconds("--stale-threshold"), default=600.0)
    group.add_argument(
        "--reclaim-disconnected-after",
        type=seconds("--reclaim-disconnected-after"),
        metavar="SECONDS",
        help="let another runner take the lock this soon after this one's database session ended (it died, its "
        "connection was cut), instead of after --stale-threshold; a runner that is only slow keeps it "
        "(default: off)",
    )

    parser = Parser(
        prog="postgres-mutex",
        description="A distributed mutex on the PostgreSQL you already run.",
        epilog="Run 'postgres-mutex COMMAND --help' for each command's options and examples.",
    )
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")

    def add(name: str, summary: str, examples: str, parents: Sequence[Parser]) -> Parser:
        sub: Parser = commands.add_parser(
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
        "  postgres-mutex run --lock nightly-report --hold-at-least 60 -- ./report.sh  # once per cron tick\n"
        "  postgres-mutex run --lock scheduler --wait --restart -- ./scheduler  # one active replica\n"
        "  postgres-mutex run --lock export --permits 3 --wait -- ./export.sh  # at most 3 at once\n"
        "  postgres-mutex run --lock catalogue --read --wait -- ./serve.sh  # many readers at once\n"
        "  postgres-mutex run --lock catalogue --write --wait --timeout 600 -- ./rebuild.sh  # alone\n\n"
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
    run.add_argument(
        "--permits",
        type=positive_int,
        help="make --lock a semaphore of this many permits: at most N copies of the command run at once across "
        "the fleet (like consul lock -n); every runner of the semaphore must pass the same N",
    )
    modes = run.add_mutually_exclusive_group()
    modes.add_argument(
        "--read",
        action="store_true",
        help="make --lock a read/write lock and hold it for reading: any number of readers run at once, never "
        "beside a writer",
    )
    modes.add_argument(
        "--write",
        action="store_true",
        help="make --lock a read/write lock and hold it for writing: alone, with no reader and no other writer; "
        "while it waits (--wait), new readers wait behind it",
    )
    run.add_argument(
        "--hold-at-least",
        type=seconds("--hold-at-least"),
        metavar="SECONDS",
        help="keep the lock taken until at least this long after it was acquired, even when the command ends "
        "sooner or the runner dies: a job that cron fires on several hosts a few seconds apart then runs once "
        "(at most --stale-threshold; the table needs 'postgres-mutex migrate' if it predates 0.2.0; default: off)",
    )
    run.add_argument("--wait", action="store_true", help="wait for the lock instead of giving up at once")
    run.add_argument(
        "--timeout",
        type=seconds("--timeout"),
        help="wait up to this many seconds for the lock, then give up (implies --wait)",
    )
    run.add_argument(
        "--conflict-exit-code",
        type=exit_code,
        default=EXIT_BUSY,
        help=f"exit code when the lock is busy (default {EXIT_BUSY}), like flock's -E",
    )
    run.add_argument(
        "--lost-exit-code",
        type=exit_code,
        default=EXIT_LOST,
        help=f"exit code when the lock is lost while the command runs (default {EXIT_LOST})",
    )
    run.add_argument(
        "--kill-after",
        type=seconds("--kill-after"),
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
        type=seconds("--restart-delay"),
        default=1.0,
        help="with --restart: seconds before running a command that exited non-zero again, "
        f"doubling after each failure in a row up to {MAX_RESTART_DELAY:g}s (default 1); each runner's own: "
        "while it waits, another runner may take the lock and run the command",
    )
    run.add_argument("--instance-id", help="this holder's id in the table (default: <hostname>-<random>)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")

    status = add(
        "status",
        "Show every held lock, every holder of a semaphore (a line per permit) and of a read/write lock (a line "
        "per reader, with its mode): holder, held for, seconds since heartbeat, state (server clock).",
        "  postgres-mutex status\n  postgres-mutex status --json | jq '.locks[] | select(.state != \"ok\")'",
        [connection],
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--lock", action="append", help="only this lock, semaphore or read/write lock (repeatable)")
    status.add_argument(
        "--alert-threshold",
        type=seconds("--alert-threshold"),
        default=30.0,
        help="a holder silent this many seconds shows as 'alerting' (default 30; use your Mutexes' alert_threshold)",
    )
    status.add_argument(
        "--stale-threshold",
        type=seconds("--stale-threshold"),
        default=600.0,
        help="a holder silent this many seconds shows as 'reclaimable' (default 600; use your Mutexes' "
        "stale_threshold)",
    )

    watch = add(
        "watch",
        "Run the stale-holder watcher and serve its Prometheus metrics until stopped.",
        "  postgres-mutex watch --listen 127.0.0.1:9464\n  postgres-mutex watch --interval 2 --alert-threshold 60",
        [connection],
    )
    watch.add_argument("--listen", default="127.0.0.1:9464", help="HOST:PORT for /metrics (default 127.0.0.1:9464)")
    watch.add_argument("--interval", type=seconds("--interval"), default=5.0, help="seconds between reads")
    watch.add_argument("--lock", action="append", help="only this lock (repeatable)")
    watch.add_argument(
        "--alert-threshold",
        type=seconds("--alert-threshold"),
        default=30.0,
        help="alert on a holder silent this many seconds (default 30; use your Mutexes' alert_threshold)",
    )
    watch.add_argument(
        "--stale-threshold",
        type=seconds("--stale-threshold"),
        default=600.0,
        help="a holder silent this many seconds counts as reclaimable (default 600; use your Mutexes' stale_threshold)",
    )

    history_options = Parser(add_help=False)
    group = history_options.add_argument_group("history")
    group.add_argument("--history", action="store_true", help="also keep a history of every hold (<table>_history)")
    group.add_argument(
        "--history-retention",
        type=seconds("--history-retention"),
        help="with --history: seconds a hold stays in the history after it ended (default 30 days)",
    )

    integration_options = Parser(add_help=False)
    group = integration_options.add_argument_group("the integrations' tables (made only if missing)")
    group.add_argument(
        "--celery-beat",
        nargs="?",
        const=True,
        default=False,
        metavar="TABLE",
        help="also the Celery beat's table (default celery_beat_state)",
    )
    group.add_argument(
        "--apscheduler",
        nargs="?",
        const=True,
        default=False,
        metavar="TABLE",
        help="also APScheduler's ledger (default mutex_apscheduler_runs)",
    )

    add(
        "init",
        "Create the lock table (and the tables the integrations asked for) if it does not exist.",
        "  postgres-mutex init\n  postgres-mutex init --history --history-retention 604800\n"
        "  postgres-mutex init --celery-beat --apscheduler",
        [connection, history_options, integration_options],
    )

    add(
        "migrate",
        "Add fencing tokens (and, with --history, a history) to a lock table; online, idempotent, as its owner.",
        "  postgres-mutex migrate\n  postgres-mutex migrate --table ops.mutex_lock\n  postgres-mutex migrate --history",
        [connection, history_options, integration_options],
    )

    history = add(
        "history",
        "Show the holds the history recorded, newest first: who held a lock, when, and how it ended.",
        "  postgres-mutex history --lock ledger-sync --since 2026-12-02T03:00\n"
        "  postgres-mutex history --since 2h --json | jq '.holds[] | select(.ended_how == \"reclaimed\")'",
        [connection],
    )
    history.add_argument(
        "--lock", help="only this lock, or every permit of this semaphore, or every holder of this read/write lock"
    )
    history.add_argument(
        "--since", type=since, help="holds not ended by then: an ISO 8601 moment, or an age (90s, 15m, 2h, 7d)"
    )
    history.add_argument("--limit", type=positive_int, default=100, help="at most this many holds (default 100)")
    history.add_argument("--json", action="store_true", help="machine-readable output")

    release = add(
        "release",
        "Remove a lock's row whoever holds it (or one permit of a semaphore, or one holder of a read/write lock): "
        "for an operator who knows the holder is gone.",
        "  postgres-mutex release nightly-report --force\n"
        "  postgres-mutex release partner-api --permit 2 --force  # one holder of a semaphore, as status shows it\n"
        "  postgres-mutex release catalogue --writer --force  # the writer of a read/write lock\n"
        "  postgres-mutex release catalogue --reader web-3-1a2b --force  # one reader, by its holder's id",
        [connection],
    )
    release.add_argument(
        "name",
        help="the lock's name (with --permit: the semaphore's; with --writer or --reader: the read/write lock's)",
    )
    which = release.add_mutually_exclusive_group()
    which.add_argument(
        "--permit", type=permit_number, help="release only this permit of semaphore NAME (its number in status)"
    )
    which.add_argument("--writer", action="store_true", help="release only the writer of read/write lock NAME")
    which.add_argument(
        "--reader",
        metavar="INSTANCE_ID",
        help="release only this reader of read/write lock NAME (its holder in status)",
    )
    release.add_argument("--force", action="store_true", help="required: confirms the holder is gone")

    permits = add(
        "permits",
        "Change how many holders a semaphore allows at once, for the whole fleet.",
        "  postgres-mutex permits partner-api 5  # the partner raised the quota\n"
        "  postgres-mutex permits partner-api 2 --force  # and releases the holders of permits 2 and up",
        [connection],
    )
    permits.add_argument("name", help="the semaphore's name")
    permits.add_argument("permits", type=positive_int, metavar="N", help="how many may hold it at once from now on")
    permits.add_argument(
        "--force",
        action="store_true",
        help="required when holders of permits N and up would be released (they learn it at their next heartbeat)",
    )

    demo = add(
        "demo",
        "Watch a fleet contend, crash, alert and recover, on a throwaway PostgreSQL (or --dsn).",
        "  postgres-mutex demo\n  postgres-mutex demo --dsn postgresql://localhost/scratch",
        [],
    )
    demo.add_argument("--dsn", help="use this server instead of a throwaway one")
    demo.add_argument("--workers", type=int, default=3, choices=range(2, 9), metavar="N", help="2 to 8 (default 3)")
    demo.add_argument("-v", "--verbose", action="store_true", help=argparse.SUPPRESS)
    demo.set_defaults(table="mutex_lock", operation_timeout=None)
    return parser
