"""A program written against postgres-mutex 0.1.0's README and public API: what each documented call does.

    python -I program.py DSN    (DSN: a database, ideally a schema of its own, where it may create mutex_lock)

Each check uses the library as 0.1.0's README and docstrings describe, and
reports what happened as JSON: the values it saw along the way ("trace") and
what the check returned, or which of 0.1.0's exception types (and built-in
ones) the error it raised is an instance of. Run with 0.1.0 and with this
version against the same server, the two reports are compared check by check.
It uses nothing 0.1.0 did not have.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import postgres_mutex
from postgres_mutex import LockAcquisitionTimeout, LockNotHeldError, Mutex, NullMetrics, PgMutexError

DSN = ""
"""Where the checks run: set from the command line by `main`."""
TIMING: dict[str, Any] = {
    "heartbeat_interval": 0.2,
    "alert_threshold": 1.0,
    "stale_threshold": 3.0,
    "poll_interval": 0.1,
}
ERRORS: dict[str, type[BaseException]] = {
    "LockAcquisitionTimeout": LockAcquisitionTimeout,
    "LockNotHeldError": LockNotHeldError,
    "PgMutexError": PgMutexError,
    "AttributeError": AttributeError,
    "RuntimeError": RuntimeError,
    "TimeoutError": TimeoutError,
    "TypeError": TypeError,
    "ValueError": ValueError,
    "psycopg.Error": psycopg.Error,
    "psycopg.OperationalError": psycopg.OperationalError,
    "psycopg.ProgrammingError": psycopg.ProgrammingError,
}

Check = Callable[[list[Any]], object]
CHECKS: dict[str, Check] = {}
MADE: list[Mutex] = []


def check(name: str) -> Callable[[Check], Check]:
    def register(func: Check) -> Check:
        CHECKS[name] = func
        return func

    return register


def mutex(lock_name: str, **options: Any) -> Mutex:
    made = Mutex(DSN, lock_name, **{**TIMING, **options})
    MADE.append(made)
    return made


def admin() -> psycopg.Connection[Any]:
    return psycopg.connect(DSN, autocommit=True)


def error(exc: BaseException) -> dict[str, Any]:
    """Which of 0.1.0's (and the built-in) exception types ``exc`` is, and the attributes 0.1.0 gave them."""
    found: dict[str, Any] = {
        "raised": sorted(name for name, kind in ERRORS.items() if isinstance(exc, kind)),
        "detail": f"{type(exc).__name__}: {exc}",
    }
    attributes = {key: getattr(exc, key) for key in ("lock_name", "timeout") if hasattr(exc, key)}
    if attributes:
        found["attributes"] = attributes
    return found


@contextlib.contextmanager
def held_elsewhere(lock_name: str) -> Iterator[Mutex]:
    """Another Mutex (another instance) holds ``lock_name`` for the duration of the block."""
    holder = mutex(lock_name)
    with holder.acquire() as acquired:
        assert acquired, f"{lock_name} should have been free"
        yield holder


def wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- construction -----------------------------------------------------------------


@check("Mutex() without a connection source")
def no_source(trace: list[Any]) -> object:
    return Mutex(lock_name="job")


@check("Mutex() without a lock name")
def no_lock_name(trace: list[Any]) -> object:
    return Mutex(DSN)


@check("an empty lock name")
def empty_lock_name(trace: list[Any]) -> object:
    return Mutex(DSN, "")


@check("a lock name of 65 characters")
def long_lock_name(trace: list[Any]) -> object:
    return Mutex(DSN, "x" * 65)


@check("an instance_id of 65 characters")
def long_instance_id(trace: list[Any]) -> object:
    return Mutex(DSN, "job", instance_id="i" * 65)


@check("an empty instance_id")
def empty_instance_id(trace: list[Any]) -> object:
    return len(Mutex(DSN, "job", instance_id="").instance_id) > 0


@check("a table name that is not an identifier")
def bad_table(trace: list[Any]) -> object:
    return Mutex(DSN, "job", table="mutex-lock")


@check("a schema-qualified table name")
def qualified_table(trace: list[Any]) -> object:
    Mutex(DSN, "job", table="public.mutex_lock")
    return "constructed"


@check("heartbeat_interval not under alert_threshold")
def heartbeat_over_alert(trace: list[Any]) -> object:
    return Mutex(DSN, "job", heartbeat_interval=1.0, alert_threshold=1.0, stale_threshold=3.0)


@check("alert_threshold not under stale_threshold")
def alert_over_stale(trace: list[Any]) -> object:
    return Mutex(DSN, "job", heartbeat_interval=0.2, alert_threshold=3.0, stale_threshold=3.0)


@check("a poll_interval of zero")
def zero_poll(trace: list[Any]) -> object:
    return Mutex(DSN, "job", poll_interval=0)


@check("stale_threshold under three heartbeat intervals")
def tight_thresholds(trace: list[Any]) -> object:
    Mutex(DSN, "job", heartbeat_interval=10.0, alert_threshold=20.0, stale_threshold=25.0)
    return "constructed"


@check("a pool-like object that is not a psycopg_pool pool")
def pool_like(trace: list[Any]) -> object:
    class PoolLike:
        def connection(self, timeout: float | None = None) -> Any:
            raise NotImplementedError

    Mutex(lock_name="job", pool=PoolLike())  # type: ignore[arg-type]
    return "constructed"


@check("both a dsn and a pool")
def dsn_and_pool(trace: list[Any]) -> object:
    Mutex(DSN, "job", pool=ConnectionPool(DSN, open=False))
    return "constructed"


@check("mutex.config")
def config(trace: list[Any]) -> object:
    made = Mutex(DSN, "job", instance_id="config-1", table="mutex_lock", **TIMING)
    fields = ("lock_name", "instance_id", "table", "heartbeat_interval", "alert_threshold", "stale_threshold")
    return {field: getattr(made.config, field) for field in (*fields, "poll_interval")}


@check("mutex.dsn, pool, async_pool, metrics, lock_name, instance_id")
def attributes(trace: list[Any]) -> object:
    hook = NullMetrics()
    made = Mutex(DSN, "job", instance_id="attributes-1", metrics=hook)
    return [made.dsn == DSN, made.pool, made.async_pool, made.metrics is hook, made.lock_name, made.instance_id]


@check("exceptions built as 0.1.0 builds them")
def exceptions_positional(trace: list[Any]) -> object:
    timeout = LockAcquisitionTimeout("job", 30)
    not_held = LockNotHeldError("job")
    return [
        str(timeout),
        timeout.lock_name,
        timeout.timeout,
        isinstance(timeout, PgMutexError),
        not_held.lock_name,
        isinstance(not_held, PgMutexError),
    ]


@check("LockAcquisitionTimeout built with keywords")
def timeout_keywords(trace: list[Any]) -> object:
    # Through Any: whether this version's signature takes these keywords is what the check finds out.
    build: Any = LockAcquisitionTimeout
    timeout = build(lock_name="job", timeout=30)
    return [str(timeout), timeout.lock_name, timeout.timeout]


@check("LockNotHeldError built with keywords")
def not_held_keywords(trace: list[Any]) -> object:
    build: Any = LockNotHeldError
    return build(lock_name="job").lock_name


# -- the lock ------------------------------------------------------------------


@check("create_schema(), twice")
def create_schema(trace: list[Any]) -> object:
    made = mutex("create-schema")
    made.create_schema()
    made.create_schema()
    return "created"


@check("create_schema_async()")
def create_schema_async(trace: list[Any]) -> object:
    async def run() -> None:
        made = mutex("create-schema-async")
        await made.create_schema_async()
        await made.close_async()

    asyncio.run(run())
    return "created"


@check("acquire() a free lock")
def acquire_free(trace: list[Any]) -> object:
    made = mutex("acquire-free")
    trace.append(made.held)
    with made.acquire() as acquired:
        trace.append(made.held)
    trace.append(made.held)
    return acquired


@check("acquire() a busy lock, not blocking")
def acquire_busy(trace: list[Any]) -> object:
    with held_elsewhere("acquire-busy"), mutex("acquire-busy").acquire() as acquired:
        return acquired


@check("a blocking acquire() that times out")
def blocking_timeout(trace: list[Any]) -> object:
    with held_elsewhere("blocking-timeout"), mutex("blocking-timeout").acquire(blocking=True, timeout=0.3):
        return "entered"


@check("a blocking acquire() with timeout=0, lock busy")
def blocking_zero(trace: list[Any]) -> object:
    with held_elsewhere("blocking-zero"), mutex("blocking-zero").acquire(blocking=True, timeout=0):
        return "entered"


@check("a blocking acquire() whose timeout is already negative, lock busy")
def blocking_negative(trace: list[Any]) -> object:
    with held_elsewhere("blocking-negative"), mutex("blocking-negative").acquire(blocking=True, timeout=-1):
        return "entered"


@check("acquire() given a timeout without blocking, lock busy")
def nonblocking_timeout(trace: list[Any]) -> object:
    with held_elsewhere("nonblocking-timeout"), mutex("nonblocking-timeout").acquire(timeout=1) as acquired:
        return acquired


@check("a blocking acquire() waits for the holder's release")
def hand_off(trace: list[Any]) -> object:
    with held_elsewhere("hand-off") as holder:
        releaser = threading.Timer(0.3, holder.release)
        releaser.start()
        try:
            with mutex("hand-off").acquire(blocking=True, timeout=10) as acquired:
                return acquired
        finally:
            releaser.join()


@check("release() when nothing is held")
def release_unheld(trace: list[Any]) -> object:
    mutex("release-unheld").release()
    return None


@check("heartbeat() when nothing is held")
def heartbeat_unheld(trace: list[Any]) -> object:
    mutex("heartbeat-unheld").heartbeat()
    return None


@check("heartbeat() while holding")
def heartbeat_held(trace: list[Any]) -> object:
    made = mutex("heartbeat-held")
    with made.acquire() as acquired:
        trace.append(acquired)
        made.heartbeat()
        return None


@check("release() inside the with block")
def release_inside(trace: list[Any]) -> object:
    made = mutex("release-inside")
    with made.acquire() as acquired:
        trace.append(acquired)
        made.release()
        trace.append(made.held)
    return "left the block"


@check("the with block's body raises")
def body_raises(trace: list[Any]) -> object:
    made = mutex("body-raises")
    try:
        with made.acquire():
            raise RuntimeError("the job failed")
    except RuntimeError:
        trace.append("the body's error propagated")
    with mutex("body-raises").acquire() as after:
        return after


@check("the lock's row is deleted by someone else while held")
def row_deleted(trace: list[Any]) -> object:
    made = mutex("row-deleted")
    with made.acquire() as acquired, admin() as conn:
        trace.append(acquired)
        conn.execute("DELETE FROM mutex_lock WHERE lock_name = 'row-deleted'")
        try:
            made.heartbeat()
        except Exception as exc:
            trace.append(error(exc)["raised"])
        trace.append(made.held)
    return "left the block"


@check("heartbeats held up past stale_threshold")
def heartbeats_stalled(trace: list[Any]) -> object:
    made = mutex("heartbeats-stalled")
    with made.acquire() as acquired, admin() as conn:
        trace.append(acquired)
        # Another session locks the row: the holder's heartbeats cannot land, as on a partition.
        with psycopg.connect(DSN) as blocker:
            blocker.execute("SELECT 1 FROM mutex_lock WHERE lock_name = 'heartbeats-stalled' FOR UPDATE")

            def silent_past_stale() -> bool:
                row = conn.execute(
                    "SELECT EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 FROM mutex_lock "
                    "WHERE lock_name = 'heartbeats-stalled'"
                ).fetchone()
                return row is not None and row[0] > TIMING["stale_threshold"] + 0.1

            trace.append(wait_for(silent_past_stale, 10.0))
            trace.append(made.held)
            blocker.rollback()
    return "left the block"


@check("close() while holding")
def close_holding(trace: list[Any]) -> object:
    made = mutex("close-holding")
    holding = made.acquire()  # kept referenced: 0.1.0 releases when an unfinished with-block is collected
    trace.append(holding.__enter__())
    made.close()
    with mutex("close-holding").acquire() as other:
        trace.append(holding is not None)
        return other


@check("a Mutex used again after close()")
def reuse_after_close(trace: list[Any]) -> object:
    made = mutex("reuse-after-close")
    with made.acquire() as first:
        trace.append(first)
    made.close()
    with made.acquire() as again:
        return again


@check("acquire() again on a Mutex that holds its lock")
def acquire_twice(trace: list[Any]) -> object:
    made = mutex("acquire-twice")
    with made.acquire() as acquired:
        trace.append(acquired)
        with made.acquire() as again:
            return again


@check("a row left behind under this Mutex's instance_id")
def own_row(trace: list[Any]) -> object:
    with admin() as conn:
        conn.execute(
            "INSERT INTO mutex_lock (lock_name, locked, instance_id, last_heartbeat, acquired_at) "
            "VALUES ('own-row', 1, 'reused-id', now(), now())"
        )
    with mutex("own-row", instance_id="reused-id").acquire() as acquired:
        return acquired


@check("acquire() with PostgreSQL unreachable")
def unreachable(trace: list[Any]) -> object:
    # Nothing listens on port 1: the connection is refused at once.
    with Mutex("host=127.0.0.1 port=1 dbname=nowhere connect_timeout=2", "unreachable", **TIMING).acquire():
        return "entered"


@check("acquire() on a lock table that does not exist")
def missing_table(trace: list[Any]) -> object:
    with mutex("missing-table", table="no_such_lock_table").acquire():
        return "entered"


# -- decorators ----------------------------------------------------------------


@check("singleton, lock free")
def singleton_free(trace: list[Any]) -> object:
    @mutex("singleton-free").singleton()
    def job() -> int:
        return 42

    return job()


@check("singleton, lock busy")
def singleton_busy(trace: list[Any]) -> object:
    @mutex("singleton-busy").singleton()
    def job() -> int:
        return 42

    with held_elsewhere("singleton-busy"):
        return job()


@check("singleton under another lock name")
def singleton_sibling(trace: list[Any]) -> object:
    made = mutex("singleton-first")

    @made.singleton("singleton-second")
    def job() -> bool:
        with admin() as conn:
            row = conn.execute("SELECT instance_id FROM mutex_lock WHERE lock_name = 'singleton-second'").fetchone()
        return row is not None and row[0] == made.instance_id

    return job()


@check("singleton blocking with a timeout, lock busy")
def singleton_timeout(trace: list[Any]) -> object:
    @mutex("singleton-timeout").singleton(blocking=True, timeout=0.3)
    def job() -> int:
        return 42

    with held_elsewhere("singleton-timeout"):
        return job()


@check("singleton_async, lock free and busy")
def singleton_async(trace: list[Any]) -> object:
    made = mutex("singleton-async")

    @made.singleton_async(blocking=False)
    async def job() -> int:
        return 42

    async def run() -> list[int | None]:
        free = await job()
        with held_elsewhere("singleton-async"):
            busy = await job()
        await made.close_async()
        return [free, busy]

    return asyncio.run(run())


@check("acquire_async() a free lock")
def acquire_async_free(trace: list[Any]) -> object:
    made = mutex("acquire-async-free")

    async def run() -> bool:
        async with made.acquire_async() as acquired:
            trace.append(made.held)
        trace.append(made.held)
        await made.close_async()
        return acquired

    return asyncio.run(run())


@check("acquire_async() times out, lock busy")
def acquire_async_timeout(trace: list[Any]) -> object:
    made = mutex("acquire-async-timeout")

    async def run() -> str:
        try:
            async with made.acquire_async(blocking=True, timeout=0.3):
                return "entered"
        finally:
            await made.close_async()

    with held_elsewhere("acquire-async-timeout"):
        return asyncio.run(run())


# -- pools ------------------------------------------------------------------------


@check("a pool Mutex")
def pool_mode(trace: list[Any]) -> object:
    with ConnectionPool(DSN, min_size=1, max_size=2, open=True) as pool:
        made = Mutex(lock_name="pool-mode", pool=pool, **TIMING)
        trace.append(made.pool is pool)
        with made.acquire() as acquired:
            trace.append(made.held)
        made.close()
        return acquired


@check("a pool-only Mutex used from async code")
def pool_from_async(trace: list[Any]) -> object:
    with ConnectionPool(DSN, min_size=1, max_size=2, open=True) as pool:
        made = Mutex(lock_name="pool-from-async", pool=pool, **TIMING)

        async def run() -> str:
            async with made.acquire_async():
                return "entered"

        try:
            return asyncio.run(run())
        finally:
            made.close()


@check("an async_pool-only Mutex used from sync code")
def async_pool_from_sync(trace: list[Any]) -> object:
    pool = AsyncConnectionPool(DSN, min_size=1, max_size=2, open=False)
    made = Mutex(lock_name="async-pool-from-sync", async_pool=pool, **TIMING)
    with made.acquire():
        return "entered"


# -- metrics ------------------------------------------------------------------------


class SixMethodHook:
    """0.1.0's README hook: its six methods, with exactly their signatures."""

    def __init__(self) -> None:
        self.calls: set[tuple[str, str, str]] = set()

    def acquired(self, lock_name: str, *, instance_id: str) -> None:
        self.calls.add(("acquired", "instance_id", instance_id))

    def released(self, lock_name: str, *, instance_id: str) -> None:
        self.calls.add(("released", "instance_id", instance_id))

    def contended(self, lock_name: str, *, instance_id: str) -> None:
        self.calls.add(("contended", "instance_id", instance_id))

    def stale_reclaimed(self, lock_name: str, *, instance_id: str, previous_holder: str) -> None:
        self.calls.add(("stale_reclaimed", "previous_holder", previous_holder))

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        silent = TIMING["alert_threshold"] <= seconds_since_heartbeat < TIMING["stale_threshold"]
        self.calls.add(("alert", "holder", f"{holder}, silent past alert_threshold: {silent}"))

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        self.calls.add(("heartbeat_latency", "instance_id", instance_id))


@check("a metrics hook with 0.1.0's six methods")
def six_method_hook(trace: list[Any]) -> object:
    hook = SixMethodHook()
    first = mutex("six-methods", instance_id="hook-first", metrics=hook)
    second = mutex("six-methods", instance_id="hook-second", metrics=hook)
    with first.acquire() as acquired, second.acquire() as contended:
        trace.extend([acquired, contended])
        trace.append(wait_for(lambda: ("heartbeat_latency", "instance_id", "hook-first") in hook.calls, 5.0))
    with admin() as conn:
        # A holder that went silent: past alert_threshold, then past stale_threshold.
        conn.execute(
            "INSERT INTO mutex_lock (lock_name, locked, instance_id, last_heartbeat, acquired_at) "
            "VALUES ('six-methods', 1, 'silent-holder', now() - interval '2 seconds', now() - interval '1 minute')"
        )
        with second.acquire() as while_alerting:
            trace.append(while_alerting)
        conn.execute("UPDATE mutex_lock SET last_heartbeat = now() - interval '5 seconds'")
        with second.acquire() as reclaimed:
            trace.append(reclaimed)
    return sorted(hook.calls)


@check("the type of the seconds a hook's alert() is given")
def alert_seconds_type(trace: list[Any]) -> object:
    given: list[str] = []

    class Hook:
        def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
            given.append(type(seconds_since_heartbeat).__name__)

    with admin() as conn:
        conn.execute(
            "INSERT INTO mutex_lock (lock_name, locked, instance_id, last_heartbeat, acquired_at) "
            "VALUES ('alert-seconds', 1, 'silent-holder', now() - interval '2 seconds', now())"
        )
    with mutex("alert-seconds", metrics=Hook()).acquire() as acquired:
        trace.append(acquired)
    return given


@check("NullMetrics as the hook")
def null_metrics(trace: list[Any]) -> object:
    with mutex("null-metrics", metrics=NullMetrics()).acquire() as acquired:
        return acquired


def main() -> None:
    global DSN
    DSN = sys.argv[1]
    report: dict[str, dict[str, Any]] = {}
    for name, func in CHECKS.items():
        trace: list[Any] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                returned = func(trace)
            except Exception as exc:
                report[name] = {"trace": trace, **error(exc)}
            else:
                plain = returned is None or isinstance(returned, bool | int | float | str | list | dict)
                report[name] = {"trace": trace, "returned": returned if plain else "constructed"}
        report[name]["warnings"] = sorted({warning.category.__name__ for warning in caught})
    for made in MADE:
        with contextlib.suppress(Exception):
            made.close()
    print(json.dumps({"version": postgres_mutex.__version__, "checks": report}, default=str))


if __name__ == "__main__":
    main()
