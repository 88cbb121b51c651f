"""Every SQL statement postgres-mutex sends, composed with `psycopg.sql`: the one door to them.

Identifiers are validated and quoted; every value is bound as a parameter.
The rest of the library imports statements from here only, so what SQL it
sends can be read in the ``_sql*`` modules and nowhere else. They are, by job:

- `_sql.statement`: how a statement is sent (`Statement`, the settings each
  carries, `session_setup` for a direct connection's session, and
  `end_session_left_behind` for a connection cut off mid-statement);
- `_sql.names`: what a lock table's objects are called (`Names`), and its
  lock's fence check;
- `_sql.lock`: the lock's statements for one table of one shape
  (`Statements`, `TableShape`), and LISTEN for its releases;
- `_sql.kinds`: what each kind of lock adds to `Statements`, registered by its part;
- `_sql.history`: how a hold can end and the parts of the lock statements
  that write the history, and its read;
- `_sql.permits`: what semaphores add (each permit is a row of the lock table);
- `_sql.rwlocks`: what read/write locks add (each holder is a row, each lock a gate);
- `_sql.rows`: what a row's name says it holds (a mutex, a permit, a read/write lock's mode);
- `_sql.fair`: a fair lock's queue of waiters, and its release that hands the lock to the oldest;
- `_sql.wake`: whom a release wakes (one registered process, on its slot's channel), and the listener's registration;
- `_sql.schema`: creating, inspecting and migrating the tables;
- `_sql.integrations`: the tables the framework integrations keep (Celery
  beat's state, APScheduler's ledger).
"""

from . import permits, rwlocks  # noqa: F401  (imported for their kinds' statements: `_sql.kinds`)
from .fair import WAKE_FAIR, handed
from .history import HISTORY_ENDINGS
from .integrations import (
    APSCHEDULER_RUNS,
    CELERY_BEAT_STATE,
    GRANTS,
    INTEGRATIONS,
    create_integration_table,
    integration_table_exists,
)
from .lock import CURRENT, CURRENT_WITH_HISTORY, LEGACY, Statements, TableShape, listen, unlisten
from .names import Names
from .rows import SEPARATOR, RowOf, row_of, rw_row_name
from .schema import create_history, create_table, history_retention, inspect_table, migrate_steps, pages_have_room
from .statement import Statement, end_session_left_behind, session_setup
from .wake import WAKE_ALL, WAKE_EACH_PROCESS, pass_on, register, slot_channel, stop_listening, unregister

__all__ = [
    "APSCHEDULER_RUNS",
    "CELERY_BEAT_STATE",
    "CURRENT",
    "CURRENT_WITH_HISTORY",
    "GRANTS",
    "HISTORY_ENDINGS",
    "INTEGRATIONS",
    "LEGACY",
    "SEPARATOR",
    "WAKE_ALL",
    "WAKE_EACH_PROCESS",
    "WAKE_FAIR",
    "Names",
    "RowOf",
    "Statement",
    "Statements",
    "TableShape",
    "create_history",
    "create_integration_table",
    "create_table",
    "end_session_left_behind",
    "handed",
    "history_retention",
    "inspect_table",
    "integration_table_exists",
    "listen",
    "migrate_steps",
    "pages_have_room",
    "pass_on",
    "register",
    "row_of",
    "rw_row_name",
    "session_setup",
    "slot_channel",
    "stop_listening",
    "unlisten",
    "unregister",
]
