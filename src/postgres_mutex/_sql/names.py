"""What the objects of one lock table are called: `Names`, from the table's name given by the user.

A table is ``"table"`` or ``"schema.table"``, validated before any statement
is composed. Everything that belongs to it (its unique constraint, the token
sequence and index, the history table and its indexes, the NOTIFY channel of
each lock) is named after it, so several lock tables can share a schema, and
every derived name fits PostgreSQL's 63 bytes without being truncated into
another's.
"""

from __future__ import annotations

import functools
import hashlib
import re

from psycopg import sql

from ..errors import InvalidArgument
from .statement import render

# Unquoted-identifier shape: conservative, so a typo fails loudly at
# construction instead of silently naming a different, case-sensitive table.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
# PostgreSQL truncates identifiers past NAMEDATALEN - 1 bytes.
_MAX_IDENTIFIER_BYTES = 63


def parse_table(table: object) -> tuple[str, ...]:
    """Split ``"table"`` or ``"schema.table"`` into validated parts."""
    if not isinstance(table, str):
        raise TypeError(f"table must be a str, not {type(table).__name__}")
    parts = tuple(table.split("."))
    if len(parts) > 2:
        raise InvalidArgument("{table} must be 'name' or 'schema.name', got {value!r}", value=table)
    for part in parts:
        # Leave room for the names derived from the table (_token_seq, _history).
        if not _IDENTIFIER.fullmatch(part) or len(part.encode()) > _MAX_IDENTIFIER_BYTES:
            raise InvalidArgument(
                "{table} must be 'name' or 'schema.name' made of letters, digits, '_' or '$' "
                "(at most {most} bytes each, not starting with a digit), got {value!r}",
                most=_MAX_IDENTIFIER_BYTES,
                value=table,
            )
    return parts


def _derived(parts: tuple[str, ...], suffix: str, *, prefix: str = "") -> tuple[str, ...]:
    """A name derived from the table's, in the table's schema, that always fits and never collides.

    ``prefix + table + suffix`` when it fits in 63 bytes (so the README's
    ``uq_mutex_lock``). A longer one is not left for PostgreSQL to truncate,
    which would cut the suffixes off and give the sequence, the history table
    and their indexes one name, or two tables sharing a long prefix one
    constraint: the table's name is shortened instead, and a digest of it
    keeps names of different tables apart.
    """
    name = prefix + parts[-1] + suffix
    if len(name.encode()) > _MAX_IDENTIFIER_BYTES:
        digest = hashlib.sha256(".".join(parts).encode()).hexdigest()[:8]
        room = _MAX_IDENTIFIER_BYTES - len(prefix.encode()) - len(suffix.encode()) - len(digest) - 1
        head = parts[-1].encode()[:room].decode(errors="ignore")
        name = f"{prefix}{head}_{digest}{suffix}"
    return (*parts[:-1], name)


class Names:
    """The identifiers of one lock table and of what belongs to it."""

    def __init__(self, table: str) -> None:
        self.parts = parse_table(table)
        self.table_name = ".".join(self.parts)
        self.table = sql.Identifier(*self.parts)
        # Index names share the schema's namespace: derive the unique
        # constraint's name from the table so several lock tables can coexist.
        # For the default table this is exactly the README's uq_mutex_lock.
        self.unique = sql.Identifier(_derived(self.parts, "", prefix="uq_")[-1])
        self.sequence_parts = _derived(self.parts, "_token_seq")
        self.sequence = sql.Identifier(*self.sequence_parts)
        self.token_index = sql.Identifier(_derived(self.parts, "_token_key")[-1])
        # nextval() takes the sequence's name as text: quoted, so case and schema are kept.
        self.sequence_text = sql.Literal(render(self.sequence))
        self.history_parts = _derived(self.parts, "_history")
        self.history_name = ".".join(self.history_parts)
        self.history = sql.Identifier(*self.history_parts)
        self.history_by_lock = sql.Identifier(_derived(self.parts, "_history_by_lock")[-1])
        self.history_by_expiry = sql.Identifier(_derived(self.parts, "_history_by_expiry")[-1])
        self.history_open = sql.Identifier(_derived(self.parts, "_history_open")[-1])
        # Semaphores: the table of their declared sizes, and what ties the permit rows to it.
        self.semaphores_parts = _derived(self.parts, "_semaphores")
        self.semaphores = sql.Identifier(*self.semaphores_parts)
        self.semaphores_text = sql.Literal(render(self.semaphores))
        self.semaphores_pkey = sql.Identifier(_derived(self.parts, "_semaphores_pkey")[-1])
        self.semaphores_unique = sql.Identifier(_derived(self.parts, "_semaphores_name_permits_key")[-1])
        self.permit_declared = _derived(self.parts, "_permit_declared")[-1]
        self.permit_in_range = _derived(self.parts, "_permit_in_range")[-1]
        self.permit_index_parts = _derived(self.parts, "_permit_key")
        self.permit_index = sql.Identifier(self.permit_index_parts[-1])
        self.permit_index_text = sql.Literal(render(sql.Identifier(*self.permit_index_parts)))
        # Read/write locks: their gates (one row each: the mode rows may take), and what ties the rows to them.
        self.rwlocks_parts = _derived(self.parts, "_rwlocks")
        self.rwlocks = sql.Identifier(*self.rwlocks_parts)
        self.rwlocks_pkey = sql.Identifier(_derived(self.parts, "_rwlocks_pkey")[-1])
        self.rwlocks_unique = sql.Identifier(_derived(self.parts, "_rwlocks_name_mode_key")[-1])
        self.rw_gated = _derived(self.parts, "_rw_gated")[-1]
        self.rw_paired = _derived(self.parts, "_rw_paired")[-1]
        self.rw_writer_index_parts = _derived(self.parts, "_rw_writer_key")
        self.rw_writer_index = sql.Identifier(self.rw_writer_index_parts[-1])
        self.rw_writer_index_text = sql.Literal(render(sql.Identifier(*self.rw_writer_index_parts)))
        # Fair locks: their waiters, in the order they came (`_sql.fair`).
        self.queue_parts = _derived(self.parts, "_queue")
        self.queue = sql.Identifier(*self.queue_parts)
        self.queue_text = sql.Literal(render(self.queue))
        self.queue_pkey = sql.Identifier(_derived(self.parts, "_queue_pkey")[-1])
        self.queue_order = sql.Identifier(_derived(self.parts, "_queue_order")[-1])
        # Leases: one row per heartbeat group of a client, which the rows of its mutexes follow.
        self.leases_parts = _derived(self.parts, "_leases")
        self.leases = sql.Identifier(*self.leases_parts)
        self.leases_text = sql.Literal(render(self.leases))
        self.leases_pkey = sql.Identifier(_derived(self.parts, "_leases_pkey")[-1])
        # The common acquire, and a release's choice of whom to wake, as functions on the server (`_sql.functions`).
        self.acquire_function = sql.Identifier(*_derived(self.parts, "_acquire"))
        self.wake_function = sql.Identifier(*_derived(self.parts, "_wake"))

    @functools.cached_property
    def fence(self) -> str:
        """The fence check, sent on the user's connection in their own transaction (no settings prefix).

        FOR KEY SHARE on this hold's row: a reclaim (which writes the uniquely
        indexed token) and a DELETE wait for the user's transaction; a
        heartbeat, which changes no key column, does not. The second column
        says who holds the lock now, for the error when the hold is gone.
        Kept here, beside the table's names, because it is the same for
        every shape of table and is read from a lock's names by the fence.
        """
        return render(
            sql.SQL(
                """WITH mine AS (
  SELECT token FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s AND instance_id = %(instance_id)s
     AND acquired_at = %(acquired_at)s AND token = %(token)s
     FOR KEY SHARE
)
SELECT (SELECT token FROM mine),
       (SELECT instance_id FROM {table} WHERE locked = 1 AND lock_name = %(lock_name)s)"""
            ).format(table=self.table)
        )

    def channel(self, lock_name: str, kind: str = "lock") -> str:
        """The NOTIFY channel for one lock of this table.

        One channel per lock, so waiters are woken only by their own lock; a
        mutex, a semaphore and a read/write lock of one name (``kind``, in the
        words of `_state.kind.LockKind.noun`) have one each, so a release that wakes one
        waiter never wakes a waiter of another kind, who could not use it. A
        digest keeps it under the 63-byte identifier limit whatever the names.
        """
        named = lock_name if kind == "lock" else f"{kind}\x00{lock_name}"
        digest = hashlib.sha256(f"{self.table_name}\x00{named}".encode()).hexdigest()
        return f"postgres_mutex_{digest[:40]}"
