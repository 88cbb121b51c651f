"""One replica of an ASGI service (Starlette, FastAPI) leads: its background work runs there only.

`LeaderOnly` plugs into the app's lifespan: on startup it campaigns in an
`Election`, runs the leader-only coroutine while this process leads (cancelled
at once when the term ends), and on shutdown resigns, so that another replica
takes over at once instead of after a timeout. Its `readiness` endpoint answers
200 on the replica that leads and 503 elsewhere, so Kubernetes (or any load
balancer) can tell which replica leads.

Needs the ``asgi`` extra (Starlette) for the endpoints; FastAPI apps are
Starlette apps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from postgres_mutex.election import Election, Leadership
from postgres_mutex.errors import MutexError

from . import in_setup_words

__all__ = ["LeaderOnly", "Work"]

log = logging.getLogger("postgres_mutex.integrations.asgi")

Work = Callable[[Leadership], Awaitable[None]]
"""The leader-only coroutine function: called with the term (its token, ``fenced``) each time this replica leads."""

_MAX_REPLICA_LENGTH = 48  # an instance id is at most 64 characters: room for "/" and a process id


class LeaderOnly:
    """Leader election for an ASGI app, started and stopped with its lifespan.

    ``LeaderOnly(dsn, "reconciler", work, **options)``: ``options`` are
    `Election`'s (``heartbeat_interval``, ``reclaim_disconnected_after``,
    ``table``...). Every worker process of every replica is a candidate; at
    most one leads, and ``work(leadership)`` runs there only, as a task that
    is cancelled the moment its term ends (lost, or the app shuts down). When
    ``work`` returns, the process keeps leading until the term ends; when it
    raises, the election logs it, gives the term up and campaigns again after
    a back-off.

    A process whose election cannot campaign at all (the lock table
    missing, a grant lacking) logs one ERROR saying what to run or grant,
    and serves on as a follower (`readiness` 503) until it is restarted.

    ``replica`` names this replica (default: the host name, which is the
    pod's name on Kubernetes): the instance id this process campaigns under
    is ``<replica>/<process id>``, so that `replica_leads` can tell that the
    leader is another worker process of the same replica.
    """

    def __init__(
        self,
        dsn: str | None = None,
        name: str | None = None,
        work: Work | None = None,
        *,
        replica: str | None = None,
        shutdown_timeout: float = 10.0,
        **options: Any,
    ) -> None:
        if name is None:
            raise TypeError("LeaderOnly() needs an election name: LeaderOnly(dsn, 'reconciler', work)")
        if "instance_id" in options:
            raise TypeError("LeaderOnly() names its candidates itself: pass replica= instead of instance_id=")
        self._replica = (replica or socket.gethostname() or "replica")[:_MAX_REPLICA_LENGTH]
        self._dsn = dsn
        self._name = name
        self._work = work
        self._options = options
        self._shutdown_timeout = shutdown_timeout
        self._election: Election | None = None
        self._failure: BaseException | None = None

    @property
    def name(self) -> str:
        """The election's name."""
        return self._name

    @property
    def replica(self) -> str:
        """This replica's name, the part of the instance id before the ``/``."""
        return self._replica

    @property
    def election(self) -> Election | None:
        """The running `Election` while the app is up (None before startup and after shutdown)."""
        return self._election

    @property
    def leading(self) -> bool:
        """True while this process leads and its term has not been told to end; never touches the database."""
        election = self._election
        return election is not None and election.leading

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object = None) -> AsyncIterator[None]:
        """The app's lifespan (``Starlette(lifespan=leader.lifespan)``), or a part of yours.

        Startup only starts the campaign, so the app serves at once whether
        or not it leads. Shutdown stops campaigning and releases the lock the
        moment ``work`` has been cancelled, which wakes the next candidate at
        once; it waits ``shutdown_timeout`` seconds at most for that.
        """
        election = Election(self._dsn, self._name, instance_id=self._instance_id(), **self._options)
        campaign = asyncio.create_task(election.run_async(self._lead), name=f"postgres-mutex election {self._name}")
        campaign.add_done_callback(self._campaign_ended)
        self._election = election
        self._failure = None
        try:
            yield
        finally:
            election.stop()
            try:
                await asyncio.wait_for(campaign, self._shutdown_timeout)
            except TimeoutError:
                log.error("election %s did not end within %gs of shutdown", self._name, self._shutdown_timeout)
            except Exception as exc:
                if exc is not self._failure:  # told already, as the campaign ended
                    log.exception("election %s ended with an error", self._name)
            finally:
                self._election = None
                await election.aclose()

    async def replica_leads(self) -> bool:
        """Whether some worker process of this replica leads.

        Answered without the database when this process leads; otherwise
        from the lock table (one query), since another worker of the same
        replica may lead. False when the database cannot say.
        """
        election = self._election
        if election is None:
            return False
        if election.leading:
            return True
        if self._failure is not None:
            return False  # this process cannot campaign: said once, as the campaign ended
        try:
            leader = await election.leader_async()
        except MutexError as exc:
            log.warning("election %s: cannot tell who leads: %s", self._name, exc)
            return False
        return leader is not None and leader.instance_id.rpartition("/")[0] == self._replica

    async def readiness(self, request: Request) -> JSONResponse:
        """An endpoint: 200 when this replica leads, 503 when it does not, with a JSON body saying which.

        Mount it as a readiness probe (``Route("/ready", leader.readiness)``)
        so that only the leading replica receives traffic, or read it to find
        the leader.
        """
        leads = await self.replica_leads()
        return JSONResponse(self._state(leads), status_code=200 if leads else 503)

    async def health(self, request: Request) -> JSONResponse:
        """An endpoint: always 200 while the app serves, with the same JSON body as `readiness`.

        For liveness probes and dashboards, which must not restart a follower
        for not leading.
        """
        return JSONResponse(self._state(await self.replica_leads()))

    def _campaign_ended(self, campaign: asyncio.Task[None]) -> None:
        """Say once, as the error it is, that this process's election gave up; it serves on as a follower."""
        if campaign.cancelled() or campaign.exception() is None:
            return
        self._failure = campaign.exception()
        log.error(
            "election %s cannot campaign: %s. This process serves on as a follower (readiness 503) until restarted",
            self._name,
            in_setup_words(self._failure),  # type: ignore[arg-type]
        )

    def _state(self, leads: bool) -> dict[str, object]:
        return {"election": self._name, "replica": self._replica, "leader": leads}

    def _instance_id(self) -> str:
        return f"{self._replica}/{os.getpid()}"

    async def _lead(self, leadership: Leadership) -> None:
        log.info("election %s: this replica leads (term %s)", self._name, leadership.token)
        try:
            if self._work is not None:
                await self._work(leadership)
            # Leadership outlives the work: the term ends by cancellation (lost, resigned, shut down).
            await asyncio.get_running_loop().create_future()
        finally:
            log.info("election %s: term %s ended", self._name, leadership.token)
