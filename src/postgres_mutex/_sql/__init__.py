"""Every SQL statement postgres-mutex sends, composed with `psycopg.sql`: the one door to them.

Identifiers are validated and quoted; every value is bound as a parameter.
The rest of the library imports statements from here only, so what SQL it
sends can be read in the ``_sql*`` modules and nowhere else. Each part holds
one job and its docstring says which (`_sql.lock` the lock's, `_sql.schema`
creating and migrating, ...; the list is in ``docs/development.md``).
"""

from . import rwlocks, semaphores  # noqa: F401  (imported for their kinds' statements: `_sql.kinds`)
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
from .lock import Statements, create_functions, listen, unlisten
from .names import Names
from .schema import create_history, create_table, history_retention, inspect_table, migrate_steps, pages_have_room
from .shape import CURRENT, TableShape
from .statement import Statement, end_session_left_behind, session_setup
from .wake import WAKE_ALL, WAKE_EACH_PROCESS, pass_on, register, slot_channel, stop_listening, unregister

__all__ = [
    "APSCHEDULER_RUNS",
    "CELERY_BEAT_STATE",
    "CURRENT",
    "GRANTS",
    "HISTORY_ENDINGS",
    "INTEGRATIONS",
    "WAKE_ALL",
    "WAKE_EACH_PROCESS",
    "WAKE_FAIR",
    "Names",
    "Statement",
    "Statements",
    "TableShape",
    "create_functions",
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
    "session_setup",
    "slot_channel",
    "stop_listening",
    "unlisten",
    "unregister",
]
