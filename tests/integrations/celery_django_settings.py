"""Django settings for the django-celery-beat test: its models in an SQLite file of the test's own folder."""

from __future__ import annotations

import os

SECRET_KEY = "tests-only-not-a-secret"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(os.environ["CELERY_TEST_FOLDER"], "django.sqlite3"),
        "OPTIONS": {"timeout": 30},  # two beats write their schedule to one file
    }
}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
