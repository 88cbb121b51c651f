"""`Mutex`: the public API, sync and async, over the shared flows."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from . import _flows as flows
from ._background import AsyncBackground, Background, SyncBackground
from ._metrics import MetricsDispatch
from ._rules import WatchAlerts
from ._runners import AsyncRunner, SyncRunner, acquire_without_blocking
from ._settings import Timing, check_name, check_seconds
from ._sql import Statements
from ._state import LockState, LostCallback, Status
from ._tracing import Tracing, database_attributes
from ._transport import Transport
from .errors import LockAlreadyHeldError, MutexError

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from .watcher import StaleWatcher

logger = logging.getLogger("postgres_mutex")

P = ParamSpec("P")
R = TypeVar("R")

# Mutexes that may have a row in the table (held, being released, or left by
# an unanswered statement), deleted by `_release_all_at_exit`. Strong
# references: a holder dropped by its owner keeps heartbeating until exit, and
# must still be found then.
_MAY_HOLD_ROW: set[Mutex] = set()
_MAY_HOLD_ROW_LOCK = threading.Lock()
# Every Mutex, to reset after fork().
_ALL: weakref.WeakSet[Mutex] = weakref.WeakSet()


class _OwnLockWatch:
    """``Mutex(..., watch=True)``: a watcher of the Mutex's own lock, through its own hook.

    It shares the Mutex's connections and alert gate (one alert per episode,
    whether a contender or the watcher saw it first), and starts with the
    Mutex's first operation: a thread for sync use, a task for async use.
    """

    def __init__(self, mutex: Mutex) -> None:
        from .watcher import StaleWatcher

        state = mutex._state
        timing = state.timing
        context = flows.WatchContext(
            statements=mutex._lock.statements,
            lock_names=frozenset({state.lock_name}),
            alert_threshold=timing.alert_threshold,
            stale_threshold=timing.stale_threshold,
            interval=min(5.0, timing.alert_threshold / 2),
            operation_timeout=timing.operation_timeout,
            alerts=WatchAlerts(timing.alert_threshold),
            metrics=state.metrics,
        )
        self.watcher: StaleWatcher = StaleWatcher._for_lock(
            mutex._transport, context, shared_gate=(state.lock_name, state.alert_gate)
        )
        self._mutex = mutex
        self._task: AsyncBackground | None = None

    def start_sync(self) -> None:
        self.watcher.start()

    def start_async(self) -> None:
        if self._task is None or not self._task.running:
            self._task = AsyncBackground(
                self._mutex._transport,
                flows.watch_forever(self.watcher._context),
                name="postgres-mutex-watcher",
                on_crash=lambda exc: None,
            )

    def stop(self) -> None:
        self.watcher.stop()
        task, self._task = self._task, None
        if task is not None:
            task.stop()


class Mutex:
    """A distributed mutex: one row per lock in a PostgreSQL table.

    Give it a ``dsn`` (it then owns one lazily opened connection per flavour,
    sync and async) or a psycopg_pool ``pool`` and/or ``async_pool`` (it then
    borrows a connection per operation and never opens, owns or closes one).

    While held, the lock is renewed by a heartbeat every
    ``heartbeat_interval`` seconds (a thread for sync holds, a task for async
    ones). A holder silent for ``alert_threshold`` triggers the ``alert``
    metrics call in contenders; one silent for ``stale_threshold`` may be
    reclaimed. The holder itself gives the lock up as lost one heartbeat
    interval before that (its *lease*): `held` turns false, `ensure_held`
    raises `LockNotHeldError`, ``on_lost`` and the ``lost`` metrics call fire,
    and leaving the ``with`` block raises `LockNotHeldError`.

    Every database statement must finish within ``operation_timeout``
    seconds, even on a network that silently drops everything.

    Raises `TypeError` or `ValueError`, naming the argument, on bad input.
    """

    _transport: Transport
    _state: LockState
    _lock: flows.LockContext
    _heartbeat: Background | None
    _sweeper: Background | None
    _siblings: dict[str, Mutex]
    _options: dict[str, Any]

    def __init__(
        self,
        dsn: str | None = None,
        lock_name: str | None = None,
        *,
        pool: ConnectionPool[Any] | None = None,
        async_pool: AsyncConnectionPool[Any] | None = None,
        instance_id: str | None = None,
        table: str = "mutex_lock",
        heartbeat_interval: float = 10.0,
        alert_threshold: float = 30.0,
        stale_threshold: float = 600.0,
        poll_interval: float = 0.5,
        metrics: object | None = None,
        on_lost: LostCallback | None = None,
        operation_timeout: float = 5.0,
        watch: bool = False,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        if lock_name is None:
            raise TypeError("Mutex() missing required argument: 'lock_name'")
        check_name(lock_name, "lock_name")
        if instance_id is not None:
            check_name(instance_id, "instance_id")
        timing = Timing.validate(
            heartbeat_interval=heartbeat_interval,
            alert_threshold=alert_threshold,
            stale_threshold=stale_threshold,
            poll_interval=poll_interval,
            operation_timeout=operation_timeout,
        )
        statements = Statements(table)
        if on_lost is not None and not callable(on_lost):
            raise TypeError(f"on_lost must be callable, not {type(on_lost).__name__}")
        if not isinstance(watch, bool):
            raise TypeError(f"watch must be a bool, not {type(watch).__name__}")
        transport = Transport(
            dsn=dsn,
            pool=pool,
            async_pool=async_pool,
            instance_id=instance_id,
            operation_timeout=timing.operation_timeout,
            table_name=statements.table_name,
        )
        tracing = Tracing(tracer_provider, database_attributes(transport.conninfo, statements.table_name))
        self._setup(
            transport,
            lock_name=lock_name,
            timing=timing,
            statements=statements,
            tracing=tracing,
            metrics=MetricsDispatch(metrics),
            on_lost=on_lost,
        )
        self._watch = _OwnLockWatch(self) if watch else None

    def _setup(
        self,
        transport: Transport,
        *,
        lock_name: str,
        timing: Timing,
        statements: Statements,
        tracing: Tracing,
        metrics: MetricsDispatch,
        on_lost: LostCallback | None,
    ) -> None:
        self._transport = transport
        self._state = LockState(
            lock_name=lock_name, instance_id=transport.instance_id, timing=timing, metrics=metrics, on_lost=on_lost
        )
        self._lock = flows.LockContext(self._state, statements, tracing)
        self._heartbeat = None
        self._sweeper = None
        self._watch = None
        self._siblings = {}
        self._options = {
            "timing": timing,
            "statements": statements,
            "tracing": tracing,
            "metrics": metrics,
            "on_lost": on_lost,
        }
        _ALL.add(self)

    def _sibling(self, lock_name: str) -> Mutex:
        """A Mutex for another lock name, sharing this one's connections and settings."""
        if lock_name == self.lock_name:
            return self
        check_name(lock_name, "lock_name")
        sibling = self._siblings.get(lock_name)
        if sibling is None:
            sibling = object.__new__(Mutex)
            sibling._setup(self._transport, lock_name=lock_name, **self._options)
            self._siblings[lock_name] = sibling
        return sibling

    def _sync_runner(self) -> SyncRunner:
        runner = self._transport.sync_runner()
        if self._watch is not None:
            self._watch.start_sync()
        return runner

    def _async_runner(self) -> AsyncRunner:
        runner = self._transport.async_runner()
        if self._watch is not None:
            self._watch.start_async()
        return runner

    @property
    def watcher(self) -> StaleWatcher | None:
        """The watcher of this Mutex's own lock (``watch=True``), else None."""
        return None if self._watch is None else self._watch.watcher

    # -- introspection -----------------------------------------------------

    @property
    def lock_name(self) -> str:
        return self._state.lock_name

    @property
    def instance_id(self) -> str:
        """This Mutex's id, as written in the table's ``instance_id`` column."""
        return self._state.instance_id

    @property
    def table(self) -> str:
        return self._lock.statements.table_name

    @property
    def held(self) -> bool:
        """True while this Mutex holds the lock and its lease has not run out.

        Reading it never touches the database; it turns false the moment the
        lease runs out, even if the heartbeat has not noticed yet.
        """
        return self._state.held

    def ensure_held(self) -> None:
        """Raise `LockNotHeldError` unless the lock is still held.

        Call it between steps of long work to stop promptly after a loss.
        """
        self._state.require_held()

    def __repr__(self) -> str:
        return (
            f"<Mutex lock_name={self.lock_name!r} instance_id={self.instance_id!r} "
            f"table={self.table!r} status={self._state.status.value}>"
        )

    # -- schema ------------------------------------------------------------

    def create_schema(self) -> None:
        """Create the lock table if it does not exist. Idempotent, safe to race.

        Raises `SchemaError` if the role may not create it.
        """
        self._sync_runner().run(flows.create_schema(self._lock.statements, self._state.timing.operation_timeout))

    async def create_schema_async(self) -> None:
        """Async `create_schema`."""
        await self._async_runner().run(flows.create_schema(self._lock.statements, self._state.timing.operation_timeout))

    # -- acquire -----------------------------------------------------------

    @contextlib.contextmanager
    def acquire(self, blocking: bool = False, timeout: float | None = None) -> Iterator[bool]:
        """Hold the lock for the ``with`` block; yields whether it was acquired.

        Non-blocking (the default) tries once and yields False if another
        instance holds the lock. Blocking waits, woken at once by the holder's
        release, polling every ``poll_interval`` otherwise, and raises
        `LockAcquisitionTimeout` after ``timeout`` seconds (None: no limit),
        so the block never runs unlocked.

        Leaving the block releases the lock, whether it ends normally, by an
        exception or by KeyboardInterrupt. If the lock was lost meanwhile, a
        normal exit raises `LockNotHeldError`. Raises `LockAlreadyHeldError`
        if this Mutex already holds the lock, `DatabaseError` if PostgreSQL
        cannot be used.
        """
        timeout = _check_wait(blocking, timeout)
        self._transport.check_process()
        runner = self._sync_runner()
        self._stop_sweeper()
        try:
            acquired = runner.run(flows.acquire(self._lock, blocking=blocking, timeout=timeout))
        finally:
            self._track_row(SyncBackground)
        if not acquired:
            yield False
            return
        self._heartbeat = self._keep_alive(SyncBackground)
        try:
            yield True
        except BaseException:
            self._release_after_failure()
            raise
        self.release()

    @contextlib.asynccontextmanager
    async def acquire_async(self, blocking: bool = True, timeout: float | None = None) -> AsyncIterator[bool]:
        """Async `acquire`; blocking by default. Cancelling the task releases the lock."""
        timeout = _check_wait(blocking, timeout)
        self._transport.check_process()
        runner = self._async_runner()
        await self._stop_sweeper_async()
        try:
            acquired = await runner.run(flows.acquire(self._lock, blocking=blocking, timeout=timeout))
        finally:
            self._track_row(AsyncBackground)
        if not acquired:
            yield False
            return
        self._heartbeat = self._keep_alive(AsyncBackground)
        try:
            yield True
        except BaseException:
            await _shielded(self._release_after_failure_async())
            raise
        # Shielded too: a cancellation arriving now must not leave the row behind.
        await _shielded(self.release_async())

    def _keep_alive(self, kind: type[Background]) -> Background:
        state, generation = self._state, self._state.generation
        return kind(
            self._transport,
            flows.keep_alive(self._lock, generation),
            name=f"postgres-mutex-heartbeat:{state.lock_name}",
            # Never die silently: a holder that stopped heartbeating must hear it.
            on_crash=lambda exc: state.lose(f"the heartbeat failed unexpectedly: {exc!r}", generation),
        )

    def _track_row(self, kind: type[Background]) -> None:
        """Keep `_MAY_HOLD_ROW` true to the state, and sweep up a row an unanswered statement left.

        Exit and close delete what may be ours; meanwhile a sweeper keeps
        trying, so the lock comes back as soon as the database does rather
        than after ``stale_threshold``.
        """
        with _MAY_HOLD_ROW_LOCK:
            if self._state.may_have_row:
                _MAY_HOLD_ROW.add(self)
            else:
                _MAY_HOLD_ROW.discard(self)
        idle_with_orphan = self._state.orphan_suspected and self._state.status is Status.IDLE
        if idle_with_orphan and (self._sweeper is None or not self._sweeper.running):
            self._sweeper = kind(
                self._transport,
                flows.sweep_orphan(self._lock),
                name=f"postgres-mutex-cleanup:{self.lock_name}",
                on_crash=lambda exc: None,
            )

    def _stop_sweeper(self) -> None:
        """Before an acquire: no clean-up may send from now on, and one in flight is waited for.

        The acquire takes our row back itself; a clean-up landing after it
        would delete the new hold.
        """
        in_flight = self._state.supersede_cleanups()
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.stop()
        with in_flight:
            pass

    async def _stop_sweeper_async(self) -> None:
        in_flight = self._state.supersede_cleanups()
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.stop()
        await acquire_without_blocking(in_flight)
        in_flight.release()

    # -- release -----------------------------------------------------------

    def release(self) -> None:
        """Delete this Mutex's lock row (waking waiters at once); no-op if nothing is held.

        Raises `LockNotHeldError` (after cleaning up) if the lock had been
        lost, and `DatabaseError` if the row could not be deleted: it then
        stays until another instance reclaims it after ``stale_threshold``,
        unless this Mutex deletes it first (next acquire, close, exit).
        """
        previous, heartbeat = self._begin_release()
        try:
            if isinstance(heartbeat, SyncBackground):
                heartbeat.join(self._state.timing.operation_timeout)
            self._stop_sweeper()
        finally:
            try:
                self._sync_runner().run(flows.release(self._lock, previous))
            finally:
                self._track_row(SyncBackground)

    async def release_async(self) -> None:
        """Async `release`."""
        previous, heartbeat = self._begin_release()
        try:
            if isinstance(heartbeat, AsyncBackground):
                await heartbeat.join(self._state.timing.operation_timeout)
            await self._stop_sweeper_async()
        finally:
            try:
                await self._async_runner().run(flows.release(self._lock, previous))
            finally:
                self._track_row(AsyncBackground)

    def _begin_release(self) -> tuple[Status, Background | None]:
        # Stop holding first, so nothing an interruption leaves half done can
        # look held: the heartbeat stops renewing, the row stays tracked.
        previous = self._state.begin_release()
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()
        return previous, heartbeat

    def _release_after_failure(self) -> None:
        # The block's own exception is what the caller must see.
        try:
            self.release()
        except MutexError as exc:
            logger.warning("while leaving the block after an error: %s", exc)

    async def _release_after_failure_async(self) -> None:
        try:
            await self.release_async()
        except MutexError as exc:
            logger.warning("while leaving the block after an error: %s", exc)

    def _release_at_exit(self) -> None:
        if self._transport.sync is None:
            logger.warning(
                "lock %r may still have a row at exit and only an async_pool is available: it stays "
                "until another instance reclaims it after stale_threshold",
                self.lock_name,
            )
            return
        try:
            self.release()
        except Exception as exc:
            logger.warning("releasing lock %r: %s", self.lock_name, exc)

    # -- heartbeat ---------------------------------------------------------

    def heartbeat(self) -> None:
        """Renew the lock now (the heartbeat thread does this on its own).

        Raises `LockNotHeldError` if the lock is not held or turns out lost,
        `DatabaseError` if the heartbeat failed.
        """
        self._sync_runner().run(flows.heartbeat(self._lock))

    async def heartbeat_async(self) -> None:
        """Async `heartbeat`."""
        await self._async_runner().run(flows.heartbeat(self._lock))

    # -- decorators --------------------------------------------------------

    @overload
    def singleton(self, lock_name: Callable[P, R]) -> Callable[P, R | None]: ...

    @overload
    def singleton(
        self, lock_name: str | None = None, *, blocking: bool = False, timeout: float | None = None
    ) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...

    def singleton(
        self,
        lock_name: str | Callable[P, R] | None = None,
        *,
        blocking: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Decorate a function to run only while holding the lock.

        ``lock_name`` defaults to this Mutex's; another name gets a Mutex that
        shares this one's connections and settings. When the lock is held
        elsewhere (or by another call in this process) the function does not
        run and the call returns None. Blocking with a ``timeout`` raises
        `LockAcquisitionTimeout` instead. Also usable bare: ``@mutex.singleton``.
        """
        if callable(lock_name):
            return self.singleton()(lock_name)
        target = self if lock_name is None else self._sibling(lock_name)
        timeout = _check_wait(blocking, timeout)

        def decorate(func: Callable[P, R]) -> Callable[P, R | None]:
            @functools.wraps(func)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
                with contextlib.ExitStack() as stack:
                    try:
                        acquired = stack.enter_context(target.acquire(blocking=blocking, timeout=timeout))
                    except LockAlreadyHeldError:
                        logger.info("lock %r is held in this process already: not running %s", target.lock_name, func)
                        return None
                    return func(*args, **kwargs) if acquired else None

            return wrapper

        return decorate

    @overload
    def singleton_async(self, lock_name: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R | None]]: ...

    @overload
    def singleton_async(
        self, lock_name: str | None = None, *, blocking: bool = True, timeout: float | None = None
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R | None]]]: ...

    def singleton_async(
        self,
        lock_name: str | Callable[P, Awaitable[R]] | None = None,
        *,
        blocking: bool = True,
        timeout: float | None = None,
    ) -> Any:
        """Async `singleton` for coroutine functions; blocking by default, like `acquire_async`."""
        if callable(lock_name):
            return self.singleton_async()(lock_name)
        target = self if lock_name is None else self._sibling(lock_name)
        timeout = _check_wait(blocking, timeout)

        def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R | None]]:
            @functools.wraps(func)
            async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
                async with contextlib.AsyncExitStack() as stack:
                    try:
                        acquired = await stack.enter_async_context(
                            target.acquire_async(blocking=blocking, timeout=timeout)
                        )
                    except LockAlreadyHeldError:
                        logger.info("lock %r is held in this process already: not running %s", target.lock_name, func)
                        return None
                    return await func(*args, **kwargs) if acquired else None

            return wrapper

        return decorate

    # -- shutdown ----------------------------------------------------------

    def close(self) -> None:
        """Release any lock held (or row left behind), stop the watcher, close this Mutex's connections.

        A pool is never closed: it belongs to the application.
        """
        # Stopped for good: the release below must not start it again.
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        for mutex in (self, *self._siblings.values()):
            if mutex._state.may_have_row:
                mutex._release_at_exit()
        if self._transport.sync is not None:
            self._transport.sync.close()

    async def aclose(self) -> None:
        """Async `close`."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        for mutex in (self, *self._siblings.values()):
            if mutex._state.may_have_row:
                try:
                    await mutex.release_async()
                except Exception as exc:
                    logger.warning("releasing lock %r on close: %s", mutex.lock_name, exc)
        if self._transport.async_ is not None:
            await self._transport.async_.aclose()

    def _after_fork_in_child(self) -> None:
        self._heartbeat = self._sweeper = None
        self._state.reset_after_fork(self._transport.instance_id)


async def _shielded(release: Awaitable[None]) -> None:
    """Run a release to its end even if the awaiting task is cancelled again meanwhile."""
    task = asyncio.ensure_future(release)
    task.add_done_callback(_log_failure)
    await asyncio.shield(task)


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None and not isinstance(exc, MutexError):
        logger.warning("release failed: %r", exc)


def _check_wait(blocking: object, timeout: object) -> float | None:
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be a bool, not {type(blocking).__name__}")
    if timeout is None:
        return None
    seconds = check_seconds(timeout, "timeout", allow_zero=True)
    if not blocking:
        raise ValueError("timeout applies only to a blocking acquire: pass blocking=True, or drop timeout")
    return seconds


@atexit.register
def _release_all_at_exit() -> None:
    """A normal interpreter exit deletes every row this process may still have, so nobody waits out stale_threshold."""
    with _MAY_HOLD_ROW_LOCK:
        pending = list(_MAY_HOLD_ROW)
    for mutex in pending:
        mutex._release_at_exit()


def _forget_after_fork() -> None:
    """In a forked child, nothing the parent held is ours: no lock, no row, no connection."""
    global _MAY_HOLD_ROW_LOCK
    _MAY_HOLD_ROW.clear()
    _MAY_HOLD_ROW_LOCK = threading.Lock()
    # Transports (connections, identities) were reset by their own fork hook, which runs first.
    for mutex in list(_ALL):
        mutex._after_fork_in_child()


os.register_at_fork(after_in_child=_forget_after_fork)
