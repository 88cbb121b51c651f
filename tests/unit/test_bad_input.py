"""Bad arguments fail at construction, with an error that names the argument; the command line's as a usage error."""

from __future__ import annotations

import copy
import math
import pickle
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from postgres_mutex import Election, LockAcquisitionTimeout, LockNotHeldError, LockTable, Mutex, RWLock, Semaphore
from postgres_mutex.errors import InvalidArgument, PermitsMismatchError, SchemaError, phrase
from postgres_mutex.watcher import StaleWatcher
from tests.support.fixtures import ROOT

DSN = "host=127.0.0.1 dbname=app"


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"lock_name": ""}, ValueError, "lock_name"),
        ({"lock_name": "x" * 65}, ValueError, "lock_name"),
        ({"lock_name": "bad\x00name"}, ValueError, "lock_name"),
        ({"lock_name": 42}, TypeError, "lock_name"),
        ({"instance_id": "i" * 65}, ValueError, "instance_id"),
        ({"instance_id": "a\x00b"}, ValueError, "instance_id"),
        ({"instance_id": b"bytes"}, TypeError, "instance_id"),
        ({"heartbeat_interval": 0}, ValueError, "heartbeat_interval"),
        ({"heartbeat_interval": -1}, ValueError, "heartbeat_interval"),
        ({"heartbeat_interval": float("nan")}, ValueError, "heartbeat_interval"),
        ({"heartbeat_interval": "10"}, TypeError, "heartbeat_interval"),
        ({"heartbeat_interval": True}, TypeError, "heartbeat_interval"),
        ({"alert_threshold": float("inf")}, ValueError, "alert_threshold"),
        ({"stale_threshold": -600}, ValueError, "stale_threshold"),
        ({"poll_interval": 0}, ValueError, "poll_interval"),
        ({"operation_timeout": 0}, ValueError, "operation_timeout"),
        ({"heartbeat_interval": 30, "alert_threshold": 30}, ValueError, "heartbeat_interval"),
        ({"alert_threshold": 700}, ValueError, "alert_threshold"),
        ({"alert_threshold": 600, "stale_threshold": 600}, ValueError, "stale_threshold"),
        ({"table": "a.b.c"}, ValueError, "table"),
        ({"table": "mutex lock"}, ValueError, "table"),
        ({"table": 'x"; DROP TABLE users; --'}, ValueError, "table"),
        ({"table": "1abc"}, ValueError, "table"),
        ({"table": "t" * 64}, ValueError, "table"),
        ({"table": ""}, ValueError, "table"),
        ({"table": None}, TypeError, "table"),
        ({"on_lost": "not callable"}, TypeError, "on_lost"),
    ],
)
def test_bad_argument_is_named(kwargs: dict[str, Any], error: type[Exception], names: str) -> None:
    kwargs = {"lock_name": "job", **kwargs}
    with pytest.raises(error, match=names):
        Mutex(DSN, **kwargs)


def test_a_bad_value_names_its_arguments_as_data_for_every_interface() -> None:
    # The command line names its flags where the library names its arguments: from the error's
    # data, not by rewriting its English.
    with pytest.raises(InvalidArgument) as caught:
        Mutex(DSN, "job", heartbeat_interval=15, alert_threshold=20, stale_threshold=40)
    error = caught.value
    assert isinstance(error, ValueError)
    assert error.arguments == ("stale_threshold", "heartbeat_interval")
    assert str(error).startswith("stale_threshold (40s) must be at least three times heartbeat_interval (15s)")
    said = error.phrase.render({"stale_threshold": "--stale-threshold", "heartbeat_interval": "--heartbeat-interval"})
    assert said.startswith("--stale-threshold (40s) must be at least three times --heartbeat-interval (15s)")
    assert "stale_threshold" not in said


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"lock_name": ""}, "lock_name"),
        ({"instance_id": "a\x00b"}, "instance_id"),
        ({"heartbeat_interval": float("nan")}, "heartbeat_interval"),
        ({"poll_interval": 1e-6}, "poll_interval"),
        ({"operation_timeout": 0}, "operation_timeout"),
        ({"alert_threshold": 700}, "alert_threshold"),
        ({"table": "a.b.c"}, "table"),
        ({"table": "1abc"}, "table"),
    ],
)
def test_every_bad_value_names_its_argument_as_data(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        Mutex(DSN, **{"lock_name": "job", **kwargs})
    assert caught.value.arguments[0] == argument
    assert argument not in caught.value.phrase.render({argument: "--flag"})


def test_a_value_quoted_in_an_error_is_text_never_a_term() -> None:
    # A lock name with braces stays as it is, in every interface's words.
    with pytest.raises(InvalidArgument) as caught:
        Mutex(DSN, "{instance_id}\ud800")
    assert caught.value.arguments == ("lock_name",)
    assert "'{instance_id}\\ud800'" in caught.value.phrase.render({"instance_id": "--instance-id"})


ON_THE_BOUND = {"heartbeat_interval": 0.2, "alert_threshold": 0.4}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stale_threshold": 0.6},
        {"stale_threshold": 3.0, "reclaim_disconnected_after": 0.6},
        {"stale_threshold": 3.0, "reclaim_disconnected_after": 0.7, "operation_timeout": 0.3},
    ],
    ids=["stale_threshold 3 x heartbeat_interval", "reclaim_disconnected_after 3 x", "reclaim 2 x heartbeat + timeout"],
)
def test_a_value_exactly_on_its_documented_bound_is_allowed(kwargs: dict[str, float]) -> None:
    # 3 * 0.2 is 0.6000000000000001 in floating point: the docs' bound is the one typed, not its rounding.
    Mutex(DSN, "job", **ON_THE_BOUND, **kwargs).close()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"stale_threshold": 0.59}, "stale_threshold (0.59s) must be at least three times heartbeat_interval (0.2s)"),
        (
            {"stale_threshold": 3.0, "reclaim_disconnected_after": 0.59},
            "reclaim_disconnected_after (0.59s) must be at least three times heartbeat_interval (0.2s)",
        ),
        (
            {"stale_threshold": 3.0, "reclaim_disconnected_after": 0.69, "operation_timeout": 0.3},
            "reclaim_disconnected_after (0.69s) must be at least two heartbeat_intervals plus operation_timeout "
            "(2 x 0.2s + 0.3s)",
        ),
    ],
)
def test_a_value_under_its_bound_is_refused_saying_the_bound_as_documented(kwargs: dict[str, float], said: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        Mutex(DSN, "job", **ON_THE_BOUND, **kwargs)  # type: ignore[arg-type]
    assert str(caught.value).startswith(said)


@pytest.mark.parametrize(
    ("argument", "value", "minimum"),
    [("heartbeat_interval", 1e-9, "0.05"), ("heartbeat_interval", 0.049, "0.05"), ("poll_interval", 1e-6, "0.01")],
)
def test_an_interval_that_would_hammer_the_server_is_refused_naming_the_minimum(
    argument: str, value: float, minimum: str
) -> None:
    with pytest.raises(ValueError, match=rf"{argument} must be at least {minimum} seconds"):
        Mutex(DSN, "job", **{argument: value})  # type: ignore[arg-type]
    Mutex(DSN, "job", **{argument: float(minimum)}).close()  # type: ignore[arg-type]  # the minimum is allowed


def test_lock_name_is_required() -> None:
    with pytest.raises(TypeError, match="lock_name"):
        Mutex(DSN)


@pytest.mark.parametrize("name", ["partner-api\x1f0", "catalogue\x1fw", "\x1f"])
def test_a_mutex_or_election_name_with_the_unit_separator_is_refused(name: str) -> None:
    # A semaphore's permit or a read/write lock's holder is a row named with it: a mutex must not share one.
    with pytest.raises(InvalidArgument, match=r"lock_name must not contain the unit separator"):
        Mutex(DSN, name)
    with pytest.raises(InvalidArgument, match=r"name must not contain the unit separator"):
        Election(DSN, name)
    with pytest.raises(InvalidArgument, match=r"lock_name must not contain the unit separator"):
        Mutex(DSN, "job").singleton(name)


def test_a_64_character_name_is_fine() -> None:
    assert Mutex(DSN, "é" * 64, instance_id="i" * 64).lock_name == "é" * 64


def test_a_way_to_reach_postgres_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="pass dsn, or pool and/or async_pool, or set PGHOST") as caught:
        Mutex(lock_name="job")
    assert "dsn=''" in str(caught.value), "it says how to ask for libpq's defaults on purpose"


@pytest.mark.parametrize("variable", ["PGHOST", "PGSERVICE", "PGDATABASE"])
def test_no_dsn_and_no_pool_means_the_pg_environment(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    for name in ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "somewhere")
    mutex = Mutex(lock_name="job")
    assert mutex.dsn == "", "an empty conninfo: libpq reads the PG* variables, as psql does"
    mutex.close()


def test_dsn_and_pool_together_are_refused(dsn: str) -> None:
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    pool = ConnectionPool(dsn, open=False)
    async_pool = AsyncConnectionPool(dsn, open=False)
    with pytest.raises(ValueError, match="either dsn or pool"):
        Mutex(dsn, "job", pool=pool)
    with pytest.raises(ValueError, match="either dsn or pool"):
        Mutex(dsn, "job", async_pool=async_pool)


def test_pools_of_the_wrong_flavour_are_refused(dsn: str) -> None:
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    with pytest.raises(TypeError, match=r"pool must be a psycopg_pool\.ConnectionPool"):
        Mutex(lock_name="job", pool=AsyncConnectionPool(dsn, open=False))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="async_pool must be"):
        Mutex(lock_name="job", async_pool=ConnectionPool(dsn, open=False))  # type: ignore[arg-type]


def test_dsn_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match="dsn must be a str"):
        Mutex(b"host=x", "job")  # type: ignore[arg-type]


def test_a_malformed_dsn_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="dsn is not a valid connection string"):
        Mutex("host=x port", "job")


def test_a_single_name_given_as_lock_names_is_refused_not_iterated(dsn: str) -> None:
    with pytest.raises(TypeError, match=r"lock_names must be a list of lock names.*\['nightly'\]"):
        StaleWatcher(dsn, lock_names="nightly")


@pytest.mark.parametrize("argument", ["lock_name", "instance_id"])
def test_a_lone_surrogate_is_a_value_error_naming_the_argument(dsn: str, argument: str) -> None:
    bad = "job-\udcff"
    kwargs: dict[str, Any] = {"lock_name": "job", argument: bad}
    with pytest.raises(ValueError, match=argument):
        Mutex(dsn, **kwargs)


@pytest.mark.parametrize(
    ("argument", "value"),
    [("stale_threshold", 1e300), ("alert_threshold", 2e9), ("operation_timeout", 3e6)],
)
def test_values_postgresql_or_libpq_cannot_take_are_refused_at_construction(
    dsn: str, argument: str, value: float
) -> None:
    kwargs: dict[str, Any] = {argument: value}
    if argument == "alert_threshold":
        kwargs["stale_threshold"] = 3e9
    with pytest.raises(ValueError, match=argument):
        Mutex(dsn, "job", **kwargs)


def test_the_cli_refuses_a_huge_threshold_as_a_usage_error(dsn: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "postgres_mutex",
            "run",
            "--dsn",
            dsn,
            "--lock",
            "x",
            "--stale-threshold",
            "1e300",
            "--",
            "true",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "--stale-threshold must be at most" in result.stderr


@pytest.mark.parametrize(
    ("call", "error", "names"),
    [
        (lambda m: m.acquire(blocking=True, timeout=math.nan), ValueError, "timeout"),
        (lambda m: m.acquire(blocking=True, timeout="soon"), TypeError, "timeout"),
        (lambda m: m.acquire(blocking="yes"), TypeError, "blocking"),
        (lambda m: m.singleton(""), ValueError, "lock_name"),
    ],
)
def test_bad_acquire_arguments_are_named(call: Callable[[Mutex], Any], error: type[Exception], names: str) -> None:
    mutex = Mutex(DSN, "job")
    with pytest.raises(error, match=names):
        manager = call(mutex)
        manager.__enter__()


@pytest.mark.parametrize(
    ("kwargs", "error", "said"),
    [
        ({"hold_at_least": 0}, ValueError, "hold_at_least must be greater than zero"),
        ({"hold_at_least": -5}, ValueError, "hold_at_least must be greater than zero"),
        ({"hold_at_least": math.nan}, ValueError, "hold_at_least must be a finite number"),
        ({"hold_at_least": "60"}, TypeError, "hold_at_least must be a number"),
        (
            {"hold_at_least": 601},
            ValueError,
            "hold_at_least (601s) must be at most stale_threshold (600s): a holder killed after acquiring",
        ),
        ({"hold_at_least": 61, "stale_threshold": 60, "alert_threshold": 20}, ValueError, "at most stale_threshold"),
    ],
)
def test_a_bad_minimum_hold_is_refused_by_the_constructor_and_by_acquire(
    kwargs: dict[str, Any], error: type[Exception], said: str
) -> None:
    with pytest.raises(error, match=re.escape(said)):
        Mutex(DSN, "job", **kwargs)
    hold = kwargs.pop("hold_at_least")
    mutex = Mutex(DSN, "job", **kwargs)
    with pytest.raises(error, match=re.escape(said)):
        mutex.acquire(hold_at_least=hold)
    with pytest.raises(error, match=re.escape(said)):
        mutex.acquire_async(hold_at_least=hold)


def test_a_minimum_hold_on_its_bound_is_allowed() -> None:
    mutex = Mutex(DSN, "job", stale_threshold=60, alert_threshold=20, hold_at_least=60)
    mutex.acquire(hold_at_least=60)
    assert mutex.config.hold_at_least == 60


@pytest.mark.parametrize(
    "call",
    [
        lambda: Semaphore(DSN, "job", permits=2).acquire(hold_at_least=5),
        lambda: Semaphore(DSN, "job", permits=2).acquire_async(hold_at_least=5),
    ],
)
def test_a_minimum_hold_is_a_mutexs_alone(call: Callable[[], Any]) -> None:
    with pytest.raises(ValueError, match="hold_at_least is a Mutex's"):
        call()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--hold-at-least", "601"], "--hold-at-least (601s) must be at most --stale-threshold (600s)"),
        (["--hold-at-least", "0"], "argument --hold-at-least: must be a positive number of seconds"),
        (["--hold-at-least", "5", "--permits", "2"], "--hold-at-least is a plain lock's minimum hold"),
        (["--hold-at-least", "5", "--write"], "it does not take --write"),
        (["--hold-at-least", "5", "--restart"], "it does not take --restart"),
    ],
)
def test_the_cli_refuses_a_bad_minimum_hold_naming_its_flags(flags: list[str], said: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "postgres_mutex", "run", "--dsn", DSN, "--lock", "x", *flags, "--", "true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert said in result.stderr


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.acquire(blocking=False, timeout=5),
        lambda m: m.acquire_async(blocking=False, timeout=1),
        lambda m: m.singleton(blocking=False, timeout=1),
        lambda m: m.singleton_async(blocking=False, timeout=1),
        lambda m: RWLock(DSN, "job").read(blocking=False, timeout=1),
        lambda m: RWLock(DSN, "job").write_async(blocking=False, timeout=1),
        lambda m: RWLock(DSN, "job").write_singleton(blocking=False, timeout=1),
        lambda m: Semaphore(DSN, "job", permits=2).acquire(blocking=False, timeout=1),
    ],
)
def test_a_timeout_on_a_non_blocking_acquire_is_refused_as_threading_lock_refuses_it(
    call: Callable[[Mutex], Any],
) -> None:
    with pytest.raises(ValueError, match="can't specify a timeout for a non-blocking acquire"):
        call(Mutex(DSN, "job"))


def test_an_empty_instance_id_means_the_default_one_as_in_0_1_0() -> None:
    import socket

    chosen = Mutex(DSN, "job", instance_id="").instance_id
    assert re.fullmatch(rf"{re.escape(socket.gethostname())}-[0-9a-f]{{8}}", chosen), chosen


def test_default_instance_ids_are_unique_and_readable() -> None:
    import socket

    ids = {Mutex(DSN, "job").instance_id for _ in range(50)}
    assert len(ids) == 50
    assert all(i.startswith(socket.gethostname()[:20]) and 1 <= len(i) <= 64 for i in ids)


@pytest.mark.parametrize(
    "error",
    [
        LockAcquisitionTimeout("lock 'x' still held by b after 5s", 5.0, lock_name="x", holder="b"),
        LockNotHeldError("lock 'x' is not held: its lease ran out", lock_name="x", instance_id="a", reason="lease"),
        LockNotHeldError("job"),
        PermitsMismatchError("semaphore 'x' has 2 permits", semaphore="x", permits=3, stored_permits=2),
        SchemaError(phrase("run {LockTable.migrate()} on {table}", table="locks"), sqlstate="42P01"),
    ],
)
def test_errors_cross_process_boundaries_as_they_are(error: Exception) -> None:
    """Pickled (multiprocessing, a task queue) or copied, an error keeps its message and its attributes."""
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):  # noqa: S301 - our own bytes
        assert type(again) is type(error)
        assert str(again) == str(error)
        assert vars(again) == vars(error)


@pytest.mark.parametrize("argument", ["celery_beat", "apscheduler"])
@pytest.mark.parametrize("value", [5, "not a table!", "a.b.c"])
def test_an_integrations_table_that_is_no_name_is_refused_naming_its_argument(
    dsn: str, argument: str, value: object
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        LockTable(dsn).create(**{argument: value})  # type: ignore[arg-type]
    assert caught.value.arguments == (argument,)


def test_an_acquisition_used_as_a_bool_is_refused_not_taken_as_held(dsn: str) -> None:
    # `if mutex.acquire():`, as with threading.Lock, would otherwise run its body without the lock.
    mutex = Mutex(dsn, "job")
    rwlock = RWLock(dsn, "report")
    semaphore = Semaphore(dsn, "pool", permits=2)
    try:
        for acquisition in (mutex.acquire(), mutex.acquire(blocking=False), rwlock.read(), semaphore.acquire()):
            with pytest.raises(TypeError, match=r"write `with mutex\.acquire\(\) as acquired:`"):
                bool(acquisition)
        for pending in (mutex.acquire_async(), rwlock.write_async()):
            with pytest.raises(TypeError, match=r"write `async with mutex\.acquire_async\(\) as acquired:`"):
                bool(pending)
    finally:
        mutex.close()
        rwlock.close()
        semaphore.close()
