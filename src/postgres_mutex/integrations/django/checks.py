"""The system check: the lock table exists on the database the locks use.

A database check (Django runs those in ``migrate`` and in ``manage.py check
--database ALIAS``), since it queries the database. The app's migration makes
the table, so the check says nothing while that migration is unapplied
(Django reports unapplied migrations itself, and ``migrate`` must not fail
for the table it is about to make); once applied, a missing table (dropped,
or another ``TABLE`` configured since) is an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections
from django.db.migrations.recorder import MigrationRecorder

from .settings import database_dsn, lock_settings


def lock_table_exists(
    app_configs: Iterable[Any] | None = None, databases: Iterable[str] | None = None, **_: Any
) -> list[checks.CheckMessage]:
    """``postgres_mutex.E001`` when the lock table is missing, ``E002`` when the settings cannot name a database."""
    try:
        alias, table, _options = lock_settings()
        database_dsn(alias)
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), id="postgres_mutex.E002", hint="see settings.POSTGRES_MUTEX")]
    if databases is None or alias not in databases:
        return []
    try:
        recorder = MigrationRecorder(connections[alias])
        if not recorder.has_table() or not any(app == "postgres_mutex" for app, _ in recorder.applied_migrations()):
            return []  # 'manage.py migrate' makes it
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT to_regclass(%s)", [table])
            found = cursor.fetchone()
    except DatabaseError as exc:
        return [checks.Warning(f"cannot look for the lock table {table!r}: {exc}", id="postgres_mutex.W001")]
    if found is None or found[0] is None:
        return [
            checks.Error(
                f"the lock table {table!r} does not exist in database {alias!r}",
                hint="create it with: python manage.py postgres_mutex init (the app's migration made the table "
                "configured when it ran)",
                id="postgres_mutex.E001",
            )
        ]
    return []
