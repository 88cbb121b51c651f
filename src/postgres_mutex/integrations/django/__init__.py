"""Django: locks configured from ``settings.DATABASES``, a decorator, a system check, and ``manage.py postgres_mutex``.

Add ``"postgres_mutex.integrations.django"`` to ``INSTALLED_APPS``. Locks
live on the database alias named by ``settings.POSTGRES_MUTEX["DATABASE"]``
(default ``"default"``), in the table ``settings.POSTGRES_MUTEX["TABLE"]``
(default ``"mutex_lock"``); ``settings.POSTGRES_MUTEX["OPTIONS"]`` gives every
lock further `Mutex` options (thresholds, ``reclaim_disconnected_after``).
Needs the ``django`` extra.
"""

from __future__ import annotations

from .settings import database_dsn, lock_settings, mutex
from .singleton import AlreadyRunning, once

__all__ = ["AlreadyRunning", "database_dsn", "lock_settings", "mutex", "once"]
