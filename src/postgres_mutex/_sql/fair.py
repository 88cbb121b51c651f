"""A fair lock's statements: its waiters queue in the order they came, and a release hands the lock to the oldest.

A fair Mutex's acquire (`_sql.lock`'s acquire, with `_sql.queue.acquire_parts`) does what
a Mutex's does, and also: it wins a free lock only if no live waiter came
before it (``ahead``); a stale lock is reclaimed by the oldest live waiter
alone; while it does not win, it queues its caller in ``<table>_queue``
(``queued``: a ticket drawn once, in order of arrival, and ``seen``, its
last attempt by the server's clock, refreshed by each attempt); once it
wins, its entry goes (in the same statement).

A fair release (`release`) does not delete the row when a live waiter is
queued: in the same statement it hands the row to the oldest one (its
``instance_id`` written in, a new token drawn, its heartbeat and
``acquired_at`` set to the release's ``now()``, the waiter's entry dequeued)
and notifies the waiter's process (the channel of the slot its attempt named,
`at_slot`, else the lock's channel) naming the waiter's acquire, the token and
``acquired_at`` (`WAKE_FAIR`, read by `handed`): that waiter's process wakes
it, and it holds the lock with no statement of its own (its lease counted
from a moment surely before the release began, `_state.flows`). A waiter that
missed the notification takes the row over at its next attempt, as its own
(the acquire's own-row branch), with a new token. So a hand-off is one
statement, whatever the number of waiters. With nobody live queued, the row
is deleted, as a Mutex's release deletes it.

A waiter is *live* while it was seen within ``waiter_live_seconds`` (a few
poll intervals: a waiter attempts at least once per ``poll_interval``); one
not seen for longer (it died, or it gave up without a word) is passed over,
and its entry deleted by the next release. A waiter that is handed the lock
and never takes it (it died or gave up in that instant) holds a row nobody
renews: its heartbeat is the release's, so after ``stale_threshold`` the
oldest live waiter reclaims it, with the alert before, as any stale lock's.
A waiter that gives up (a timeout, a non-blocking try, a cancellation) sends
`leave`: its entry goes and a row handed to it meanwhile is handed on (or
deleted) at once, so nobody waits for the staleness rules.

A fair Semaphore's release and a fair read/write lock writer's are this
one, for the rows and the line of waiters of their kind (`_sql.queue.Line`):
their acquires are their kinds' (`_sql.semaphores`, `_sql.rwlocks`).

The row is what keeps two holders apart, as for every Mutex: a release
rewrites it under its row lock, and an acquire takes it over only under
that lock, re-checked on its latest version (`_sql.lock`). A Mutex that is
not fair, on the same name, is as safe, and not ordered: its release
deletes the row, and whoever comes first takes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psycopg import sql

from .history import hold_ended
from .kinds import adds
from .queue import FORGOTTEN_AFTER, LIVE, MUTEX_LINE, PERMITS_LINE, WRITERS_LINE, Line
from .statement import Statement, statement
from .wake import after_release, slot_or_lock_channel

if TYPE_CHECKING:
    from .names import Names
    from .shape import TableShape

WAKE_FAIR = "fair "
"""A notification's payload that names the one waiter handed the lock: after it, the waiter's acquire
(``wait_id``), the hold's token and its ``acquired_at`` in microseconds since the epoch (`handed`)."""


_NOTHING = sql.SQL("")


_AT_SLOT = "@"
"""What separates a waiter's acquire from its process's slot in ``wait_id`` (`at_slot`)."""


def at_slot(wait_id: str, slot: int) -> str:
    """A waiter's ``wait_id`` that also names the slot its process registered in on the lock's channel
    (`_sql.wake`): the release that hands it the lock notifies that slot's channel, which only its process
    hears, rather than the lock's, which wakes every process listening there, the releaser's own included."""
    return f"{wait_id}{_AT_SLOT}{slot}"


def waiter_of(wait_id: str) -> str:
    """The acquire a ``wait_id`` names, without the slot `at_slot` may have added."""
    acquire, at, slot = wait_id.rpartition(_AT_SLOT)
    return acquire if at and slot.isdigit() else wait_id


def handed(payload: str) -> tuple[str, int, int] | None:
    """A hand-off's notification read: the acquire it names (without the slot `at_slot` may have added), the
    token, ``acquired_at`` (µs since the epoch)."""
    if not payload.startswith(WAKE_FAIR):
        return None
    try:
        wait_id, token, acquired_us = payload[len(WAKE_FAIR) :].rsplit(" ", 2)
        return waiter_of(wait_id), int(token), int(acquired_us)
    except ValueError:
        return None


def release(names: Names, shape: TableShape, *, scoped: bool, line: Line = MUTEX_LINE) -> Statement:
    """A fair lock's release: hand the row to the oldest live waiter and notify it, else delete it; one statement.

    ``scoped``: the hold's row (``acquired_at``); else any row of this
    instance (`leave`). ``line``: whose waiters, and which rows (a Mutex's,
    a Semaphore's permits, a read/write lock's writer's row). Answers one row per row handed or deleted. Also
    dequeues the caller, the waiter handed the lock, and waiters long gone.
    A waiter that holds a row of the lock already (a permit handed to it by
    another release, which its attempt under way queued again) is passed over.
    A leave of a Semaphore's waiter that holds several permits hands one on
    (the waiter chosen waits for one) and deletes the others.
    """
    scope = sql.SQL(" AND acquired_at = %(acquired_at)s") if scoped else _NOTHING
    mine = sql.SQL("{rows} AND instance_id = %(instance_id)s{scope}").format(rows=line.rows(), scope=scope)
    # The receiver names no session and has no minimum hold until its own acquire writes them.
    several = not scoped and not line.one_row
    cleared = [sql.SQL("session_key = NULL, session_hold = NULL, reclaim_after = NULL")] if shape.sessions else []
    if shape.holds:
        cleared.append(sql.SQL("hold_until = NULL"))
    if shape.lease_column:
        # Nor the releaser's lease, which would keep the row fresh however long the receiver is silent.
        cleared.append(sql.SQL("lease_key = NULL"))
    return statement(
        names.table_name,
        "release" if scoped else "clean-up",
        sql.SQL(
            """{leave}WITH mine AS (
  SELECT lock_name, instance_id, acquired_at, last_heartbeat FROM {table} WHERE {mine} FOR UPDATE
), next AS (
  SELECT waiter.instance_id, waiter.wait_id FROM {queue} AS waiter
   WHERE waiter.lock_name = {key} AND waiter.instance_id <> %(instance_id)s
     AND waiter.seen > now() - {live} AND EXISTS (SELECT FROM mine){holds_none}
   ORDER BY waiter.ticket
   LIMIT 1
   FOR UPDATE OF waiter SKIP LOCKED
), handed AS (
  UPDATE {table} AS held
     SET instance_id = next.instance_id, acquired_at = now(), last_heartbeat = clock_timestamp(),
         token = nextval({sequence}){cleared}
    FROM next
   WHERE {mine_held}{one_of_mine}
  RETURNING held.lock_name, held.instance_id, next.wait_id, held.token, held.acquired_at
), deleted AS (
  DELETE FROM {table} WHERE {mine} AND {not_handed}
  RETURNING lock_name, instance_id, acquired_at, last_heartbeat
), released AS (
  SELECT * FROM mine WHERE {was_handed} UNION ALL SELECT * FROM deleted
), dequeued AS (
  DELETE FROM {queue} AS waiter
   WHERE waiter.lock_name = {key}
     AND (waiter.instance_id = %(instance_id)s OR waiter.instance_id IN (SELECT instance_id FROM handed)
          OR waiter.seen <= now() - {forgotten} * {live})
){also}{ended}
SELECT pg_notify({told}, concat_ws(' ', {wake} || handed.wait_id, handed.token,
                 (EXTRACT(EPOCH FROM handed.acquired_at) * 1000000)::bigint))::text
  FROM handed
UNION ALL
SELECT {notify}::text FROM deleted"""
        ).format(
            table=names.table,
            queue=names.queue,
            sequence=names.sequence_text,
            # Leaving: the entry first, in a statement of its own, which waits for a release that chose this
            # waiter (it holds the entry's row lock) to commit; the next statement's snapshot then sees the row
            # that release handed to it, and hands it on.
            leave=_NOTHING
            if scoped
            else sql.SQL("DELETE FROM {queue} WHERE lock_name = {key} AND instance_id = %(instance_id)s;\n").format(
                queue=names.queue, key=line.key
            ),
            key=line.key,
            # Leaving, a waiter may hold several permits (one handed to it as it won another): one goes to the
            # next waiter, who waits for one only; the others are deleted.
            one_of_mine=sql.SQL("\n     AND held.lock_name = (SELECT min(lock_name) FROM mine)")
            if several
            else _NOTHING,
            not_handed=sql.SQL("lock_name NOT IN (SELECT lock_name FROM handed)")
            if several
            else sql.SQL("NOT EXISTS (SELECT FROM next)"),
            was_handed=sql.SQL("lock_name IN (SELECT lock_name FROM handed)")
            if several
            else sql.SQL("EXISTS (SELECT FROM handed)"),
            also=line.also(names) if line.also is not None else _NOTHING,
            mine=mine,
            mine_held=sql.SQL("{rows} AND held.instance_id = %(instance_id)s{scope}").format(
                rows=line.rows("held"),
                scope=sql.SQL(" AND held.acquired_at = %(acquired_at)s") if scoped else _NOTHING,
            ),
            holds_none=_NOTHING
            if line.one_row
            else sql.SQL(
                "\n     AND NOT EXISTS (SELECT FROM {table} AS other"
                " WHERE {rows} AND other.instance_id = waiter.instance_id)"
            ).format(table=names.table, rows=line.rows("other")),
            live=LIVE,
            forgotten=sql.Literal(FORGOTTEN_AFTER),
            cleared=sql.SQL("").join(sql.SQL(", ") + part for part in cleared),
            ended=_ended(names, shape),
            wake=sql.Literal(WAKE_FAIR),
            # The slot the waiter's attempt named (`at_slot`), else the lock's channel. A waiter's process
            # keeps its slot while the waiter waits; one that lost it meanwhile (its listener reconnected)
            # misses this and takes the row at its next attempt, as a waiter told nothing does.
            told=slot_or_lock_channel(
                sql.SQL("{}::text").format(sql.Placeholder("channel")),
                sql.SQL("substring(handed.wait_id FROM {})").format(sql.Literal(f"{_AT_SLOT}([0-9]+)$")),
            ),
            notify=after_release("deleted"),
        ),
        preparable=scoped,
    )


def _ended(names: Names, shape: TableShape) -> sql.Composable:
    """How the released hold ended (handed on or deleted alike), and the hold handed on, in the history, if the
    table keeps one: the receiver holds it without a statement of its own."""
    if not shape.history:
        return _NOTHING
    return hold_ended(names) + sql.SQL(
        """, opened AS (
  INSERT INTO {history} (lock_name, token, holder, acquired_at, keep_until)
  SELECT handed.lock_name, handed.token, handed.instance_id, handed.acquired_at, NULL::timestamptz FROM handed
)"""
    ).format(history=names.history)


@adds
def _statements(names: Names, shape: TableShape) -> dict[str, Statement | None]:
    """Each fair kind's release and leave for a table of ``shape`` (their acquires are their kinds' own)."""
    # A kind's fair statements need its own tables' columns too (tokens and sessions come first).
    kinds = shape.fair and shape.tokens and shape.sessions
    permits, writers = kinds and shape.semaphores, kinds and shape.rwlocks
    return {
        "release_fair": release(names, shape, scoped=True) if shape.fair else None,
        "leave_fair": release(names, shape, scoped=False) if shape.fair else None,
        "release_permit_fair": release(names, shape, scoped=True, line=PERMITS_LINE) if permits else None,
        "leave_permit_fair": release(names, shape, scoped=False, line=PERMITS_LINE) if permits else None,
        "release_write_fair": release(names, shape, scoped=True, line=WRITERS_LINE) if writers else None,
        "leave_write_fair": release(names, shape, scoped=False, line=WRITERS_LINE) if writers else None,
    }
