"""A holder's lease: one row that renews every lock a heartbeat group holds, and how staleness reads it.

Renewing each lock's row costs the server per lock: with 10,000 locks held,
tens of milliseconds of CPU every heartbeat interval. A lease costs one row
(etcd's design: a session owns the lease, its locks hang on it). Each
heartbeat group of a client (the holds that share a table and an interval)
of at least `_state.heartbeat_flows.LEASE_FROM` holds, on a connection with
no pooler between, draws a random 63-bit *lease key*; a mutex's row points at it by its
``lease_key`` column, written by the heartbeat that renews the row itself; a
table ``<table>_leases`` holds one row per key, whose ``last_heartbeat`` the
heartbeat then renews, with the rows whose own heartbeat is due in the same
statement (`renewal`): one statement a round.

A row's heartbeat is then the later of its own ``last_heartbeat`` and its
lease's (`effective_heartbeat`): what the acquire's take-over, its report of
the holder's age (the alert) and a read of the table (the watcher, the CLI)
judge. A take-over clears ``lease_key``, so the row no longer follows the
former holder's lease.

What keeps it safe:

- The holder trusts each lock from the last renewal of its row's *own*
  heartbeat, which the heartbeat still sends every third of the holder's lease
  (`_state.heartbeat_flows.own_heartbeat_period`), never from the lease's: a
  reader that judges the row's own heartbeat alone (0.1.0, a role not granted
  the leases) never takes a lock its holder trusts, even a frozen holder's,
  and a reader that judges the later of the two waits longer still.
- The lease's renewal is refused once the lease is older than the shortest
  stale threshold of its locks, less the statement's deadline
  (``%(within)s``): a renewal that lands can never revive a lease a contender
  may have judged stale, so a take-over is always seen by the per-row
  heartbeat the holder then falls back to. A contender's snapshot is taken
  after the renewal's deadline has passed, so it sees the renewal.
- A hold the client stops renewing (released, lost, or frozen in a test) is
  *detached* in the same statement: its row's ``lease_key`` cleared and its
  own ``last_heartbeat`` set to the lease's, so it turns stale exactly when
  it would have without a lease, never later or sooner. A row another
  session holds locked is skipped, never waited for, and detached by a later
  renewal: till then it follows a lease that stays fresh.

An operator's forced release deletes a row without its holder; it bumps the
lease's ``revision`` in the same statement, and a holder that sees the
revision change checks each of its rows again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psycopg import sql

from .statement import Statement, statement

if TYPE_CHECKING:
    from .names import Names

COLUMN = "lease_key"
"""The lock table's column that names the lease a row follows (NULL: its own ``last_heartbeat`` only)."""


def create_leases(names: Names) -> sql.Composable:
    """The leases' table: one row per lease key, its heartbeat and its revision; IF NOT EXISTS."""
    return sql.SQL(
        """CREATE TABLE IF NOT EXISTS {leases} (
  lease_key      BIGINT NOT NULL,
  last_heartbeat TIMESTAMPTZ NOT NULL,
  revision       BIGINT NOT NULL DEFAULT 0,
  CONSTRAINT {pkey} PRIMARY KEY (lease_key)
) WITH (fillfactor = 50)"""
    ).format(leases=names.leases, pkey=names.leases_pkey)


def add_column(names: Names) -> sql.Composable:
    return sql.SQL("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS lease_key BIGINT").format(table=names.table)


def effective_heartbeat(names: Names, row: sql.Composable) -> sql.Composable:
    """The later of ``row``'s own heartbeat and its lease's (GREATEST ignores a lease that is not there)."""
    return sql.SQL(
        "GREATEST({row}.last_heartbeat, (SELECT lease.last_heartbeat FROM {leases} AS lease "
        "WHERE lease.lease_key = {row}.lease_key))"
    ).format(row=row, leases=names.leases)


def upsert(names: Names) -> sql.Composable:
    """The per-row heartbeat's part that makes the lease its rows now point at exist, renewed; with its revision,
    which the statement answers (`REVISION`), the one its holder compares the next renewal's to.

    A lease that lapsed (``%(within)s``, as `renew` judges it) is not revived: the rows then follow no lease
    (``lease_key`` NULL), the revision is NULL, and the holder draws a new key."""
    return sql.SQL(
        """lease AS (
  INSERT INTO {leases} AS lease (lease_key, last_heartbeat) VALUES (%(lease_key)s, now())
  ON CONFLICT (lease_key) DO UPDATE SET last_heartbeat = now()
   WHERE lease.last_heartbeat > now() - make_interval(secs => %(within)s::float8)
  RETURNING lease.lease_key, lease.revision
), """
    ).format(leases=names.leases)


REVISION = sql.SQL(", (SELECT revision FROM lease)")
"""The heartbeat's last column where it renews the lease too (`upsert`, `renewal`): the lease's revision, NULL if
it was not renewed."""


def revision_and_kept(names: Names) -> sql.Composable:
    """The heartbeat's last two columns where it renews the lease as `renew` does (`renewal`): the lease's revision
    (NULL if it was not renewed) and the tokens it could not detach (`kept`)."""
    return REVISION + sql.SQL(", ") + kept(names)


def renewal(names: Names) -> sql.Composable:
    """The part of a per-row heartbeat that renews the lease as `renew` does, in the same statement: the rows whose
    own heartbeat is due go with the lease's renewal, one statement a round (their ``lease_key`` is left as it is)."""
    return sql.SQL(
        """{detached}, lease AS (
  {renewed}
), """
    ).format(detached=_DETACHED_PART.format(table=names.table, leases=names.leases), renewed=_renewed(names))


_DETACHED_PART = sql.SQL("""detached AS (
  UPDATE {table} AS held
     SET lease_key = NULL,
         last_heartbeat = GREATEST(held.last_heartbeat,
                                   (SELECT last_heartbeat FROM {leases} WHERE lease_key = %(lease_key)s))
   WHERE held.ctid = ANY(ARRAY(
           SELECT ctid FROM {table}
            WHERE token = ANY(%(detach)s::bigint[]) AND lease_key = %(lease_key)s
              FOR NO KEY UPDATE SKIP LOCKED))
  RETURNING held.token
)""")
"""Rows that followed the lease and are no longer renewed (``detach``: their tokens) follow their own heartbeat,
set to the lease's: they turn stale when they would have without a lease. A row another session holds locked
is skipped (`kept`), never waited for: the lease's renewal, and with it every other row's, goes on."""


def kept(names: Names) -> sql.Composable:
    """The tokens of ``detach`` whose rows still follow the lease, skipped as locked by another session: the
    holder sends them again with the next renewal."""
    return sql.SQL(
        "ARRAY(SELECT token FROM {table} WHERE token = ANY(%(detach)s::bigint[]) AND lease_key = %(lease_key)s"
        " AND token NOT IN (SELECT token FROM detached))"
    ).format(table=names.table)


def _detached(names: Names) -> sql.Composable:
    return sql.SQL("WITH ") + _DETACHED_PART.format(table=names.table, leases=names.leases)


def _renewed(names: Names) -> sql.Composable:
    """The lease renewed unless it lapsed (``%(within)s``), its revision returned."""
    return sql.SQL(
        """UPDATE {leases}
   SET last_heartbeat = now()
 WHERE lease_key = %(lease_key)s AND last_heartbeat > now() - make_interval(secs => %(within)s::float8)
RETURNING revision"""
    ).format(leases=names.leases)


FORGOTTEN_AFTER = "1 hour"
"""A lease not renewed for this long is deleted by the end of any other (`end`): its process ended without
deleting it, or stopped renewing it. Safe at any age: a holder trusts its lock from its row's own heartbeat,
never from the lease, so a row judged without its lease is judged as its holder judges it."""


def renew(names: Names) -> Statement:
    """Detach the holds no longer renewed, then renew the lease unless it lapsed: one row ``(revision, kept)``.

    A NULL revision: the lease lapsed (or was never made); the holder then
    renews its rows one by one, which tells it which are still its own.
    ``kept``: the tokens not detached (`kept`), sent again next time.
    """
    return statement(
        names.table_name,
        "heartbeat",
        sql.SQL("{detached}, lease AS (\n  {renewed}\n)\nSELECT (SELECT revision FROM lease), {kept}").format(
            detached=_detached(names), renewed=_renewed(names), kept=kept(names)
        ),
    )


def end(names: Names) -> Statement:
    """A heartbeat group that holds nothing any more: detach its last rows and delete its lease, with the leases
    nobody renewed for `FORGOTTEN_AFTER` (a process that ended, or was killed, before deleting its own).

    Without it, each group a process formed (its locks held, then none)
    would leave a row behind for good.
    """
    return statement(
        names.table_name,
        "end of a lease",
        sql.SQL(
            """{detached}, forgotten AS (
  DELETE FROM {leases}
   WHERE last_heartbeat < now() - interval {forgotten} AND lease_key <> %(lease_key)s
)
DELETE FROM {leases} WHERE lease_key = %(lease_key)s"""
        ).format(detached=_detached(names), leases=names.leases, forgotten=sql.Literal(FORGOTTEN_AFTER)),
    )


def revoked(names: Names, released: str) -> sql.Composable:
    """A forced release's part: tell the lease of the row it deleted (``released``'s) that a row of it went."""
    return sql.SQL(
        """, revoked AS (
  UPDATE {leases} SET revision = revision + 1
   WHERE lease_key IN (SELECT lease_key FROM {released} WHERE lease_key IS NOT NULL)
)"""
    ).format(leases=names.leases, released=sql.Identifier(released))
