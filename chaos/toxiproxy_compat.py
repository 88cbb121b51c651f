"""A Toxiproxy-compatible fault-injection server, standard library only.

The chaos suite drives network faults through Toxiproxy's HTTP API. Where no real
Toxiproxy is at hand (no binary, no Docker), this module stands in for it:

    python -m chaos.toxiproxy_compat --host 127.0.0.1 --port 8474

runs it in the foreground and prints one line, ``toxiproxy_compat listening on
http://HOST:PORT``, on stdout once the API answers (``--port 0`` picks a free port).
``ToxiproxyServer(host, port)`` runs the same server on a thread in this process.

HTTP API (JSON, as Toxiproxy 2.x serves it)
-------------------------------------------
- ``GET /version``; ``POST /reset`` (enable every proxy, remove every toxic).
- ``GET /proxies`` (name -> proxy with its toxics); ``POST /proxies`` (``name``,
  ``upstream``, ``listen``, ``enabled``): 201; a ``listen`` port of 0 picks a free port
  and the answer shows the real one. ``POST /populate`` (a list; a proxy of the same
  name is kept if its listen and upstream match, else replaced): 201 ``{"proxies": [...]}``.
- ``GET``, ``POST``/``PATCH`` (update ``listen``, ``upstream``, ``enabled``), ``DELETE``
  ``/proxies/{proxy}``. Disabling closes every connection and stops listening;
  enabling listens again on the same address.
- ``GET``/``POST /proxies/{proxy}/toxics``; ``GET``, ``POST``/``PATCH`` (``attributes``,
  ``toxicity``), ``DELETE /proxies/{proxy}/toxics/{toxic}``.
- Errors are ``{"error": ..., "status": ...}``: 409 for a duplicate proxy or toxic name,
  404 for an unknown one, 400 for a malformed body or an invalid toxic, 500 when a
  listen address cannot be bound. toxiproxy-python maps 409/404/400 to ``ProxyExists``,
  ``NotFound`` and ``InvalidToxic``.

Toxics
------
A toxic has ``name`` (default ``<type>_<stream>``), ``type``, ``stream`` (``upstream``:
client to server; ``downstream``, the default: server to client), ``toxicity`` (the
chance, decided once per connection and direction, that it applies; default 1.0) and
``attributes`` (integers; missing ones are 0). Adding a toxic applies it to open
connections too; removing it takes it off them, and data it was holding goes on at once.

- ``latency`` (``latency``, ``jitter`` ms): each chunk leaves ``latency`` +/- ``jitter``
  after it arrived; chunks do not add up their delays.
- ``timeout`` (``timeout`` ms): no data gets through; with ``timeout`` > 0 the
  connection closes that long after the toxic began on it, with 0 it stays open.
  Data arriving meanwhile is dropped, and removing the toxic closes the connections it
  was applied to: since Toxiproxy 2.1.1 (PR #168) it does exactly that, because a
  stream with a hole in it is corrupt (its README said "delayed" until PR #598 fixed
  the wording to "dropped"). To hold data and deliver it on removal, use ``latency``
  with a long delay, or ``bandwidth`` with rate 0: removing either releases what it holds.
- ``reset_peer`` (``timeout`` ms): the first data (or end of stream) is dropped and,
  ``timeout`` later, both sockets are closed with SO_LINGER 0, so each peer sees a TCP
  RST (ECONNRESET), not a clean end of stream.
- ``bandwidth`` (``rate`` KB/s, 1 KB = 1000 bytes): data is paced to the rate, in
  slices of a tenth of a second. Rate 0 lets nothing through until the toxic is removed,
  as in Toxiproxy.
- ``limit_data`` (``bytes``): after that many bytes have passed, the connection closes.
- ``slow_close`` (``delay`` ms): the close of the stream is passed on ``delay`` late.
- ``slicer`` (``average_size``, ``size_variation`` bytes, ``delay`` microseconds): each
  chunk is cut in slices of ``average_size`` +/- ``size_variation`` bytes, ``delay``
  apart.

When one direction ends (end of stream, a toxic closing it, a write failing), its
destination socket is closed; the other direction then reads an end of stream from that
same socket, passes on what it already had and closes in turn. Toxiproxy behaves so too:
it does not keep half-closed connections, and it passes on a peer's RST as a clean close.

Deviations from Toxiproxy, and why
----------------------------------
- Stricter input: unknown attribute names, attribute values that are not non-negative
  integers, a toxicity outside 0..1, a slicer ``average_size`` below 1 or a
  ``size_variation`` not below it are refused with 400. Toxiproxy ignores unknown names
  and takes the rest, which turns a typo into a silent no-op; whatever this server
  accepts, a real Toxiproxy accepts too.
- A proxy created without ``listen`` listens on ``127.0.0.1:0``, not on every interface.
- Removing a ``timeout`` toxic closes only the connections it actually applied to
  (per toxicity); Toxiproxy closes every connection of that direction.
- ``reset_peer`` sends RSTs on connections opened before the toxic was added too;
  Toxiproxy sets SO_LINGER only on connections opened after, so those end with a FIN.
- Toxicity is drawn when a toxic starts on a connection or is updated; Toxiproxy draws
  again also whenever a later toxic is added to the same direction.
- When a toxic closes a direction (timeout expiry, ``limit_data``, ``reset_peer``), a
  chunk that is still held by a later toxic of that direction is discarded; Toxiproxy
  lets it through first.
- One request per HTTP connection (``Connection: close``), ``Content-Length`` bodies
  only; no ``/metrics``, no ``-config`` file, and no HTTP-level toxics.

Concurrency: the whole server (API, listeners, every connection) runs on one asyncio
event loop, on the caller's thread in the foreground or on one thread for
``ToxiproxyServer``. Every wait can be cancelled, so disabling or deleting a proxy or
stopping the server ends all of its work at once, and nothing outlives ``stop()``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import signal
import socket
import struct
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar, Final, NoReturn
from urllib.parse import unquote, urlsplit

__all__ = ["VERSION", "ToxiproxyServer", "main"]

log = logging.getLogger(__name__)

VERSION: Final = "toxiproxy_compat 1.0 (Toxiproxy 2.x API)"

STREAMS: Final = ("upstream", "downstream")

# Go's io.Copy, which Toxiproxy reads connections with, moves 32 KiB at a time.
_READ_SIZE: Final = 32 * 1024
# Toxiproxy buffers up to 1024 chunks ahead of a latency toxic; reading must go on while
# chunks wait, or their arrival times (which latency counts from) would come late.
_QUEUE_CHUNKS: Final = 1024
_CONNECT_TIMEOUT: Final = 10.0
# How long closed connections may take to flush before their sockets are aborted, and how
# long stopping may wait for the tasks it cancelled.
_CLOSE_GRACE: Final = 5.0
_HTTP_TIMEOUT: Final = 30.0
_MAX_BODY: Final = 1 << 20
_MAX_HEADERS: Final = 100
_DEFAULT_LISTEN: Final = "127.0.0.1:0"

# Toxicity and jitter are chances, not secrets.
_random = random.Random()

Emit = Callable[[bytes, float], Awaitable[None]]


class _ApiError(Exception):
    """An API failure with the HTTP status Toxiproxy gives it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def to_json(self) -> dict[str, object]:
        return {"error": self.message, "status": self.status}


class _LinkEnded(Exception):
    """Unwinds a chunk's way through the toxics once a toxic has closed its link."""


def _now() -> float:
    return asyncio.get_running_loop().time()


# Addresses ----------------------------------------------------------------------------


def _split_address(value: object, field: str, *, allow_port_zero: bool) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port); 400 if it is neither."""
    if not isinstance(value, str) or not value:
        raise _ApiError(400, f"bad request body: {field} must be a host:port string")
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        colon, port_text = rest[:1], rest[1:]
        ok = bool(bracket) and colon == ":"
    else:
        host, colon, port_text = value.rpartition(":")
        ok = bool(colon)
    if not ok or not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
        raise _ApiError(400, f"bad request body: {field} {value!r} is not host:port")
    port = int(port_text)
    if port == 0 and not allow_port_zero:
        raise _ApiError(400, f"bad request body: {field} {value!r} needs a port")
    return host, port


def _format_address(sockname: Any) -> str:
    host, port = str(sockname[0]), int(sockname[1])
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind(host: str, port: int) -> socket.socket:
    """One bound TCP socket for ``host:port``.

    A name such as ``localhost`` can resolve to several addresses; binding only the first
    keeps one listener with one port, as Go's net.Listen does. Raises OSError.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # Re-enabling a proxy must get its port back while old connections sit in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _set_linger_zero(writer: asyncio.StreamWriter) -> None:
    """Make closing this socket send an RST, not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# Toxics -------------------------------------------------------------------------------


@dataclass
class _Toxic:
    """A toxic as the API shows it; each link it applies to runs a _Stage for it."""

    name: str
    type: str
    stream: str
    toxicity: float
    attributes: dict[str, int]

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "type": self.type,
            "stream": self.stream,
            "toxicity": self.toxicity,
            "attributes": dict(self.attributes),
        }


class _Stage:
    """One toxic at work on one link (Toxiproxy's ToxicStub).

    Subclasses act on data (``on_data``, which hands what passes to ``emit``) and on the
    end of the stream (``on_eof``, which returns to let it pass). A stage is detached when
    its toxic is removed or updated or its link ends: waits end at once and what the stage
    holds goes on, as an interrupted Toxiproxy toxic hands on its data.
    """

    ATTRIBUTES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, toxic: _Toxic, link: _Link) -> None:
        self.toxic = toxic
        self.link = link
        self.active = _random.random() < toxic.toxicity
        self.detached = asyncio.Event()

    @classmethod
    def validate(cls, attributes: dict[str, int]) -> None:
        """Raise a 400 _ApiError if the attributes make no sense together."""

    @property
    def attrs(self) -> dict[str, int]:
        return self.toxic.attributes

    @property
    def applies(self) -> bool:
        return self.active and not self.detached.is_set()

    def start(self) -> None:
        """Called once the stage is in its link's chain."""

    def inherit(self, old: _Stage) -> None:
        """Take over per-connection state when the toxic is updated, as Toxiproxy keeps it."""

    async def on_data(self, data: bytes, ts: float, emit: Emit) -> None:
        await emit(data, ts)

    async def on_eof(self) -> None:
        return

    def detach(self, *, cleanup: bool) -> None:
        """Take the stage out of service; ``cleanup`` when its toxic is being removed."""
        if self.detached.is_set():
            return
        self.detached.set()
        self._stop()
        if cleanup and self.active:
            self._cleanup()

    def _stop(self) -> None:
        return

    def _cleanup(self) -> None:
        return

    async def _sleep_until(self, due: float) -> bool:
        """Wait until loop time ``due``: True if it came, False if detached first."""
        if self.detached.is_set():
            return False
        delay = due - _now()
        if delay <= 0:
            return True
        try:
            async with asyncio.timeout(delay):
                await self.detached.wait()
        except TimeoutError:
            return True
        return False


class _Latency(_Stage):
    ATTRIBUTES = ("latency", "jitter")

    async def on_data(self, data: bytes, ts: float, emit: Emit) -> None:
        jitter = self.attrs["jitter"]
        delay_ms = self.attrs["latency"] + (_random.uniform(-jitter, jitter) if jitter else 0.0)
        # Counted from the chunk's arrival, so a burst of chunks is not delayed cumulatively;
        # the departure time is passed on so that a second latency toxic adds to this one.
        due = ts + max(delay_ms, 0.0) / 1000
        if await self._sleep_until(due):
            await emit(data, due)
        else:
            await emit(data, _now())


class _Timeout(_Stage):
    ATTRIBUTES = ("timeout",)

    def __init__(self, toxic: _Toxic, link: _Link) -> None:
        super().__init__(toxic, link)
        self._timer: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.active and self.attrs["timeout"] > 0:
            self._timer = self.link.spawn(self._expire(self.attrs["timeout"] / 1000), "timeout")

    async def _expire(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.link.end()

    async def on_data(self, data: bytes, ts: float, emit: Emit) -> None:
        return  # Dropped on the ground, as Toxiproxy does.

    def _stop(self) -> None:
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()

    def _cleanup(self) -> None:
        # The stream has lost data: Toxiproxy closes it rather than let it go on corrupt.
        self.link.end()


class _ResetPeer(_Stage):
    ATTRIBUTES = ("timeout",)

    async def on_data(self, data: bytes, ts: float, emit: Emit) -> None:
        await self._reset()

    async def on_eof(self) -> None:
        await self._reset()

    async def _reset(self) -> NoReturn:
        # As in Toxiproxy, the countdown starts with the first data and is not cut short
        # by removing the toxic: the reset is already decided.
        await asyncio.sleep(self.attrs["timeout"] / 1000)
        self.link.end(rst=True)
        raise _LinkEnded


class _Bandwidth(_Stage):
    ATTRIBUTES = ("rate",)

    def __init__(self, toxic: _Toxic, link: _Link) -> None:
        super().__init__(toxic, link)
        self._next_send = 0.0

    def inherit(self, old: _Stage) -> None:
        if isinstance(old, _Bandwidth):
            self._next_send = old._next_send

    async def on_data(self, data: bytes, ts: float, emit: Emit) -> None:
        rate = self.attrs["rate"]
        if rate <= 0:
            # Toxiproxy's rate 0 sends empty slices forever: nothing passes until removal.
            await self.detached.wait()
            await emit(data, _now())
            return
        per_second = rate * 1000
        step = rate * 100  # A tenth of a second's worth, Toxiproxy's slice for big chunks.
        offset = 0
        while offset < len(data):
            piece = data[offset : offset + step]
            # An idle link earns no credit: pacing restarts from now.
            due = max(_now(), self._next_send) + len(piece) / per_second
            if not await self._sleep_until(due):
                await emit(data[offset:], _now())
                return
            self._next_send = due
            offset += len(piece)
            await emit(piece, due)


class _LimitData(_Stage):
    ATTRIBUTES = ("bytes",)

    def __init__(self, toxic: _Toxic, link: _Link) -> None:
        super().__init__(toxic, link)
        self._passed = 0

    def inherit(self, old: _Stage) -> None:
        if isinstance(old, _LimitData):
            self._passed = old._passed

    async def on_data(self, data: bytes, ts: float, emit: Emit) -> None:
        limit = self.attrs["bytes"]
        piece = data[: max(limit - self._passed, 0)]
        if piece:
            self._passed += len(piece)
            await emit(piece, ts)
        if self._passed >= limit:
            self.link.end()
            raise _LinkEnded


class _SlowClose(_Stage):
    ATTRIBUTES = ("delay",)

    async def on_eof(self) -> None:
        await self._sleep_until(_now() + self.attrs["delay"] / 1000)


class _Slicer(_Stage):
    ATTRIBUTES = ("average_size", "size_variation", "delay")

    @classmethod
    def validate(cls, attributes: dict[str, int]) -> None:
        if attributes["average_size"] < 1:
            raise _ApiError(400, "bad request body: slicer average_size must be at least 1")
        if attributes["size_variation"] >= attributes["average_size"]:
            raise _ApiError(400, "bad request body: slicer size_variation must be smaller than average_size")

    async def on_data(self, data: bytes, ts: float, emit: Emit) -> None:
        average, variation, delay_us = (self.attrs[key] for key in self.ATTRIBUTES)
        offset = 0
        while offset < len(data):
            # variation < average, so every slice has at least one byte.
            size = average + _random.randint(-variation, variation)
            piece = data[offset : offset + size]
            offset += len(piece)
            await emit(piece, ts)
            if offset < len(data) and delay_us > 0 and not await self._sleep_until(_now() + delay_us / 1e6):
                await emit(data[offset:], ts)
                return


_STAGES: Final[dict[str, type[_Stage]]] = {
    "latency": _Latency,
    "timeout": _Timeout,
    "reset_peer": _ResetPeer,
    "bandwidth": _Bandwidth,
    "limit_data": _LimitData,
    "slow_close": _SlowClose,
    "slicer": _Slicer,
}


def _parse_toxicity(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise _ApiError(400, "bad request body: toxicity must be a number from 0 to 1")
    return float(value)


def _parse_attributes(kind: str, value: object) -> dict[str, int]:
    """The attributes given, checked against what the toxic type knows; 400 otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _ApiError(400, "bad request body: attributes must be a JSON object")
    known = _STAGES[kind].ATTRIBUTES
    parsed: dict[str, int] = {}
    for key, number in value.items():
        if key not in known:
            raise _ApiError(400, f"bad request body: {kind} has no attribute {key!r} (it has {', '.join(known)})")
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise _ApiError(400, f"bad request body: attribute {key} must be a non-negative integer")
        parsed[key] = number
    return parsed


def _parse_toxic(body: object) -> _Toxic:
    if not isinstance(body, dict):
        raise _ApiError(400, "bad request body: expected a JSON object")
    stream = body.get("stream")
    stream = "downstream" if stream is None else stream
    if stream not in STREAMS:
        raise _ApiError(400, "stream was invalid, can be either upstream or downstream")
    kind = body.get("type")
    if not isinstance(kind, str) or kind not in _STAGES:
        raise _ApiError(400, "invalid toxic type")
    name = body.get("name") or f"{kind}_{stream}"
    if not isinstance(name, str):
        raise _ApiError(400, "bad request body: name must be a string")
    toxicity = _parse_toxicity(1.0 if body.get("toxicity") is None else body["toxicity"])
    attributes = dict.fromkeys(_STAGES[kind].ATTRIBUTES, 0)
    attributes.update(_parse_attributes(kind, body.get("attributes")))
    _STAGES[kind].validate(attributes)
    return _Toxic(name=name, type=kind, stream=stream, toxicity=toxicity, attributes=attributes)


# Connections --------------------------------------------------------------------------


@dataclass(slots=True)
class _Chunk:
    data: bytes
    ts: float  # Loop time when it was read from the source.


class _Link:
    """One direction of one connection: reads its source, runs the data through the
    stages of that direction's toxics in order, and writes its destination."""

    def __init__(
        self, conn: _Connection, stream: str, source: asyncio.StreamReader, dest: asyncio.StreamWriter
    ) -> None:
        self.conn = conn
        self.stream = stream
        self._source = source
        self._dest = dest
        self._queue: asyncio.Queue[_Chunk | None] = asyncio.Queue(_QUEUE_CHUNKS)
        self.stages: list[_Stage] = []
        self.ended = False
        self._reader: asyncio.Task[None] | None = None
        self._pump: asyncio.Task[None] | None = None

    def spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        return self.conn.proxy.core.spawn(coro, f"{self.conn.label} {self.stream} {what}")

    def start(self, toxics: Iterable[_Toxic]) -> None:
        for toxic in toxics:
            self.attach(toxic)
        self._reader = self.spawn(self._read(), "reader")
        self._pump = self.spawn(self._run(), "pump")

    def attach(self, toxic: _Toxic) -> None:
        """Add the toxic at the end of the chain, as Toxiproxy adds new toxics."""
        if self.ended:
            return
        stage = _STAGES[toxic.type](toxic, self)
        self.stages.append(stage)
        stage.start()

    def detach(self, toxic: _Toxic) -> None:
        for index, stage in enumerate(self.stages):
            if stage.toxic is toxic:
                del self.stages[index]
                stage.detach(cleanup=True)
                return

    def refresh(self, toxic: _Toxic) -> None:
        """Restart the toxic's stage after an update: held data goes on, toxicity is drawn anew."""
        for index, old in enumerate(self.stages):
            if old.toxic is toxic:
                new = _STAGES[toxic.type](toxic, self)
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
                await self._queue.put(_Chunk(data, loop.time()))
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
        except _LinkEnded:
            return
        except OSError as exc:
            # Toxiproxy closes the destination when writing to it fails.
            log.debug("%s %s: destination failed: %s", self.conn.label, self.stream, exc)
        self.end()

    async def _through(self, data: bytes, ts: float, stages: list[_Stage], index: int) -> None:
        """Pass data to the first stage from ``index`` that applies, or write it out."""
        while index < len(stages) and not stages[index].applies:
            index += 1
        if index == len(stages):
            if self.ended:
                raise _LinkEnded
            if self._dest.transport.is_closing():
                self.end()
                raise _LinkEnded
            self._dest.write(data)
            await self._dest.drain()
            return

        async def emit(piece: bytes, when: float) -> None:
            await self._through(piece, when, stages, index + 1)

        await stages[index].on_data(data, ts, emit)


class _Connection:
    """A client connection and its upstream connection, joined by two links."""

    def __init__(
        self,
        proxy: _Proxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.label = f"{proxy.name} {client[1].get_extra_info('peername')}"
        self._writers = (client[1], server[1])
        self.links = {
            "upstream": _Link(self, "upstream", client[0], server[1]),
            "downstream": _Link(self, "downstream", server[0], client[1]),
        }
        self._finished = asyncio.Event()

    def start(self, toxics: Sequence[_Toxic]) -> None:
        for stream, link in self.links.items():
            link.start(toxic for toxic in toxics if toxic.stream == stream)
        self.proxy.core.spawn(self._supervise(), f"{self.label} supervisor")

    def set_linger_zero(self) -> None:
        for writer in self._writers:
            _set_linger_zero(writer)

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
                async with asyncio.timeout(_CLOSE_GRACE):
                    for writer in self._writers:
                        with contextlib.suppress(OSError):
                            await writer.wait_closed()
        finally:
            self.abort()
            self.proxy.connections.discard(self)


# Proxies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ProxySpec:
    name: str
    listen: str
    upstream: str
    enabled: bool


def _parse_proxy(item: object, where: str = "") -> _ProxySpec:
    if not isinstance(item, dict):
        raise _ApiError(400, f"bad request body{where}: expected a JSON object")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise _ApiError(400, f"missing required field: name{where}")
    upstream = item.get("upstream")
    if not upstream:
        raise _ApiError(400, f"missing required field: upstream{where}")
    _split_address(upstream, "upstream", allow_port_zero=False)
    listen = item.get("listen") or _DEFAULT_LISTEN
    _split_address(listen, "listen", allow_port_zero=True)
    enabled = item.get("enabled")
    enabled = True if enabled is None else enabled
    if not isinstance(enabled, bool):
        raise _ApiError(400, f"bad request body{where}: enabled must be true or false")
    # Both checked by _split_address; the asserts tell the type checker.
    assert isinstance(upstream, str)
    assert isinstance(listen, str)
    return _ProxySpec(name=name, listen=listen, upstream=upstream, enabled=enabled)


class _Proxy:
    """A named listener forwarding each accepted connection to its upstream."""

    def __init__(self, core: _Core, spec: _ProxySpec) -> None:
        self.core = core
        self.name = spec.name
        self.listen = spec.listen
        self.upstream = spec.upstream
        self.enabled = False
        self.toxics: list[_Toxic] = []
        self.connections: set[_Connection] = set()
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

    def ordered_toxics(self) -> list[_Toxic]:
        # Toxiproxy lists the upstream chain, then the downstream one.
        return sorted(self.toxics, key=lambda toxic: STREAMS.index(toxic.stream))

    def find_toxic(self, name: str) -> _Toxic | None:
        return next((toxic for toxic in self.toxics if toxic.name == name), None)

    async def start(self) -> None:
        """Listen on ``listen``; a port of 0 is replaced by the one picked. 500 on failure."""
        if self.enabled:
            return
        try:
            host, port = _split_address(self.listen, "listen", allow_port_zero=True)
            sock = _bind(host, port)
        except OSError as exc:
            raise _ApiError(500, f"listen tcp {self.listen}: {exc.strerror or exc}") from exc
        try:
            self._server = await asyncio.start_server(self._accept, sock=sock, backlog=128)
        except OSError as exc:
            sock.close()
            raise _ApiError(500, f"listen tcp {self.listen}: {exc.strerror or exc}") from exc
        self.listen = _format_address(sock.getsockname())
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

    def add_toxic(self, toxic: _Toxic) -> None:
        self.toxics.append(toxic)
        for conn in list(self.connections):
            conn.links[toxic.stream].attach(toxic)

    def update_toxic(self, toxic: _Toxic) -> None:
        for conn in list(self.connections):
            conn.links[toxic.stream].refresh(toxic)

    def remove_toxic(self, toxic: _Toxic) -> None:
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
            host, port = _split_address(self.upstream, "upstream", allow_port_zero=False)
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
            conn = _Connection(self, (client_reader, client_writer), (server_reader, server_writer))
            self.connections.add(conn)
            conn.start(self.toxics)
            log.debug("%s: connected to %s", conn.label, self.upstream)
        except BaseException:
            client_writer.transport.abort()
            raise
        finally:
            if task is not None:
                self._accepting.discard(task)


# The server ---------------------------------------------------------------------------


def _json_body(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _ApiError(400, f"bad request body: {exc}") from exc


def _allow(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise _ApiError(405, f"method {method} not allowed here (use {', '.join(allowed)})")


class _Core:
    """The server's state and HTTP API; used on its event loop only."""

    def __init__(self) -> None:
        self.proxies: dict[str, _Proxy] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # One API request at a time: a request that awaits (binding a listener) must not
        # see another change the same proxy halfway.
        self._lock = asyncio.Lock()
        self._api: asyncio.Server | None = None

    def track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.track(task)
        return task

    async def open(self, host: str, port: int) -> str:
        """Serve the API on host:port; return its base URL. Raises OSError."""
        sock = _bind(host, port)
        try:
            self._api = await asyncio.start_server(self._serve_http, sock=sock, backlog=128)
        except OSError:
            sock.close()
            raise
        return f"http://{_format_address(sock.getsockname())}"

    async def close(self) -> None:
        """Stop listening, drop every connection, and wait for the work to end."""
        if self._api is not None:
            self._api.close()
            self._api = None
        for proxy in self.proxies.values():
            proxy.shutdown()
        tasks = [task for task in self._tasks if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_GRACE)

    # HTTP ---------------------------------------------------------------------------

    async def _serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.track(task)
        try:
            async with asyncio.timeout(_HTTP_TIMEOUT):
                try:
                    status, payload = await self._exchange(reader)
                except _ApiError as exc:
                    status, payload = exc.status, exc.to_json()
                body = b"" if payload is None else json.dumps(payload).encode() + b"\n"
                # A 204 carries no body and, per RFC 9110, no Content-Length either.
                framing = "" if status == 204 else f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n{framing}Connection: close\r\n\r\n"
                writer.write(head.encode("latin-1") + body)
                await writer.drain()
                writer.close()
                await writer.wait_closed()
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, _ClientGone):
            pass
        finally:
            # A no-op after a clean close; frees the socket on errors and cancellation.
            writer.transport.abort()

    async def _exchange(self, reader: asyncio.StreamReader) -> tuple[int, object]:
        request_line = await reader.readline()
        if not request_line:
            raise _ClientGone
        parts = request_line.decode("latin-1").split()
        if len(parts) != 3:
            raise _ApiError(400, "malformed request line")
        method, target = parts[0].upper(), parts[1]
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADERS):
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            key, colon, value = line.decode("latin-1").partition(":")
            if not colon:
                raise _ApiError(400, "malformed header")
            headers[key.strip().lower()] = value.strip()
        else:
            raise _ApiError(431, "too many headers")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise _ApiError(411, "send the body with a Content-Length")
        length_text = headers.get("content-length", "0")
        if not (length_text.isascii() and length_text.isdigit()):
            raise _ApiError(400, "malformed Content-Length")
        if int(length_text) > _MAX_BODY:
            raise _ApiError(413, "request body too large")
        body = await reader.readexactly(int(length_text))
        # As Toxiproxy does: a web page must not be able to drive the proxies.
        if headers.get("user-agent", "").startswith("Mozilla/"):
            raise _ApiError(403, "User agent not allowed")
        # Split before unquoting, so that an escaped slash stays inside its name.
        segments = [unquote(part) for part in urlsplit(target).path.strip("/").split("/")]
        async with self._lock:
            return await self._dispatch(method, segments, body)

    async def _dispatch(self, method: str, segments: list[str], body: bytes) -> tuple[int, object]:
        match segments:
            case ["version"]:
                _allow(method, "GET")
                return 200, {"version": VERSION}
            case ["reset"]:
                _allow(method, "POST")
                await self._reset()
                return 204, None
            case ["populate"]:
                _allow(method, "POST")
                return await self._populate(_json_body(body))
            case ["proxies"]:
                _allow(method, "GET", "POST")
                if method == "GET":
                    return 200, {name: proxy.to_json() for name, proxy in self.proxies.items()}
                return await self._create(_json_body(body))
            case ["proxies", name]:
                _allow(method, "GET", "POST", "PATCH", "DELETE")
                proxy = self._proxy(name)
                if method == "GET":
                    return 200, proxy.to_json()
                if method == "DELETE":
                    proxy.stop()
                    del self.proxies[name]
                    return 204, None
                return await self._update(proxy, _json_body(body))
            case ["proxies", name, "toxics"]:
                _allow(method, "GET", "POST")
                proxy = self._proxy(name)
                if method == "GET":
                    return 200, [toxic.to_json() for toxic in proxy.ordered_toxics()]
                toxic = _parse_toxic(_json_body(body))
                if proxy.find_toxic(toxic.name) is not None:
                    raise _ApiError(409, "toxic already exists")
                proxy.add_toxic(toxic)
                return 200, toxic.to_json()
            case ["proxies", name, "toxics", toxic_name]:
                _allow(method, "GET", "POST", "PATCH", "DELETE")
                proxy = self._proxy(name)
                found = proxy.find_toxic(toxic_name)
                if found is None:
                    raise _ApiError(404, "toxic not found")
                if method == "GET":
                    return 200, found.to_json()
                if method == "DELETE":
                    proxy.remove_toxic(found)
                    return 204, None
                self._update_toxic(found, _json_body(body))
                proxy.update_toxic(found)
                return 200, found.to_json()
            case _:
                raise _ApiError(404, "not found")

    def _proxy(self, name: str) -> _Proxy:
        proxy = self.proxies.get(name)
        if proxy is None:
            raise _ApiError(404, "proxy not found")
        return proxy

    async def _create(self, body: object) -> tuple[int, object]:
        spec = _parse_proxy(body)
        if spec.name in self.proxies:
            raise _ApiError(409, "proxy already exists")
        proxy = _Proxy(self, spec)
        if spec.enabled:
            await proxy.start()  # On failure the proxy is not kept, as in Toxiproxy.
        self.proxies[spec.name] = proxy
        return 201, proxy.to_json()

    async def _update(self, proxy: _Proxy, body: object) -> tuple[int, object]:
        if not isinstance(body, dict):
            raise _ApiError(400, "bad request body: expected a JSON object")
        listen = body.get("listen") or proxy.listen
        upstream = body.get("upstream") or proxy.upstream
        _split_address(listen, "listen", allow_port_zero=True)
        _split_address(upstream, "upstream", allow_port_zero=False)
        enabled = body.get("enabled")
        enabled = proxy.enabled if enabled is None else enabled
        if not isinstance(enabled, bool):
            raise _ApiError(400, "bad request body: enabled must be true or false")
        # Both checked by _split_address; the asserts tell the type checker.
        assert isinstance(listen, str)
        assert isinstance(upstream, str)
        if listen != proxy.listen or upstream != proxy.upstream:
            # A new address means new connections: Toxiproxy restarts the proxy.
            proxy.stop()
            proxy.listen, proxy.upstream = listen, upstream
        if enabled:
            await proxy.start()
        else:
            proxy.stop()
        return 200, proxy.to_json()

    @staticmethod
    def _update_toxic(toxic: _Toxic, body: object) -> None:
        if not isinstance(body, dict):
            raise _ApiError(400, "bad request body: expected a JSON object")
        attributes = dict(toxic.attributes)
        attributes.update(_parse_attributes(toxic.type, body.get("attributes")))
        _STAGES[toxic.type].validate(attributes)
        toxicity = body.get("toxicity")
        toxic.toxicity = toxic.toxicity if toxicity is None else _parse_toxicity(toxicity)
        toxic.attributes = attributes

    async def _populate(self, body: object) -> tuple[int, object]:
        if not isinstance(body, list):
            raise _ApiError(400, "bad request body: expected a JSON list of proxies")
        # Check the whole list before changing anything, as Toxiproxy does.
        specs = [_parse_proxy(item, f" at proxy {index + 1}") for index, item in enumerate(body)]
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise _ApiError(400, "bad request body: duplicate proxy names")
        done: list[_Proxy] = []
        try:
            for spec in specs:
                existing = self.proxies.get(spec.name)
                if existing is not None and (existing.listen, existing.upstream) == (spec.listen, spec.upstream):
                    done.append(existing)
                    continue
                if existing is not None:
                    existing.stop()
                    del self.proxies[spec.name]
                proxy = _Proxy(self, spec)
                if spec.enabled:
                    await proxy.start()
                self.proxies[spec.name] = proxy
                done.append(proxy)
        except _ApiError as exc:
            return exc.status, {**exc.to_json(), "proxies": [proxy.to_json() for proxy in done]}
        return 201, {"proxies": [proxy.to_json() for proxy in done]}

    async def _reset(self) -> None:
        for proxy in self.proxies.values():
            await proxy.start()
            for toxic in list(proxy.toxics):
                proxy.remove_toxic(toxic)


class _ClientGone(Exception):
    """The HTTP client closed the connection without sending a request."""


# Running it ---------------------------------------------------------------------------


class ToxiproxyServer:
    """The server on its own event-loop thread in this process.

    ``start()`` returns once the API answers (raising OSError if the address cannot be
    bound); ``url`` is then its base URL (with the port picked when ``port`` is 0).
    ``stop()`` closes the API, every proxy and every connection, and returns once the
    thread has ended: no thread or socket of the server outlives it. Usable as a
    context manager.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._url: str | None = None
        self._error: Exception | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the server is not started")
        return self._url

    def start(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            raise RuntimeError("the server is already started")
        self._thread = threading.Thread(target=self._run, name="toxiproxy-compat", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"toxiproxy_compat did not start within {timeout}s")
        if self._error is not None:
            self._thread.join(timeout)
            self._thread = None
            raise self._error

    def stop(self, timeout: float = 10.0) -> None:
        thread = self._thread
        if thread is None:
            return
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # The loop has already ended.
                loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"toxiproxy_compat did not stop within {timeout}s")
        self._thread = None

    def __enter__(self) -> ToxiproxyServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        core = _Core()
        try:
            self._url = await core.open(self._host, self._port)
            self._ready.set()
            await self._stopping.wait()
        finally:
            await core.close()


async def _serve_foreground(host: str, port: int) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # Not on Windows: there Ctrl-C still ends the run.
            loop.add_signal_handler(signum, stopping.set)
    core = _Core()
    try:
        url = await core.open(host, port)
        # The only line on stdout: whoever started us reads the address from it.
        print(f"toxiproxy_compat listening on {url}", flush=True)
        await stopping.wait()
    finally:
        await core.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server in the foreground until SIGINT or SIGTERM; 1 if it cannot listen."""
    parser = argparse.ArgumentParser(
        prog="python -m chaos.toxiproxy_compat",
        description="A Toxiproxy-compatible fault-injection server (standard library only).",
    )
    # The single-dash spellings are toxiproxy-server's, so either command line works.
    parser.add_argument("--host", "-host", default="127.0.0.1", help="API address (default 127.0.0.1)")
    parser.add_argument("--port", "-port", type=int, default=8474, help="API port, 0 for a free one (default 8474)")
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="default warning"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_serve_foreground(args.host, args.port))
    except OSError as exc:
        print(f"toxiproxy_compat: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
