"""The Django app: registers the system check when Django starts."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class PostgresMutexConfig(AppConfig):  # type: ignore[misc]  # Django has no type hints
    """``postgres_mutex.integrations.django`` in ``INSTALLED_APPS``: the check and ``manage.py postgres_mutex``."""

    name = "postgres_mutex.integrations.django"
    label = "postgres_mutex"
    verbose_name = "postgres-mutex"

    def ready(self) -> None:
        from .checks import lock_table_exists

        checks.register(lock_table_exists, checks.Tags.database)
