"""``manage.py migrate`` makes the lock table (and its history, with ``POSTGRES_MUTEX["HISTORY"]``).

The library's own DDL (`LockTable.create`), on the settings' database and
table: idempotent, so a table made beforehand (``manage.py postgres_mutex
init``, ``postgres-mutex init``) is left as it is, and a role without CREATE
on the schema may migrate where the table exists. Nothing is undone on a
reverse migration: the table may hold locks of processes still running.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from postgres_mutex.client import MutexClient

from ..settings import database_dsn, history_wanted, lock_settings


def make_the_lock_table(apps: Any, schema_editor: Any) -> None:
    alias, table, _options = lock_settings()
    if schema_editor.connection.alias != alias:
        return  # migrate runs once per database; the locks live on one of them
    with MutexClient(database_dsn(alias)) as client:
        client.table(table).create(history=history_wanted())


class Migration(migrations.Migration):  # type: ignore[misc]  # Django has no type hints
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.RunPython(make_the_lock_table, migrations.RunPython.noop, elidable=False)
    ]
