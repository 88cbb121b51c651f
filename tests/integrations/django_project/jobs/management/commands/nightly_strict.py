"""The same job as ``nightly``, on the same lock, refusing to be skipped silently: it fails instead."""

from typing import Any

from django.core.management.base import BaseCommand

from postgres_mutex.integrations.django import once


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type hints  # type: ignore[misc]  # Django has no type hints
    @once("django:nightly", on_contention="raise")
    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write("running")
