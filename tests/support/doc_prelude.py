"""What the docs' examples take for granted: the reader's own code, stood in for.

Every name in ``__all__`` is defined in the namespace of each page's Python
examples before the first one runs, so an example can call ``run_the_job()``
or read ``dsn`` as a reader's program would, without a line of scaffolding.
`SHELL_FILES` are written into the directory the shell examples run in.
Listed in docs/development.md; keep both in step.
"""

from __future__ import annotations

import asyncio
import logging
import os

__all__ = ["batches", "dsn", "log", "run_the_job", "run_the_job_async", "write"]

dsn = os.environ.get("POSTGRES_MUTEX_DSN", "")
"""The reader's connection string: the suite's PostgreSQL (see SUBSTITUTIONS in tests/support/doc_examples.py)."""

log = logging.getLogger("example")
"""The reader's logger."""

batches = [["row 1", "row 2"], ["row 3"]]
"""Work to do in steps, for examples that check the lock between steps."""


def run_the_job() -> None:
    """The reader's job."""
    print("the job ran")


async def run_the_job_async() -> None:
    """The reader's job, async."""
    await asyncio.sleep(0)
    print("the job ran")


def write(batch: list[str]) -> None:
    """One step of the reader's job."""
    print(f"wrote {len(batch)} rows")


SHELL_FILES = {
    "report.sh": '#!/bin/sh\necho "report.sh ran with arguments: $*"\n',
}
"""Scripts the shell examples run (``./report.sh``): name -> content; written executable."""
