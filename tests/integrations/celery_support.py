"""Real ``celery worker`` and ``celery beat`` processes for the Celery tests, and what they leave behind.

The broker is kombu's filesystem transport: it needs no server and no
package beyond Celery, and what beat sends stays in a folder as one file per
message, so a test counts every message sent per schedule entry from the
files themselves (a broker with a consumer would race the count).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def celery_env(folder: Path, dsn: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "CELERY_TEST_FOLDER": str(folder), "CELERY_TEST_DSN": dsn, **extra}


def start_celery(folder: Path, dsn: str, *args: str, log: Path, **extra: str) -> subprocess.Popen[bytes]:
    """``celery -A tests.integrations.celery_app ARGS`` in a session of its own (its pool children with it)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.integrations.celery_app", *args],
            cwd=ROOT,
            env=celery_env(folder, dsn, **extra),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes], *, grace: float = 10.0) -> None:
    """SIGTERM ``proc``, then SIGKILL its session (pool children included) if it lingers; wait for it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started for it
    proc.wait(10)


@contextlib.contextmanager
def running(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> Iterator[None]:
    """Stop every process at the end; on failure, show what they logged."""
    try:
        yield
    except BaseException:
        for log in logs:
            if log.exists():
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-6000:]}")
        raise
    finally:
        for proc in procs:
            stop(proc)


def wait_for(predicate: Any, *, timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return it; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = predicate()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(interval)


def sent_messages(broker: Path) -> list[dict[str, Any]]:
    """The messages in the filesystem broker's folder, oldest first, each as its headers and arguments.

    A file a killed beat left half-written was never sent: it is skipped.
    """
    found = []
    for path in sorted(broker.glob("*.msg"), key=lambda p: int(p.name.split("_", 1)[0])):
        try:
            payload = json.loads(path.read_bytes())
        except ValueError:
            continue
        body = json.loads(base64.b64decode(payload["body"]))
        found.append({**payload["headers"], "args": body[0], "sent": int(path.name.split("_", 1)[0]) / 1000})
    return found
