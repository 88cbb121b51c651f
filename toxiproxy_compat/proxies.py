"""Proxies and their connections: a listener per proxy, two links per connection, toxics on each link."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .common import (
    CLOSE_GRACE,
    STREAMS,
    ApiError,
    LinkEnded,
    Tasks,
    bind,
    format_address,
    set_linger_zero,
    split_address,
)
from .toxics import STAGES, Stage, Toxic

log = logging.getLogger(__name__)

# Go's io.Copy, which Toxiproxy reads connections with, moves 32 KiB at a time.
_READ_SIZE: Final = 32 * 1024
# Toxiproxy buffers up to 1024 chunks ahead of a latency toxic; reading must go on while
# chunks wait, or their arrival times (which latency counts from) would come late.
_QUEUE_CHUNKS: Final = 1024
_CONNECT_TIMEOUT: Final = 10.0
_DEFAULT_LISTEN: Final = "127.0.0.1:0"


# Connections --------------------------------------------------------------------------


@dataclass(slots=True)
class Chunk:
    data: bytes
    ts: float  # Loop time when it was read from the source.


class Link:
    """One direction of one connection: reads its source, runs the data through the
    stages of that direction's toxics in order, and writes its destination."""

    def __init__(self, conn: Connection, stream: str, source: asyncio.StreamReader, dest: asyncio.StreamWriter) -> None:
        self.conn = conn
        self.stream = stream
        self._source = source
        self._dest = dest
        self._queue: asyncio.Queue[Chunk | None] = asyncio.Queue(_QUEUE_CHUNKS)
        self.stages: list[Stage] = []
        self.ended = False
        self._reader: asyncio.Task[None] | None = None
        self._pump: asyncio.Task[None] | None = None

    def spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        return self.conn.proxy.core.spawn(coro, f"{self.conn.label} {self.stream} {what}")

    def start(self, toxics: Iterable[Toxic]) -> None:
        for toxic in toxics:
            self.attach(toxic)
        self._reader = self.spawn(self._read(), "reader")
        self._pump = self.spawn(self._run(), "pump")

    def attach(self, toxic: Toxic) -> None:
        """Add the toxic at the end of the chain, as Toxiproxy adds new toxics."""
        if self.ended:
            return
        stage = STAGES[toxic.type](toxic, self)
        self.stages.append(stage)
        stage.start()

    def detach(self, toxic: Toxic) -> None:
        for index, stage in enumerate(self.stages):
            if stage.toxic is toxic:
                del self.stages[index]
                stage.detach(cleanup=True)
                return

    def refresh(self, toxic: Toxic) -> None:
        """Restart the toxic's stage after an update: held data goes on, toxicity is drawn anew."""
        for index, old in enumerate(self.stages):
            if old.toxic is toxic:
                new = STAGES[toxic.type](toxic, self)
                new.inherit(old)
                self.stages[index] = new
                old.detach(cleanup=False)
                new.start()
                return

    def end(self, *, rst: bool = False) -> None:
        """Close this link's destination, as Toxiproxy does when a link's chain closes.

        A graceful close sends what was already written, then a FIN; ``rst`` sets
        SO_LINGER 0 on both sockets so that this close and the other link's are RSTs.
        The other link reads the end of stream from the same socket and ends in turn.
        """
        if self.ended:
            return
        self.ended = True
        for stage in self.stages:
            stage.detach(cleanup=False)
        current = asyncio.current_task()
        for task in (self._reader, self._pump):
            if task is not None and task is not current:
                task.cancel()
        if rst:
            self.conn.set_linger_zero()
            self._dest.transport.abort()
        else:
            self._dest.transport.close()
        self.conn.link_ended()

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await self._source.read(_READ_SIZE):
                await self._queue.put(Chunk(data, loop.time()))
        except OSError as exc:
            # Like Toxiproxy's io.Copy, an error ends the stream as an EOF does.
            log.debug("%s %s: source failed: %s", self.conn.label, self.stream, exc)
        await self._queue.put(None)

    async def _run(self) -> None:
        try:
            while (chunk := await self._queue.get()) is not None:
                await self._through(chunk.data, chunk.ts, list(self.stages), 0)
            for stage in list(self.stages):
                if stage.applies:
                    await stage.on_eof()
        except LinkEnded:
            return
        except OSError as exc:
            # Toxiproxy closes the destination when writing to it fails.
            log.debug("%s %s: destination failed: %s", self.conn.label, self.stream, exc)
        self.end()

    async def _through(self, data: bytes, ts: float, stages: list[Stage], index: int) -> None:
        """Pass data to the first stage from ``index`` that applies, or write it out."""
        while index < len(stages) and not stages[index].applies:
            index += 1
        if index == len(stages):
            if self.ended:
                raise LinkEnded
            if self._dest.transport.is_closing():
                self.end()
                raise LinkEnded
            self._dest.write(data)
            await self._dest.drain()
            return

        async def emit(piece: bytes, when: float) -> None:
            await self._through(piece, when, stages, index + 1)

        await stages[index].on_data(data, ts, emit)


class Connection:
    """A client connection and its upstream connection, joined by two links."""

    def __init__(
        self,
        proxy: Proxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.label = f"{proxy.name} {client[1].get_extra_info('peername')}"
        self._writers = (client[1], server[1])
        self.links = {
            "upstream": Link(self, "upstream", client[0], server[1]),
            "downstream": Link(self, "downstream", server[0], client[1]),
        }
        self._finished = asyncio.Event()

    def start(self, toxics: Sequence[Toxic]) -> None:
        for stream, link in self.links.items():
            link.start(toxic for toxic in toxics if toxic.stream == stream)
        self.proxy.core.spawn(self._supervise(), f"{self.label} supervisor")

    def set_linger_zero(self) -> None:
        for writer in self._writers:
            set_linger_zero(writer)

    def link_ended(self) -> None:
        if all(link.ended for link in self.links.values()):
            self._finished.set()

    def close(self) -> None:
        """End both directions gracefully (proxy disabled or deleted)."""
        for link in self.links.values():
            link.end()

    def abort(self) -> None:
        """Drop both sockets now (server stopping)."""
        for writer in self._writers:
            writer.transport.abort()

    async def _supervise(self) -> None:
        try:
            await self._finished.wait()
            # Graceful closes flush what was written; a peer that never reads must not
            # keep the sockets forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_GRACE):
                    for writer in self._writers:
                        with contextlib.suppress(OSError):
                            await writer.wait_closed()
        finally:
            self.abort()
            self.proxy.connections.discard(self)


# Proxies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProxySpec:
    name: str
    listen: str
    upstream: str
    enabled: bool


def parse_proxy(item: object, where: str = "") -> ProxySpec:
    if not isinstance(item, dict):
        raise ApiError(400, f"bad request body{where}: expected a JSON object")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"missing required field: name{where}")
    upstream = item.get("upstream")
    if not upstream:
        raise ApiError(400, f"missing required field: upstream{where}")
    split_address(upstream, "upstream", allow_port_zero=False)
    listen = item.get("listen") or _DEFAULT_LISTEN
    split_address(listen, "listen", allow_port_zero=True)
    enabled = item.get("enabled")
    enabled = True if enabled is None else enabled
    if not isinstance(enabled, bool):
        raise ApiError(400, f"bad request body{where}: enabled must be true or false")
    # Both checked by split_address; the asserts tell the type checker.
    assert isinstance(upstream, str)
    assert isinstance(listen, str)
    return ProxySpec(name=name, listen=listen, upstream=upstream, enabled=enabled)


class Proxy:
    """A named listener forwarding each accepted connection to its upstream."""

    def __init__(self, core: Tasks, spec: ProxySpec) -> None:
        self.core = core
        self.name = spec.name
        self.listen = spec.listen
        self.upstream = spec.upstream
        self.enabled = False
        self.toxics: list[Toxic] = []
        self.connections: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._accepting: set[asyncio.Task[Any]] = set()
        # Bumped on every stop, so that a connection accepted before a stop and still
        # dialing its upstream is not kept afterwards.
        self._generation = 0

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "listen": self.listen,
            "upstream": self.upstream,
            "enabled": self.enabled,
            "toxics": [toxic.to_json() for toxic in self.ordered_toxics()],
        }

    def ordered_toxics(self) -> list[Toxic]:
        # Toxiproxy lists the upstream chain, then the downstream one.
        return sorted(self.toxics, key=lambda toxic: STREAMS.index(toxic.stream))

    def find_toxic(self, name: str) -> Toxic | None:
        return next((toxic for toxic in self.toxics if toxic.name == name), None)

    async def start(self) -> None:
        """Listen on ``listen``; a port of 0 is replaced by the one picked. 500 on failure."""
        if self.enabled:
            return
        try:
            host, port = split_address(self.listen, "listen", allow_port_zero=True)
            sock = bind(host, port)
        except OSError as exc:
            raise ApiError(500, f"listen tcp {self.listen}: {exc.strerror or exc}") from exc
        try:
            self._server = await asyncio.start_server(self._accept, sock=sock, backlog=128)
        except OSError as exc:
            sock.close()
            raise ApiError(500, f"listen tcp {self.listen}: {exc.strerror or exc}") from exc
        self.listen = format_address(sock.getsockname())
        self.enabled = True
        log.info("proxy %s listening on %s for %s", self.name, self.listen, self.upstream)

    def stop(self) -> None:
        """Stop listening and close every connection, as disabling a Toxiproxy proxy does."""
        if not self.enabled:
            return
        self.enabled = False
        self._generation += 1
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._accepting):
            task.cancel()
        for conn in list(self.connections):
            conn.close()
        log.info("proxy %s stopped", self.name)

    def shutdown(self) -> None:
        connections = list(self.connections)
        self.stop()
        for conn in connections:
            conn.abort()

    def add_toxic(self, toxic: Toxic) -> None:
        self.toxics.append(toxic)
        for conn in list(self.connections):
            conn.links[toxic.stream].attach(toxic)

    def update_toxic(self, toxic: Toxic) -> None:
        for conn in list(self.connections):
            conn.links[toxic.stream].refresh(toxic)

    def remove_toxic(self, toxic: Toxic) -> None:
        self.toxics.remove(toxic)
        for conn in list(self.connections):
            conn.links[toxic.stream].detach(toxic)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._accepting.add(task)
            self.core.track(task)
        generation = self._generation
        try:
            host, port = split_address(self.upstream, "upstream", allow_port_zero=False)
            try:
                async with asyncio.timeout(_CONNECT_TIMEOUT):
                    server_reader, server_writer = await asyncio.open_connection(host, port)
            except (OSError, TimeoutError) as exc:
                # Toxiproxy closes the client when the upstream cannot be reached.
                log.warning("proxy %s: cannot reach upstream %s: %s", self.name, self.upstream, exc)
                client_writer.transport.abort()
                return
            if generation != self._generation:
                server_writer.transport.abort()
                client_writer.transport.abort()
                return
            conn = Connection(self, (client_reader, client_writer), (server_reader, server_writer))
            self.connections.add(conn)
            conn.start(self.toxics)
            log.debug("%s: connected to %s", conn.label, self.upstream)
        except BaseException:
            client_writer.transport.abort()
            raise
        finally:
            if task is not None:
                self._accepting.discard(task)
