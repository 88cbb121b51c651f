"""A singleton task's own retry runs: real workers, prefork and threads, on a real Redis broker.

Two workers, one slot each, on a Redis server the test starts: whichever
worker runs an attempt, the retry it sends (``countdown=0``) is taken up at
once by the other, idle one. The test app makes that happen before the first
worker goes on (it waits until the retry was taken up, see
``tests.integrations.celery_app``), so a retry that reached the queue while
its own attempt still held the lock would be skipped every time, not now and
then.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fixtures import required_module, skip_or_fail_in_ci

required_module("celery", "the Celery integration's tests run real Celery workers: pip install -e '.[celery]'")
required_module("redis", "the retry tests use Redis as Celery's broker: pip install -e '.[dev]'")

from celery import Celery  # noqa: E402

from bench import peer_servers  # noqa: E402
from tests.integrations.celery_app import FAILURES, configure  # noqa: E402
from tests.integrations.celery_support import running, start_celery, wait_for  # noqa: E402

TASKS = "tests.integrations.celery_app"


@pytest.fixture(scope="module")
def workers(dsn: str, schema: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Celery, Path]]:
    """A Redis server, a prefork worker and a threads worker on it (one slot each), and a client app."""
    folder = tmp_path_factory.mktemp("celery-retry")
    with contextlib.ExitStack() as stack:
        try:
            port = stack.enter_context(peer_servers.redis())
        except peer_servers.Unavailable as exc:
            skip_or_fail_in_ci(f"the retry tests need a Redis server as Celery's broker: {exc}")
        url = f"redis://127.0.0.1:{port}/0"
        logs = [folder / f"{pool}.log" for pool in ("prefork", "threads")]
        procs = [
            start_celery(
                folder,
                dsn,
                "worker",
                "--pool",
                pool,
                "--concurrency",
                "1",
                "-n",
                f"{pool}@%h",
                "--loglevel",
                "INFO",
                log=log,
                CELERY_TEST_REDIS_URL=url,
            )
            for pool, log in zip(("prefork", "threads"), logs, strict=True)
        ]
        with running(procs, logs):
            client = Celery("celery_retry_client")
            configure(client, folder, dsn, url)
            wait_for(lambda: len(client.control.ping(timeout=0.5)) == 2, timeout=60, what="both workers answer")
            yield client, folder


def bodies(folder: Path, marker: str) -> list[dict[str, Any]]:
    """The runs of ``marker``'s body, in attempt order."""
    found = [json.loads(path.read_text()) for path in folder.glob(f"body-{marker}-*")]
    return sorted(found, key=lambda body: body["attempt"])


@pytest.mark.parametrize(
    "task", ["flaky", "flaky_or_raise", "flaky_retrying", "flaky_retrying_or_wait", "flaky_retrying_then_cleaning_up"]
)
def test_a_retried_singleton_runs_its_body_until_it_succeeds(workers: tuple[Celery, Path], task: str) -> None:
    """``autoretry_for`` (skip and raise policies) and ``self.retry`` (skip and wait), ``countdown=0``.

    The last task asks for its retry with ``throw=False`` and goes on a
    moment: its retry must not run beside the rest of its body.
    """
    client, folder = workers
    for _ in range(2):
        marker = uuid.uuid4().hex[:8]
        outcome = client.send_task(f"{TASKS}.{task}", args=(marker,)).get(timeout=30)
        assert outcome == {"marker": marker, "attempt": FAILURES}, "the chain ended before its body succeeded"
        ran = bodies(folder, marker)
        assert [body["attempt"] for body in ran] == [0, 1, 2]
        for before, after in itertools.pairwise(ran):
            assert after["start"] >= before["end"], "a retry's body ran beside its attempt's"
        assert len({body["pid"] for body in ran}) == 2, "the retries did not alternate between the two workers"
