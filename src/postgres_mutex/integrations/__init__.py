"""Glue for the frameworks where jobs live: each submodule is an optional extra on the public API."""

from __future__ import annotations

from collections.abc import Mapping

from postgres_mutex.errors import Phrase

SETUP_WORDS: Mapping[str, str] = {
    "call create_schema()": "run 'postgres-mutex init'",
    "create_schema()": "'postgres-mutex init'",
    "LockTable.create(celery_beat=True)": "'postgres-mutex init --celery-beat'",
    "LockTable.create(apscheduler=True)": "'postgres-mutex init --apscheduler'",
}
"""How the integrations' guides tell their users to make the tables: the command line, run once."""


def in_setup_words(error: BaseException, words: Mapping[str, str] = SETUP_WORDS) -> str:
    """The library's message for ``error``, naming the commands the integration's guide sets the tables up with."""
    phrase = getattr(error, "phrase", None)
    return phrase.render(words) if isinstance(phrase, Phrase) else str(error)
