"""A TCP proxy between a Mutex and PostgreSQL that fails the way networks do.

- `silence` stops forwarding in both directions on every connection, old and
  new, while keeping the sockets open (no RST, no FIN): a silent partition.
  `heal` delivers what was held back and forwards again.
- `drop_replies` lets existing connections reach the server but swallows what
  the server answers: a statement runs, its reply never arrives.
- `reset` tears every connection down with a TCP RST.
- `delay_requests` holds back what clients send on existing connections, and
  keeps the server's end open when a client closes its own: `deliver_late`
  then hands the server what was held, as a server that read a statement
  late (after its client gave up on it) would run it.

It also counts the server's ReadyForQuery messages: one per round trip, which
is how the tests prove each lock operation costs exactly one; and the
client's messages by type (``Q`` a simple query, ``P`` a statement to parse,
``B`` a run of one already parsed), which is how they prove what is prepared.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time


class _Link:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.cond = threading.Lock()
        self.hold = False
        self.drop_down = False
        self.hold_up = False
        self.client_gone = False
        self.pending: list[tuple[socket.socket, bytes]] = []
        self.down_buffer = b""
        self.up_buffer = b""
        self.started = False
        self.closed = False

    def close(self, *, rst: bool = False) -> None:
        self.closed = True
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                if rst:
                    # Linger 0 turns the close into an RST. SHUT_RD only wakes the
                    # pump blocked in recv(): until it returns, close() is deferred.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.shutdown(socket.SHUT_RD)
                else:
                    sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._silent = False
        self._ready_for_query = 0
        self._notifications = 0
        self._sent: dict[str, int] = {}
        self._accepted = 0
        self._running = True
        threading.Thread(target=self._accept, daemon=True, name="faultproxy-accept").start()

    @property
    def ready_for_query(self) -> int:
        """Round trips completed through the proxy so far."""
        with self._lock:
            return self._ready_for_query

    @property
    def notifications(self) -> int:
        """Notifications (of a LISTENed channel) the server delivered through the proxy so far."""
        with self._lock:
            return self._notifications

    def sent(self, kind: str) -> int:
        """Messages of type ``kind`` (one letter) the clients sent through the proxy so far."""
        with self._lock:
            return self._sent.get(kind, 0)

    def silence(self, *, existing: bool = True) -> None:
        """Hold back all data of new connections, and of existing ones unless ``existing=False``."""
        with self._lock:
            self._silent = True
            links = list(self._links) if existing else []
        for link in links:
            with link.cond:
                link.hold = True

    def heal(self) -> None:
        with self._lock:
            self._silent = False
            links = list(self._links)
        for link in links:
            with link.cond:
                link.hold = False
                pending, link.pending = link.pending, []
                for dst, data in pending:
                    try:
                        dst.sendall(data)
                    except OSError:
                        break

    def drop_replies(self) -> None:
        """Existing connections: forward requests, swallow every reply from now on."""
        with self._lock:
            links = list(self._links)
        for link in links:
            with link.cond:
                link.drop_down = True

    def delay_requests(self) -> None:
        """Existing connections: hold back what the client sends, even after it closed its end."""
        with self._lock:
            links = list(self._links)
        for link in links:
            with link.cond:
                link.hold_up = True

    def deliver_late(self, timeout: float = 10.0) -> None:
        """Hand the server what `delay_requests` held, then the close of any client that left
        meanwhile; return once the server ended those connections (or ``timeout`` passed)."""
        with self._lock:
            links = [link for link in self._links if link.hold_up]
        for link in links:
            with link.cond:
                link.hold_up = False
                pending, link.pending = link.pending, []
                with contextlib.suppress(OSError):
                    for dst, data in pending:
                        dst.sendall(data)
                    if link.client_gone:
                        link.server.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(link.closed for link in links if link.client_gone):
            time.sleep(0.01)

    def reset(self) -> None:
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close(rst=True)

    @property
    def accepted(self) -> int:
        """Connections opened through the proxy so far."""
        with self._lock:
            return self._accepted

    def connections(self) -> int:
        with self._lock:
            return sum(not link.closed for link in self._links)

    def close(self) -> None:
        self._running = False
        self._listener.close()
        self.reset()

    def _accept(self) -> None:
        while self._running:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            link = _Link(client, server)
            with self._lock:
                link.hold = self._silent
                self._links.append(link)
                self._accepted += 1
            threading.Thread(target=self._pump, args=(link, client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(link, server, client, True), daemon=True).start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                with link.cond:
                    if not downstream and link.hold_up:
                        link.client_gone = True  # the server's end stays open: `deliver_late`
                        return
                link.close()
                return
            if downstream:
                self._count(link, data)
            else:
                self._count_sent(link, data)
            with link.cond:
                if downstream and link.drop_down:
                    continue
                if link.hold or (link.hold_up and not downstream):
                    link.pending.append((dst, data))
                    continue
                with contextlib.suppress(OSError):
                    dst.sendall(data)

    def _count_sent(self, link: _Link, data: bytes) -> None:
        # Client messages: the start-up packet has no type byte (4-byte length,
        # including itself, then the body); every later one is typed like the server's.
        buf = link.up_buffer + data
        kinds: list[str] = []
        while True:
            header = 4 if not link.started else 5
            if len(buf) < header:
                break
            length = int.from_bytes(buf[header - 4 : header], "big")
            if len(buf) < header - 4 + length:
                break
            if link.started:
                kinds.append(chr(buf[0]))
            link.started = True
            buf = buf[header - 4 + length :]
        link.up_buffer = buf
        if kinds:
            with self._lock:
                for kind in kinds:
                    self._sent[kind] = self._sent.get(kind, 0) + 1

    def _count(self, link: _Link, data: bytes) -> None:
        # Server messages: 1-byte type, 4-byte length (including itself), body.
        buf = link.down_buffer + data
        seen = notified = 0
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if len(buf) < 1 + length:
                break
            if buf[0:1] == b"Z":
                seen += 1
            elif buf[0:1] == b"A":
                notified += 1
            buf = buf[1 + length :]
        link.down_buffer = buf
        if seen or notified:
            with self._lock:
                self._ready_for_query += seen
                self._notifications += notified
