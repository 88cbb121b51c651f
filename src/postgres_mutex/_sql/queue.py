"""A fair lock's queue of waiters: which waiter is live, and what a fair acquire adds to a Mutex's.

Apart from the fair release (`_sql.fair`), so that the lock's statements
(`_sql.lock`), which build the fair acquire, need nothing but this.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psycopg import sql

if TYPE_CHECKING:
    from .names import Names

LIVE = sql.SQL("make_interval(secs => %(waiter_live_seconds)s::float8)")

FORGOTTEN_AFTER = 10
"""A waiter not seen for this many times the live window is deleted from the queue by a release."""


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
