"""What a Celery user gets wrong, told in Celery's words: in-process, with no worker or beat to start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fixtures import required_module

required_module("celery", "the Celery integration's tests need Celery: pip install -e '.[celery]'")

from celery import Celery  # noqa: E402

from postgres_mutex import LockAcquisitionTimeout, Mutex, MutexError  # noqa: E402
from postgres_mutex.integrations.celery import SKIPPED, LeaderScheduler, SingletonTask, close_clients  # noqa: E402
from postgres_mutex.integrations.celery.tasks import lock_name_for  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _closed_at_the_end() -> Iterator[None]:
    """The tasks run here, in the test process: close their client before the suite stops its server."""
    yield
    close_clients()


def test_an_unknown_contention_policy_is_refused_when_the_task_is_registered() -> None:
    app = Celery("config_test", set_as_current=False)
    with pytest.raises(ValueError, match="singleton_on_contention must be one of skip, wait, raise"):

        @app.task(base=SingletonTask, singleton_on_contention="sometimes", shared=False)  # type: ignore[untyped-decorator]
        def job() -> None: ...

        app.finalize()
        assert job.name


def test_a_singleton_task_without_a_dsn_says_which_setting_is_missing() -> None:
    app = Celery("config_test", set_as_current=False)

    @app.task(base=SingletonTask, shared=False)  # type: ignore[untyped-decorator]
    def job() -> str:
        return "ran"

    with pytest.raises(MutexError, match="postgres_mutex_dsn is not set"):
        job.apply(throw=True).get()


def test_a_key_naming_no_argument_is_an_error_naming_it(dsn: str, schema: None) -> None:
    app = Celery("config_test", set_as_current=False)
    app.conf.postgres_mutex_dsn = dsn

    @app.task(base=SingletonTask, singleton_key=["acount"], shared=False)  # type: ignore[untyped-decorator]
    def job(account: int) -> int:
        return account

    with pytest.raises(TypeError, match=r"singleton_key names \['acount'\]"):
        job.apply(args=(1,), throw=True).get()


def test_a_run_with_the_lock_free_runs_and_returns_its_value(dsn: str, schema: None) -> None:
    app = Celery("config_test", set_as_current=False)
    app.conf.postgres_mutex_dsn = dsn

    @app.task(base=SingletonTask, singleton_key=["account"], shared=False)  # type: ignore[untyped-decorator]
    def job(account: int, note: str = "") -> int:
        return account

    assert job.apply(args=(5,)).get() == 5
    assert job.apply(args=(5,)).get() != SKIPPED  # the first run released its lock


def test_long_lock_names_fit_the_table_and_stay_distinct() -> None:
    names = {lock_name_for("tasks.refresh_account_balances", [("account", "x" * 80 + str(n))]) for n in range(3)}
    assert len(names) == 3
    assert all(len(name) <= 64 for name in names)
    assert lock_name_for("tasks.job", [("account", 7)]) == "tasks.job(account=7)"


def test_a_beat_without_a_dsn_stops_naming_the_setting(tmp_path: Path) -> None:
    app = Celery("config_test", set_as_current=False)
    scheduler = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))
    try:
        with pytest.raises(MutexError, match="postgres_mutex_beat_dsn is not set"):
            scheduler.tick()
    finally:
        scheduler.close()


def test_a_waiting_run_gives_up_after_its_timeout(dsn: str, schema: None) -> None:
    app = Celery("config_test", set_as_current=False)
    app.conf.postgres_mutex_dsn = dsn

    @app.task(base=SingletonTask, singleton_on_contention="wait", singleton_timeout=0.5, shared=False)  # type: ignore[untyped-decorator]
    def job() -> str:
        return "ran"

    holder = Mutex(dsn, job.singleton_lock_for((), {}))
    try:
        with holder.acquire(), pytest.raises(LockAcquisitionTimeout):
            job.apply(throw=True).get()
    finally:
        holder.close()
    assert job.apply(throw=True).get() == "ran"
