"""Keep passwords out of everything the library shows: messages, logs, reprs.

libpq echoes parts of a malformed connection string in its error messages
(``invalid percent-encoded token: "s3cr%t"``), so any text that may quote the
DSN or a server error goes through `Redactor.redact` before it is raised or
logged.
"""

from __future__ import annotations

import re

import psycopg
from psycopg.conninfo import conninfo_to_dict

MASK = "***"

# ``password=value`` and ``password='quoted value'`` in keyword-form conninfo,
# and ``?password=value`` in a URI query string.
_KEYWORD_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&'\"]+)", re.IGNORECASE)
# ``scheme://user:password@host`` in a URI.
_URI_PASSWORD = re.compile(r"([a-z][a-z0-9+.-]*://[^:/@\s]*:)([^@\s]*)(@)", re.IGNORECASE)


def _passwords_in(dsn: str) -> list[str]:
    """Every password-like value written in ``dsn``, even when it does not parse."""
    found = [m.group(2).strip("'") for m in _KEYWORD_PASSWORD.finditer(dsn)]
    found += [m.group(2) for m in _URI_PASSWORD.finditer(dsn)]
    try:
        parsed = conninfo_to_dict(dsn)
    except psycopg.Error:
        parsed = {}
    password = parsed.get("password")
    if password:
        found.append(str(password))
    return [p for p in found if p]


class Redactor:
    """Masks the passwords of one DSN (and any password-shaped text) in a string."""

    def __init__(self, dsn: str | None) -> None:
        # Longest first, so a password containing another is masked whole.
        self._secrets = sorted(set(_passwords_in(dsn or "")), key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        text = _KEYWORD_PASSWORD.sub(rf"\g<1>{MASK}", text)
        return _URI_PASSWORD.sub(rf"\g<1>{MASK}\g<3>", text)
