"""The peers' side of the peers section: each lock library behind one small interface, in a worker.

A peer worker (``python -m bench.worker peer CONFIG``) holds one lock object
of one library and obeys the parent's commands: time a round of uncontended
acquire + release cycles, take the lock blocking (for a hand-off), release it,
or loop acquire / hold / release over a window (contended throughput). Every
library is used as its documentation shows, with its defaults, except where
a setting is needed to compare like with like (a lease or expiry of 30 s
everywhere, and python-redis-lock's renewal, which gives it the heartbeat the
PostgreSQL locks have).

The module imports nothing outside the standard library at the top: the
worker of postgres-mutex 0.1.0 runs under an interpreter of its own that has
only that release and psycopg, and each library is imported where it is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

if TYPE_CHECKING:
    from .channel import Channel

LEASE = 30
"""Seconds a lock lives without renewal, for every peer that has a lease or an expiry."""

WAIT = 30.0
"""How long a blocked acquire waits before the worker gives up (seconds)."""


class PeerLock(Protocol):
    """One lock of one library: a non-blocking try, a blocking acquire (`TimeoutError` when it gives up), a
    release."""

    def try_acquire(self) -> bool: ...
    def acquire(self, timeout: float) -> None: ...
    def release(self) -> None: ...
    def close(self) -> None: ...


class _Mutex:
    """postgres-mutex, this version (fair or not) or 0.1.0 (the same public calls): ``with mutex.acquire(...)``."""

    def __init__(self, config: dict[str, Any]) -> None:
        from postgres_mutex import Mutex

        if config.get("fair"):
            self._mutex = Mutex(config["dsn"], config["name"], table=config["table"], fair=True)
        else:  # 0.1.0's Mutex has no fair= keyword
            self._mutex = Mutex(config["dsn"], config["name"], table=config["table"])
        self._holding = contextlib.ExitStack()

    def try_acquire(self) -> bool:
        acquired = bool(self._holding.enter_context(self._mutex.acquire()))
        if not acquired:
            self._holding.close()
        return acquired

    def acquire(self, timeout: float) -> None:
        from postgres_mutex import LockAcquisitionTimeout

        try:
            self._holding.enter_context(self._mutex.acquire(blocking=True, timeout=timeout))
        except LockAcquisitionTimeout as exc:
            raise TimeoutError(str(exc)) from None

    def release(self) -> None:
        self._holding.close()

    def close(self) -> None:
        self._holding.close()
        self._mutex.close()


def sqlalchemy_url(dsn: str) -> str:
    """The SQLAlchemy URL (psycopg 3 driver) of a libpq DSN, as PALs wants it."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(dsn)
    user = quote(str(params.get("user") or "postgres"), safe="")
    password = f":{quote(str(params['password']), safe='')}" if params.get("password") else ""
    host = str(params.get("host") or "127.0.0.1")
    port = str(params.get("port") or "5432")
    dbname = quote(str(params.get("dbname") or "postgres"), safe="")
    return f"postgresql+psycopg://{user}{password}@{host}:{port}/{dbname}"


class _Pals:
    """PALs: a session-level advisory lock on a pooled SQLAlchemy connection."""

    def __init__(self, config: dict[str, Any]) -> None:
        import pals

        self._locker = pals.Locker("postgres-mutex-bench", sqlalchemy_url(config["dsn"]))
        self._lock = self._locker.lock(config["name"])

    def try_acquire(self) -> bool:
        return bool(self._lock.acquire(blocking=False))

    def acquire(self, timeout: float) -> None:
        if not self._lock.acquire(blocking=True, acquire_timeout=int(timeout * 1000)):
            raise TimeoutError(f"PALs did not get the lock within {timeout:g} s")

    def release(self) -> None:
        self._lock.release()

    def close(self) -> None:
        self._locker.engine.dispose()


class _RedisPy:
    """redis-py's ``Lock``: SET NX with an expiry; a blocked acquire retries every ``sleep`` (0.1 s)."""

    def __init__(self, config: dict[str, Any]) -> None:
        import redis

        self._client = redis.Redis(host="127.0.0.1", port=int(config["redis_port"]))
        self._lock = self._client.lock(config["name"], timeout=LEASE)

    def try_acquire(self) -> bool:
        return bool(self._lock.acquire(blocking=False))

    def acquire(self, timeout: float) -> None:
        if not self._lock.acquire(blocking=True, blocking_timeout=timeout):
            raise TimeoutError(f"redis-py did not get the lock within {timeout:g} s")

    def release(self) -> None:
        self._lock.release()

    def close(self) -> None:
        self._client.close()


class _RedisLock:
    """python-redis-lock: SET NX with an expiry renewed by a thread; a blocked acquire waits in BLPOP."""

    def __init__(self, config: dict[str, Any]) -> None:
        import redis
        import redis_lock

        self._client = redis.Redis(host="127.0.0.1", port=int(config["redis_port"]))
        self._lock = redis_lock.Lock(self._client, config["name"], expire=LEASE, auto_renewal=True)

    def try_acquire(self) -> bool:
        return bool(self._lock.acquire(blocking=False))

    def acquire(self, timeout: float) -> None:
        if not self._lock.acquire(blocking=True, timeout=timeout):
            raise TimeoutError(f"python-redis-lock did not get the lock within {timeout:g} s")

    def release(self) -> None:
        self._lock.release()

    def close(self) -> None:
        self._client.close()


class _Etcd:
    """etcd through aetcd (asyncio, gRPC): a key under a lease; a blocked acquire watches for its delete."""

    def __init__(self, config: dict[str, Any]) -> None:
        import aetcd

        self._runner = asyncio.Runner()
        self._client = aetcd.Client(host="127.0.0.1", port=int(config["etcd_port"]))
        self._lock = self._client.lock(config["name"].encode(), ttl=LEASE)

    def try_acquire(self) -> bool:
        return bool(self._runner.run(self._lock.acquire(timeout=0)))

    def acquire(self, timeout: float) -> None:
        if not self._runner.run(self._lock.acquire(timeout=timeout)):
            raise TimeoutError(f"etcd did not give the lock within {timeout:g} s")

    def release(self) -> None:
        self._runner.run(self._lock.release())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._runner.run(self._client.close())
        self._runner.close()


KINDS: dict[str, Callable[[dict[str, Any]], PeerLock]] = {
    "mutex": _Mutex,
    "pals": _Pals,
    "redis-py": _RedisPy,
    "python-redis-lock": _RedisLock,
    "etcd": _Etcd,
}


def work(config: dict[str, Any], channel: Channel) -> None:
    """A peer worker: one lock object of config's kind, driven by the parent's commands."""
    lock = KINDS[config["kind"]](config)
    channel.send(ready=True)
    try:
        while True:
            message = channel.receive()
            command = message["cmd"]
            if command == "cycles":
                channel.send(**_cycles(lock, int(message["count"])))
            elif command == "acquire":
                channel.send(waiting=time.monotonic())
                lock.acquire(WAIT)
                channel.send(acquired=time.monotonic())
            elif command == "release":
                released = time.monotonic()
                lock.release()
                channel.send(released=released, done=time.monotonic())
            elif command == "go":
                channel.send(sections=_contend(lock, float(message["start"]), float(message["end"]), config))
            else:
                raise ValueError(f"unknown command {command!r}")
    finally:
        lock.close()


def _cycles(lock: PeerLock, count: int) -> dict[str, Any]:
    """``count`` uncontended cycles, each timed on its own; the process CPU time they took."""
    samples = []
    clock = time.perf_counter
    cpu0 = time.process_time()
    for _ in range(count):
        started = clock()
        if not lock.try_acquire():
            raise RuntimeError("an uncontended lock was not acquired")
        lock.release()
        samples.append(clock() - started)
    return {"samples": samples, "cpu": time.process_time() - cpu0}


def _contend(lock: PeerLock, start: float, end: float, config: dict[str, Any]) -> list[tuple[float, float]]:
    """Acquire (blocking), hold, release until ``end``; the critical sections on `time.monotonic`."""
    hold = float(config["hold"])
    time.sleep(max(0.0, start - time.monotonic()))
    sections: list[tuple[float, float]] = []
    while (left := end - time.monotonic()) > 0:
        try:
            lock.acquire(max(left, 0.001))
        except TimeoutError:
            # A polling library may give up up to one poll interval before its timeout: try again
            # while the window lasts.
            continue
        entered = time.monotonic()
        time.sleep(hold)
        sections.append((entered, time.monotonic()))
        lock.release()
    return [(a, b) for a, b in sections if b <= end]
