"""The tables the framework integrations keep next to the lock table, made by whoever makes the lock table.

Celery beat's state (the runs each entry's leading beat recorded) and
APScheduler's ledger (the fire time each job last ran) are created by
`LockTable.create` and the command line's ``init``, as the role that may
create tables; the integrations only read and write them, so the role they
run as needs no CREATE on the schema. The integrations' own statements on
them (their reads and writes) stay with each integration, which is built on
the public API only; their definitions live here, with every other table's.
"""

from __future__ import annotations

from psycopg import sql

from .names import parse_table
from .statement import Statement, render, statement

CELERY_BEAT_STATE = "celery_beat_state"
"""The Celery beat's table unless ``postgres_mutex_beat_state_table`` names another."""
APSCHEDULER_RUNS = "mutex_apscheduler_runs"
"""APScheduler's ledger unless `FleetExecutor`'s ``ledger`` names another."""

_DEFINITIONS = {
    "celery_beat": (
        "CREATE TABLE IF NOT EXISTS {table} (beat TEXT NOT NULL, entry TEXT NOT NULL, "
        "last_run_at TIMESTAMPTZ NOT NULL, total_run_count BIGINT NOT NULL, token BIGINT NOT NULL, "
        "PRIMARY KEY (beat, entry))"
    ),
    "apscheduler": (
        "CREATE TABLE IF NOT EXISTS {table} (job_id TEXT PRIMARY KEY, fire_time TIMESTAMPTZ NOT NULL, "
        "token BIGINT, instance_id TEXT, ran_at TIMESTAMPTZ NOT NULL DEFAULT now())"
    ),
}
INTEGRATIONS = tuple(_DEFINITIONS)
"""The integrations that keep a table: ``celery_beat``, ``apscheduler``."""

GRANTS = {"celery_beat": "SELECT, INSERT, UPDATE, DELETE", "apscheduler": "SELECT, INSERT, UPDATE"}
"""What the role an integration runs as needs on its table (as the README's Permissions section grants)."""


def integration_table_exists(table: str) -> Statement:
    """Whether ``table`` exists, in the role's search path: one boolean, and no privilege needed to ask.

    Asked before creating it: ``CREATE TABLE IF NOT EXISTS`` needs CREATE on
    the schema even when the table is there.
    """
    composed = sql.SQL("SELECT to_regclass({table_text}) IS NOT NULL").format(
        table_text=sql.Literal(render(sql.Identifier(*parse_table(table))))
    )
    return statement(table, "inspection", composed)


def create_integration_table(integration: str, table: str) -> Statement:
    """The ``integration``'s table (one of `INTEGRATIONS`) named ``table``, IF NOT EXISTS."""
    composed = sql.SQL(_DEFINITIONS[integration]).format(table=sql.Identifier(*parse_table(table)))
    return statement(table, f"creation of the {integration} table", composed)
