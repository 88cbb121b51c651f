"""A nightly command that must run on one machine at a time: records its run, then holds until told to finish."""

import time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connection

from postgres_mutex.integrations.django import once


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type hints  # type: ignore[misc]  # Django has no type hints
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--until", help="hold the lock until this file exists (30 s at most)")

    @once()
    def handle(self, *args: Any, **options: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO nightly_runs DEFAULT VALUES")
        self.stdout.write("running")
        self.stdout.flush()
        if options["until"]:
            deadline = time.monotonic() + 30
            while not Path(options["until"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        self.stdout.write("done")
