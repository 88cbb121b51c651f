"""From Django's settings to a connection string and Mutexes, with no second connection string to keep in step."""

from __future__ import annotations

import threading
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from psycopg import conninfo

from postgres_mutex.mutex import Mutex

__all__ = ["database_dsn", "history_wanted", "lock_settings", "mutex"]

_DJANGO_ONLY_OPTIONS = {
    "assume_role",
    "context",
    "cursor_factory",
    "isolation_level",
    "pool",
    "prepare_threshold",
    "server_side_binding",
}
"""Keys of ``DATABASES[alias]["OPTIONS"]`` that Django's backend consumes itself: they are no libpq parameters."""

_FIELDS = {"USER": "user", "PASSWORD": "password", "HOST": "host", "PORT": "port"}


def lock_settings() -> tuple[str, str, dict[str, Any]]:
    """``settings.POSTGRES_MUTEX``, with defaults: the database alias, the lock table, and the Mutex options."""
    configured = getattr(settings, "POSTGRES_MUTEX", {})
    unknown = set(configured) - {"DATABASE", "TABLE", "OPTIONS", "HISTORY"}
    if unknown:
        raise ImproperlyConfigured(f"settings.POSTGRES_MUTEX has unknown keys: {', '.join(sorted(unknown))}")
    return (
        str(configured.get("DATABASE", "default")),
        str(configured.get("TABLE", "mutex_lock")),
        dict(configured.get("OPTIONS", {})),
    )


def history_wanted() -> bool:
    """``POSTGRES_MUTEX["HISTORY"]``: whether ``manage.py migrate`` makes the lock table's history (default False)."""
    lock_settings()  # the keys checked
    wanted = getattr(settings, "POSTGRES_MUTEX", {}).get("HISTORY", False)
    if not isinstance(wanted, bool):
        raise ImproperlyConfigured(f"settings.POSTGRES_MUTEX['HISTORY'] must be True or False, not {wanted!r}")
    return wanted


def database_dsn(alias: str | None = None) -> str:
    """A libpq connection string for ``settings.DATABASES[alias]`` (default: ``POSTGRES_MUTEX["DATABASE"]``).

    Built by `psycopg.conninfo.make_conninfo` from NAME, USER, PASSWORD,
    HOST, PORT and the libpq parameters of OPTIONS (``sslmode``,
    ``service``...), so that any value, quoted or not, reaches libpq as
    Django would pass it. Raises `ImproperlyConfigured` for an unknown alias
    or a database that is not PostgreSQL.
    """
    alias = lock_settings()[0] if alias is None else alias
    database = settings.DATABASES.get(alias)
    if database is None:
        raise ImproperlyConfigured(f"settings.DATABASES has no database {alias!r} for postgres-mutex")
    engine = str(database.get("ENGINE", ""))
    if "postgresql" not in engine and "postgis" not in engine:
        raise ImproperlyConfigured(f"settings.DATABASES[{alias!r}] is not PostgreSQL (ENGINE {engine!r})")
    params: dict[str, Any] = {
        key: value for key, value in database.get("OPTIONS", {}).items() if key not in _DJANGO_ONLY_OPTIONS
    }
    name = database.get("NAME")
    if name:
        params["dbname"] = name
    elif name is None and not params.get("service"):
        params["dbname"] = "postgres"  # as Django: NAME None means the server's default database
    for field, keyword in _FIELDS.items():
        if database.get(field):
            params[keyword] = database[field]
    try:
        return conninfo.make_conninfo("", **params)
    except Exception as exc:
        # The message names the parameter libpq refused, never a value: a password stays out of it.
        raise ImproperlyConfigured(f"settings.DATABASES[{alias!r}] gives libpq a parameter it does not know") from exc


_mutexes: dict[tuple[str, str], Mutex] = {}
_mutexes_lock = threading.Lock()


def mutex(lock_name: str, *, alias: str | None = None, **options: Any) -> Mutex:
    """A `Mutex` on the configured database and table, with ``POSTGRES_MUTEX["OPTIONS"]`` overridden by ``options``.

    Without ``options`` it is one Mutex per lock name and alias per process,
    made on first use: a decorated function called again reuses it.
    """
    default_alias, table, configured = lock_settings()
    alias = default_alias if alias is None else alias
    merged = {"table": table, **configured, **options}
    if options:
        return Mutex(database_dsn(alias), lock_name, **merged)
    with _mutexes_lock:
        made = _mutexes.get((alias, lock_name))
        if made is None:
            made = _mutexes[(alias, lock_name)] = Mutex(database_dsn(alias), lock_name, **merged)
        return made
