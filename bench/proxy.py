"""A TCP proxy in front of PostgreSQL that counts round trips, per connection.

It forwards bytes untouched and reads the server's side of the protocol:
every ``ReadyForQuery`` message (type ``Z``) ends one round trip (a simple
query, or an extended-protocol batch up to its Sync). The first one ends the
start-up and is not counted. A round trip is timed from the first byte the
client sent after the previous ``ReadyForQuery`` to this one, and the bytes
the client sent for it are counted. TLS and GSS encryption must be off
(``sslmode=disable gssencmode=disable``): the proxy reads the stream in clear.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass
class RoundTrip:
    sent_at: float
    answered_at: float
    bytes_sent: int


@dataclass
class Connection:
    index: int
    opened_at: float
    closed_at: float | None = None
    round_trips: list[RoundTrip] = field(default_factory=list)
    _request_at: float | None = None
    _request_bytes: int = 0
    _started: bool = False

    @property
    def open(self) -> bool:
        return self.closed_at is None


class CountingProxy:
    """Listens on 127.0.0.1 (a free port); one pair of threads per connection."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self.connections: list[Connection] = []
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="bench-proxy", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                conn = Connection(len(self.connections), time.monotonic())
                self.connections.append(conn)
                self._sockets += [client, server]
            threading.Thread(target=self._upward, args=(conn, client, server), daemon=True).start()
            threading.Thread(target=self._downward, args=(conn, server, client), daemon=True).start()

    def _upward(self, conn: Connection, client: socket.socket, server: socket.socket) -> None:
        """Client to server: note when a request starts and how many bytes it has."""
        try:
            while chunk := client.recv(65536):
                with self._lock:
                    if conn._request_at is None:
                        conn._request_at = time.monotonic()
                    conn._request_bytes += len(chunk)
                server.sendall(chunk)
        except OSError:
            pass
        finally:
            _shut(server)

    def _downward(self, conn: Connection, server: socket.socket, client: socket.socket) -> None:
        """Server to client: find each message's type and length; a ``Z`` ends a round trip."""
        pending = b""
        try:
            while chunk := server.recv(65536):
                pending += chunk
                offset = 0
                ready = 0
                while len(pending) - offset >= 5:
                    kind = pending[offset : offset + 1]
                    (length,) = struct.unpack_from("!I", pending, offset + 1)
                    if len(pending) - offset < 1 + length:
                        break
                    offset += 1 + length
                    ready += kind == b"Z"
                pending = pending[offset:]
                client.sendall(chunk)
                if ready:
                    self._answered(conn, ready)
        except OSError:
            pass
        finally:
            with self._lock:
                conn.closed_at = time.monotonic()
            _shut(client)

    def _answered(self, conn: Connection, count: int) -> None:
        answered = time.monotonic()
        with self._lock:
            for _ in range(count):
                if not conn._started:
                    conn._started = True  # the end of the start-up
                else:
                    sent = conn._request_at if conn._request_at is not None else answered
                    conn.round_trips.append(RoundTrip(sent, answered, conn._request_bytes))
                conn._request_at = None
                conn._request_bytes = 0

    def round_trips(self, since: float, until: float) -> list[tuple[int, RoundTrip]]:
        """(connection index, round trip) answered within [since, until)."""
        with self._lock:
            return [
                (conn.index, trip)
                for conn in self.connections
                for trip in conn.round_trips
                if since <= trip.answered_at < until
            ]

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
