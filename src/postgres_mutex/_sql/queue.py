"""A fair lock's queue of waiters: which waiter is live, and what a fair acquire adds to a Mutex's or a Semaphore's.

Apart from the fair release (`_sql.fair`), so that the lock's statements
(`_sql.lock`, `_sql.semaphores`), which build the fair acquires, need nothing but this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from psycopg import sql

if TYPE_CHECKING:
    from .names import Names

LIVE = sql.SQL("make_interval(secs => %(waiter_live_seconds)s::float8)")

FORGOTTEN_AFTER = 10
"""A waiter not seen for this many times the live window is deleted from the queue by a release."""


@dataclass(frozen=True, slots=True)
class Line:
    """One kind of fair lock's line of waiters: its key in the queue, and which rows of the lock table it is for.

    ``key``: the queue's ``lock_name`` of the lock's waiters; ``column`` and
    ``value``: the rows of the lock table a release may hand to them (a
    mutex's one row; a semaphore's every permit; a read/write lock's
    writer's row), by ``column = value``; ``one_row``: whether the lock has
    one such row only (a waiter cannot hold one already); ``also``: what
    else its release does, for a table's names (a CTE that may read ``mine``).
    """

    key: sql.Composable
    column: str
    value: sql.Composable
    one_row: bool = True
    also: Callable[[Names], sql.Composable] | None = None

    def rows(self, alias: str | None = None) -> sql.Composable:
        """The lock's rows held, ``alias``-qualified if given."""

        def column(name: str) -> sql.Identifier:
            return sql.Identifier(alias, name) if alias else sql.Identifier(name)

        return sql.SQL("{} = 1 AND {} = {}").format(column("locked"), column(self.column), self.value)


MUTEX_LINE = Line(key=sql.SQL("%(lock_name)s"), column="lock_name", value=sql.SQL("%(lock_name)s"))
"""A fair Mutex's: its waiters queue under the lock's name, for its one row."""

PERMITS_LINE = Line(
    key=sql.SQL("(%(semaphore)s || chr(31))"), column="semaphore", value=sql.SQL("%(semaphore)s"), one_row=False
)
"""A fair Semaphore's: its waiters queue under its name and the separator (no Mutex's name has it, so a Mutex of
the same name has a line of its own), for every permit's row."""


def _writer_gone(names: Names) -> sql.Composable:
    """A fair writer's release's or leave's part: the gate's writer stamp cleared, if no other live writer is
    in line. One that is keeps readers out: even one a release passes over (its entry row-locked by its attempt
    under way), which takes the lock free at its next attempt, before any reader."""
    return sql.SQL(
        """, unstamped AS (
  UPDATE {rwlocks} SET writer_waiting_until = NULL WHERE name = %(rwlock)s AND EXISTS (SELECT FROM mine)
     AND NOT EXISTS (SELECT FROM {queue} AS waiter
                      WHERE waiter.lock_name = {key} AND waiter.instance_id <> %(instance_id)s
                        AND waiter.seen > now() - {live})
)"""
    ).format(rwlocks=names.rwlocks, queue=names.queue, key=_WRITERS_KEY, live=LIVE)


_WRITERS_KEY = sql.SQL("(%(rwlock)s || chr(31) || 'w')")


WRITERS_LINE = Line(
    key=_WRITERS_KEY,
    column="lock_name",
    value=sql.SQL("%(lock_name)s"),
    also=_writer_gone,
)
"""A fair read/write lock's writers': they queue under the name of the writer's row (``R``, the separator,
``w``), for that row; readers do not queue."""


def writer_parts(names: Names) -> dict[str, sql.Composable]:
    """What a fair writer's acquire adds to a writer's (`_sql.rwlocks`), by its placeholders.

    ``ahead``: a live writer that came before this one (any, if this one is
    not queued yet); ``turn``: the writer wins (closes the gate, clears dead
    readers, inserts or takes over its row) only if there is none;
    ``waits``: a writer in line holds new readers back (stamps the gate)
    even while the lock is free, for the writer ahead of it to take;
    ``queued``: the caller's entry, as a fair Semaphore's.
    """
    key = WRITERS_LINE.key
    return {
        "ahead": sql.SQL(
            """, ahead AS (
  SELECT 1 FROM {queue} AS waiter
   WHERE waiter.lock_name = {key} AND waiter.instance_id <> %(instance_id)s
     AND waiter.seen > now() - {live}
     AND waiter.ticket < COALESCE((SELECT mine.ticket FROM {queue} AS mine
                                   WHERE mine.lock_name = {key} AND mine.instance_id = %(instance_id)s),
                                  9223372036854775807)
   LIMIT 1
)"""
        ).format(queue=names.queue, key=key, live=LIVE),
        "turn": sql.SQL(" AND NOT EXISTS (SELECT 1 FROM ahead)"),
        "waits": sql.SQL(" OR EXISTS (SELECT 1 FROM ahead)"),
        "queued": _queued(names, key, agreed=False),
    }


def permit_parts(names: Names) -> dict[str, sql.Composable]:
    """What a fair Semaphore's acquire adds to a Semaphore's (`_sql.semaphores`), by its placeholders.

    ``ahead``: how many live waiters came before this one (all, if it is not
    queued yet): a free permit is taken only while fewer of them than free
    permits wait, so the oldest take the free ones first; ``insert_if`` says
    so; ``take_if``: a stale permit is reclaimed by the oldest live waiter
    alone; ``queued``: the caller's entry, written (its ``seen`` refreshed)
    while nothing is won and deleted once something is. A permit handed to
    this waiter by a release is a row of its own: the acquire's ``mine``
    takes it, whatever the line. ``chosen``: a release that began before
    this attempt and committed after its snapshot handed this waiter a
    permit (it held the waiter's entry, and deleted it): the attempt, which
    cannot see that permit, wins no other one (it waits for the entry's row
    lock to know), lest the waiter hold two; its next attempt takes the one
    handed to it.
    """
    key = PERMITS_LINE.key
    return {
        "ahead": sql.SQL(
            """, ahead AS (
  SELECT count(*) AS waiters FROM {queue} AS waiter
   WHERE waiter.lock_name = {key} AND waiter.instance_id <> %(instance_id)s
     AND waiter.seen > now() - {live}
     AND waiter.ticket < COALESCE((SELECT mine.ticket FROM {queue} AS mine
                                   WHERE mine.lock_name = {key} AND mine.instance_id = %(instance_id)s),
                                  9223372036854775807)
), chosen AS (
  SELECT 1 FROM {queue} AS mine
   WHERE mine.lock_name = {key} AND mine.instance_id = %(instance_id)s
     AND NOT EXISTS (SELECT FROM {queue} AS still
                      WHERE still.lock_name = {key} AND still.instance_id = %(instance_id)s FOR UPDATE)
)"""
        ).format(queue=names.queue, key=key, live=LIVE),
        "insert_if": sql.SQL(
            "\n     AND (SELECT waiters FROM ahead) < (SELECT count(*) FROM free) AND NOT EXISTS (SELECT FROM chosen)"
        ),
        "take_if": sql.SQL("\n     AND (SELECT waiters FROM ahead) = 0 AND NOT EXISTS (SELECT FROM chosen)"),
        "queued": _queued(names, key, agreed=True),
    }


def _queued(names: Names, key: sql.Composable, *, agreed: bool) -> sql.Composable:
    """The caller's entry in line under ``key``: written (its ``seen`` refreshed) while the acquire's ``won`` is
    empty, deleted once it is not; with ``agreed``, only if the semaphore's ``agreed`` says its N is ours."""
    return sql.SQL(
        """, queued AS (
  INSERT INTO {queue} AS waiter (lock_name, instance_id, seen, wait_id)
  SELECT {key}, %(instance_id)s, now(), %(wait_id)s
   WHERE NOT EXISTS (SELECT FROM won){agreed}
  ON CONFLICT (lock_name, instance_id) DO UPDATE SET seen = now(), wait_id = EXCLUDED.wait_id
), dequeued AS (
  DELETE FROM {queue} AS waiter
   WHERE waiter.lock_name = {key} AND waiter.instance_id = %(instance_id)s AND EXISTS (SELECT FROM won)
)"""
    ).format(queue=names.queue, key=key, agreed=sql.SQL(" AND EXISTS (SELECT FROM agreed)") if agreed else sql.SQL(""))


def acquire_parts(names: Names) -> dict[str, sql.Composable]:
    """What a fair lock's acquire adds to a Mutex's (`_sql.lock`'s ``_acquire``), by its placeholders.

    ``ahead``: a live waiter that came before this one (any, if this one is
    not queued yet); ``rows``/``rows_if``: the INSERT happens only if there
    is none; ``turn``: a take-over (a stale row's reclaim) likewise, but for
    the row handed to this one (its own ``instance_id``); ``queued``: the
    caller's entry, written while it does not win and deleted once it wins.
    """
    return {
        "ahead": sql.SQL(
            """, ahead AS (
  SELECT 1 FROM {queue} AS waiter
   WHERE waiter.lock_name = %(lock_name)s AND waiter.instance_id <> %(instance_id)s
     AND waiter.seen > now() - {live}
     AND waiter.ticket < COALESCE((SELECT mine.ticket FROM {queue} AS mine
                                   WHERE mine.lock_name = %(lock_name)s AND mine.instance_id = %(instance_id)s),
                                  9223372036854775807)
   LIMIT 1
)"""
        ).format(queue=names.queue, live=LIVE),
        "rows": sql.SQL("SELECT * FROM (VALUES "),
        "rows_if": sql.SQL(") AS arriving WHERE NOT EXISTS (SELECT FROM ahead)"),
        "turn": sql.SQL("\n     AND (existing.instance_id = %(instance_id)s OR NOT EXISTS (SELECT FROM ahead))"),
        "queued": sql.SQL(
            """, queued AS (
  INSERT INTO {queue} AS waiter (lock_name, instance_id, seen, wait_id)
  SELECT %(lock_name)s, %(instance_id)s, now(), %(wait_id)s
   WHERE NOT EXISTS (SELECT FROM inserted) AND NOT EXISTS (SELECT FROM taken)
  ON CONFLICT (lock_name, instance_id) DO UPDATE SET seen = now(), wait_id = EXCLUDED.wait_id
  RETURNING waiter.ticket
), dequeued AS (
  DELETE FROM {queue} AS waiter
   WHERE waiter.lock_name = %(lock_name)s AND waiter.instance_id = %(instance_id)s
     AND (EXISTS (SELECT FROM inserted) OR EXISTS (SELECT FROM taken))
  RETURNING waiter.ticket
)"""
        ).format(queue=names.queue),
    }
