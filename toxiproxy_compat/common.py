"""What the server's parts share: the API's error, the clock, addresses and sockets, the task owner."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Coroutine
from typing import Any, Final, Protocol

STREAMS: Final = ("upstream", "downstream")

# How long closed connections may take to flush before their sockets are aborted, and how
# long stopping may wait for the tasks it cancelled.
CLOSE_GRACE: Final = 5.0


class ApiError(Exception):
    """An API failure with the HTTP status Toxiproxy gives it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def to_json(self) -> dict[str, object]:
        return {"error": self.message, "status": self.status}


class LinkEnded(Exception):
    """Unwinds a chunk's way through the toxics once a toxic has closed its link."""


def loop_time() -> float:
    """The running event loop's clock, which chunks are stamped and toxics wait on."""
    return asyncio.get_running_loop().time()


class Tasks(Protocol):
    """What owns the server's tasks (the server's core): whatever it starts is cancelled when it closes."""

    def track(self, task: asyncio.Task[Any]) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...


# Addresses ----------------------------------------------------------------------------


def split_address(value: object, field: str, *, allow_port_zero: bool) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port); 400 if it is neither."""
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"bad request body: {field} must be a host:port string")
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        colon, port_text = rest[:1], rest[1:]
        ok = bool(bracket) and colon == ":"
    else:
        host, colon, port_text = value.rpartition(":")
        ok = bool(colon)
    if not ok or not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
        raise ApiError(400, f"bad request body: {field} {value!r} is not host:port")
    port = int(port_text)
    if port == 0 and not allow_port_zero:
        raise ApiError(400, f"bad request body: {field} {value!r} needs a port")
    return host, port


def format_address(sockname: Any) -> str:
    host, port = str(sockname[0]), int(sockname[1])
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
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


def set_linger_zero(writer: asyncio.StreamWriter) -> None:
    """Make closing this socket send an RST, not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
