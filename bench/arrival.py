"""Arrival order: the waiters of a fair Mutex, each in a process of its own, acquire in the order they came.

A holder process takes one fair Mutex; ``waiters`` processes are then told to
acquire it, all at once, and block. Once the lock's queue holds every one of
them, the holder releases; each waiter, once its acquire returns, notes the
time on the machine's monotonic clock (every process shares it), holds the
lock `HOLD` and releases. The order of arrival is the queue's: the tickets
their first attempts drew, in the order the server ran them, which is what a
fair lock promises to follow. An overtake is a pair of waiters that acquired
in the other order; a fair Mutex's target is none. ``rounds`` rounds, the
holder's turn going round the processes.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from postgres_mutex import Mutex

from .processes import workers

if TYPE_CHECKING:
    from .channel import Channel

LOCK = "bench-arrival"

HOLD = 0.002
"""How long each waiter holds the lock once it has it (seconds)."""

QUEUED_WITHIN = 30.0
"""How long the waiters may take to be queued, each round (seconds)."""


def run(dsn: str, table: str, waiters: int, rounds: int) -> dict[str, Any]:
    queue = sql.Identifier(f"{table}_queue")
    configs = [{"dsn": dsn, "table": table}] * (waiters + 1)
    overtakes = pairs = 0
    with workers("arrival", configs) as started, psycopg.connect(dsn, autocommit=True) as conn:
        ids = {}
        for worker in started:
            worker.send(cmd="who")
            ids[str(worker.receive(10)["instance_id"])] = worker
        for turn in range(rounds):
            holder = started[turn % len(started)]
            others = [worker for worker in started if worker is not holder]
            holder.send(cmd="hold")
            holder.receive(30)
            for worker in others:
                worker.send(cmd="turn")
            arrived = _queued(conn, queue, waiters)
            holder.send(cmd="release")
            holder.receive(30)
            acquired = {worker.pid: float(worker.receive(30)["acquired"]) for worker in others}
            order = [acquired[ids[instance_id].pid] for instance_id in arrived]
            pairs += len(order) * (len(order) - 1) // 2
            overtakes += sum(1 for early, late in itertools.combinations(order, 2) if late < early)
    return {"waiters": waiters, "rounds": rounds, "hold_ms": HOLD * 1e3, "pairs": pairs, "overtakes": overtakes}


def _queued(conn: psycopg.Connection[Any], queue: sql.Identifier, waiters: int) -> list[str]:
    """The waiters' instance ids in the order the queue has them, once it has them all."""
    deadline = time.monotonic() + QUEUED_WITHIN
    query = sql.SQL("SELECT instance_id FROM {} WHERE lock_name = %s ORDER BY ticket").format(queue)
    while True:
        arrived = [str(row[0]) for row in conn.execute(query, (LOCK,))]
        if len(arrived) >= waiters:
            return arrived
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(arrived)} of {waiters} waiters queued within {QUEUED_WITHIN:g} s")
        time.sleep(0.005)


def work(config: dict[str, Any], channel: Channel) -> None:
    mutex = Mutex(config["dsn"], LOCK, table=config["table"], fair=True)
    holding = None
    channel.send(ready=True)
    try:
        while True:
            command = channel.receive()["cmd"]
            if command == "who":
                channel.send(instance_id=mutex.instance_id)
            elif command == "hold":
                holding = mutex.acquire(timeout=30)
                holding.__enter__()
                channel.send(acquired=time.monotonic())
            elif command == "release":
                assert holding is not None
                holding.__exit__(None, None, None)
                holding = None
                channel.send(released=time.monotonic())
            elif command == "turn":
                with mutex.acquire(timeout=30):
                    acquired = time.monotonic()
                    time.sleep(HOLD)
                channel.send(acquired=acquired)
    finally:
        mutex.close()
