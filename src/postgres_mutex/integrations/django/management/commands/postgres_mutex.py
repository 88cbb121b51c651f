"""``manage.py postgres_mutex COMMAND ...``: the ``postgres-mutex`` command on the settings' database and table.

Every subcommand and flag is the CLI's (``status``, ``release``, ``history``,
``init``, ``watch``...); ``--dsn`` and ``--table`` come from the settings
unless given. The connection string is handed over in-process, so its
password never appears in the process's command line.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand

from postgres_mutex import cli

from ...settings import database_dsn, lock_settings

_WITHOUT_CONNECTION = {"demo"}


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type hints  # type: ignore[misc]  # Django has no type hints
    help = "The postgres-mutex command (status, release, history...) on this project's database."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("cli_args", nargs=argparse.REMAINDER, help="a postgres-mutex command and its flags")

    def run_from_argv(self, argv: list[str]) -> None:
        # The CLI parses its own flags (and --help); Django's parser would take them for its own.
        sys.exit(run_cli(argv[2:]))

    def handle(self, *args: Any, **options: Any) -> None:
        code = run_cli(list(options["cli_args"]))
        if code:
            sys.exit(code)


def run_cli(argv: list[str]) -> int:
    """Run ``postgres-mutex ARGV`` with the settings' connection and table; returns its exit code."""
    if argv and not argv[0].startswith("-") and argv[0] not in _WITHOUT_CONNECTION:
        alias, table, _options = lock_settings()
        extra: list[str] = []
        if not _given("--dsn", argv):
            extra += ["--dsn", database_dsn(alias)]
        if not _given("--table", argv):
            extra += ["--table", table]
        argv = [argv[0], *extra, *argv[1:]]
    return cli.main(argv)


def _given(flag: str, argv: list[str]) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)
