"""Who a release wakes: one waiting process of the fleet, named in the notification, not every one.

A process's listener that LISTENs on a lock's channel also *registers* there:
on its own connection it takes two session-level advisory locks keyed by the
channel, ``(key, 0)`` shared (someone waits) and ``(key, its backend pid)``
exclusive (this process waits). A release reads the registered pids from
``pg_locks`` and puts one, chosen at random, in the notification's payload:
only that process's listener wakes one of its waiters, so a release costs one
attempt across the fleet, not one per process (`WAKE_ONE`). A release that
finds nobody registered sends an empty payload, and every listener wakes one
waiter of its own, as when a listener could not register.

Advisory locks need no privilege and no table, end with their session (a
process that exits or is killed leaves no registration behind), and are per
database. A listener registers only on a direct connection (``pg_backend_pid()``
is the process id the connection was given): behind a pooler a session-level
lock could outlive the client on a shared server session. Each registration
holds two entries of the server's shared lock table, so a listener registers
on a bounded number of channels (`_io.listener_async.MOST_REGISTERED`) and
LISTENs on the rest only. The release's first question, whether ``(key, 0)``
is free, costs one lock-table probe and spares it ``pg_locks`` when nobody
waits.

A registered process woken when none of its waiters can use the wake-up (all
left, or all already woken) passes it on (`pass_on`): the freed hold may be
free, and nobody else was told.
"""

from __future__ import annotations

from psycopg import sql

from .statement import render

WAKE_ALL = "*"
"""The payload of a notification that wakes every waiter of the channel rather than one."""

WAKE_EACH_PROCESS = ""
"""The payload of a notification that wakes one waiter in each listening process (nobody registered)."""

_KEY = sql.SQL("(hashtext({channel}) & 2147483647)")
"""The channel's advisory-lock key (the first of two int4 keys): the same in every session of a server."""


def _registered(channel: sql.Composable, *, others_only: bool) -> sql.Composable:
    """One registered process's backend pid, as text, chosen at random (NULL if none)."""
    return sql.SQL(
        """(SELECT objid::text FROM pg_locks
     WHERE locktype = 'advisory' AND objsubid = 2 AND granted AND objid <> 0{others}
       AND classid = {key}::oid AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
     ORDER BY random() LIMIT 1)"""
    ).format(
        key=_KEY.format(channel=channel),
        others=sql.SQL(" AND objid <> pg_backend_pid()::oid") if others_only else sql.SQL(""),
    )


def wake_one(channel: sql.Composable) -> sql.Composable:
    """The payload that wakes one waiter of the fleet: a registered process's pid, or `WAKE_EACH_PROCESS`.

    Asks first whether anyone registered: the exclusive try succeeds only if
    nobody holds ``(key, 0)``, and then holds it to the end of the statement's
    transaction, so a listener registering meanwhile waits for that end and
    its waiter's next attempt sees this release.
    """
    return sql.SQL(
        """CASE WHEN pg_try_advisory_xact_lock({key}, 0) THEN {each}
            ELSE coalesce({registered}, {each}) END"""
    ).format(
        key=_KEY.format(channel=channel),
        each=sql.Literal(WAKE_EACH_PROCESS),
        registered=_registered(channel, others_only=False),
    )


def after_release(row: str) -> sql.Composable:
    """The payload of the notification of a release of ``row`` (a ``RETURNING`` of the deleted row), whose
    statement's parameter ``channel`` names the lock's channel.

    A mutex's or a permit's release frees one hold: it wakes one waiter of
    the fleet (`wake_one`). A read/write lock's (its row's name says so,
    `_sql.rows`) wakes one waiter of each process: its waiters wait in two
    modes, and one chosen without regard to mode could be a reader the
    waiting writer's gate keeps out while the writer is not told.
    """
    return sql.SQL("CASE WHEN {row}.lock_name ~ (chr(31) || '[rw]') THEN {each} ELSE {one} END").format(
        row=sql.Identifier(row), each=sql.Literal(WAKE_EACH_PROCESS), one=wake_one(sql.Placeholder("channel"))
    )


def register(channel: str, backend_pid: int, *, listened: bool) -> str:
    """LISTEN on ``channel`` (unless ``listened`` already) and register this process there, if its connection
    is direct: one round trip. ``backend_pid``: the process id the connection was given."""
    return render(
        sql.SQL(
            "{listen}SELECT pg_advisory_lock_shared({key}, 0), pg_advisory_lock({key}, pg_backend_pid()) "
            "WHERE pg_backend_pid() = {pid}"
        ).format(
            # Committed before the locks are taken: a release that names this process once it
            # is registered finds it listening (a LISTEN counts from its transaction's commit).
            listen=sql.SQL("") if listened else sql.SQL("BEGIN; LISTEN {}; COMMIT; ").format(sql.Identifier(channel)),
            key=_KEY.format(channel=sql.Literal(channel)),
            pid=sql.Literal(backend_pid),
        )
    )


def unregister(channel: str, backend_pid: int) -> str:
    """End this process's registration on ``channel``; it still LISTENs, to pass on a wake-up it gets late."""
    return render(
        sql.SQL(
            "SELECT pg_advisory_unlock_shared({key}, 0), pg_advisory_unlock({key}, pg_backend_pid()) "
            "WHERE pg_backend_pid() = {pid}"
        ).format(key=_KEY.format(channel=sql.Literal(channel)), pid=sql.Literal(backend_pid))
    )


def pass_on(channel: str) -> str:
    """Hand a wake-up this process cannot use to another registered process (else to every process)."""
    return render(
        sql.SQL("SELECT pg_notify({channel}, coalesce({registered}, {each}))").format(
            channel=sql.Literal(channel),
            registered=_registered(sql.Literal(channel), others_only=True),
            each=sql.Literal(WAKE_EACH_PROCESS),
        )
    )
