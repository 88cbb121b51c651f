"""The Starlette app the ASGI tests run under uvicorn: a leader-only ticker and the two endpoints.

Configured from the environment (one app, several replicas): ``POSTGRES_MUTEX_DSN``,
``ELECTION`` (its name), ``REPLICA`` (this replica's name). The leader inserts a
row into ``asgi_ticks`` every 0.1 s, so the test can see who ran the work and when.
"""

from __future__ import annotations

import asyncio
import os

import psycopg
from starlette.applications import Starlette
from starlette.routing import Route

from postgres_mutex import Leadership
from postgres_mutex.integrations.asgi import LeaderOnly

DSN = os.environ["POSTGRES_MUTEX_DSN"]
REPLICA = os.environ["REPLICA"]


async def tick(leadership: Leadership) -> None:
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
        while True:
            await conn.execute(
                "INSERT INTO asgi_ticks (election, replica, pid, token) VALUES (%s, %s, %s, %s)",
                (leadership.name, REPLICA, os.getpid(), leadership.token),
            )
            await asyncio.sleep(0.1)


leader = LeaderOnly(
    DSN,
    os.environ["ELECTION"],
    tick,
    replica=REPLICA,
    heartbeat_interval=0.5,
    alert_threshold=5,
    stale_threshold=30,
    reclaim_disconnected_after=2,
)
app = Starlette(routes=[Route("/ready", leader.readiness), Route("/health", leader.health)], lifespan=leader.lifespan)
