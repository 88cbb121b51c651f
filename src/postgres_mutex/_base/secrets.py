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
    """Masks the passwords of one DSN (and any password-shaped text) in a string.

    A password is masked where it stands as a value of its own: after
    ``password=``, in a URI's ``user:password@``, or as a token that no letter
    or digit touches (libpq quotes a DSN's pieces: ``invalid ... "s3cr%t"``).
    Never inside other words: a one-letter password ``e`` must neither garble
    "connection failed" nor, by its gaps, give itself away.
    """

    def __init__(self, dsn: str | None) -> None:
        # Longest first, so a password containing another is masked whole.
        secrets = sorted(set(_passwords_in(dsn or "")), key=len, reverse=True)
        self._standalone = [re.compile(rf"(?<!\w){re.escape(secret)}(?!\w)") for secret in secrets]

    def redact(self, text: str) -> str:
        text = _KEYWORD_PASSWORD.sub(rf"\g<1>{MASK}", text)
        text = _URI_PASSWORD.sub(rf"\g<1>{MASK}\g<3>", text)
        for secret in self._standalone:
            text = secret.sub(MASK, text)
        return text

    def shown_cause(self, exc: BaseException) -> BaseException | None:
        """psycopg's error, to chain for the traceback, unless it holds a secret.

        Its text may quote one; and a failed connect's error keeps the
        connection's options (``pgconn.info``), the password among them.
        """
        if self.redact(str(exc)) != str(exc) or getattr(exc, "pgconn", None) is not None:
            return None
        return exc
