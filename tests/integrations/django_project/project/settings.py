"""A minimal project on the test PostgreSQL: the database comes from the environment the test sets.

``OPTIONS`` puts the project in a schema of its own (a libpq parameter that must reach
libpq through `database_dsn` as it reaches Django's own connections).
"""

import os

SECRET_KEY = "test-only-not-secret"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["postgres_mutex.integrations.django", "jobs"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["DB_NAME"],
        "USER": os.environ["DB_USER"],
        "PASSWORD": os.environ.get("DB_PASSWORD", ""),
        "HOST": os.environ["DB_HOST"],
        "PORT": os.environ["DB_PORT"],
        "OPTIONS": {"options": f"-c search_path={os.environ['DB_SCHEMA']}"},
    }
}
POSTGRES_MUTEX = {
    "OPTIONS": {"heartbeat_interval": 0.5, "alert_threshold": 5, "stale_threshold": 30},
    "HISTORY": os.environ.get("MUTEX_HISTORY") == "1",
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
