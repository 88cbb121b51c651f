"""Toxiproxy's documented behaviour, checked on whichever server chaos.toxiproxy picks.

With no real Toxiproxy at hand that is the project's fallback, toxiproxy_compat;
with ``TOXIPROXY_URL`` set or a ``toxiproxy-server`` on PATH the same tests check the real
thing, so they assert only what Toxiproxy promises (its README, and for the timeout and
latency toxics what its source does). Everything goes through toxiproxy-python, against
a local echo server: a proxy is only as good as the bytes it lets through, holds back or
cuts off. Timed assertions have a firm lower bound (the fault happened) and a generous
upper one (a shared, noisy machine). The server and its client come from the
``toxiproxy`` fixture (chaos/toxiproxy_fixtures.py).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from toxiproxy import Proxy, Toxiproxy
from toxiproxy.api import APIConsumer
from toxiproxy.exceptions import InvalidToxic, NotFound, ProxyExists

from toxiproxy_compat import ToxiproxyServer

# Deadline for anything that should happen promptly; failures say what did not.
_PROMPT = 5.0
_POLL = 0.1

Connect = Callable[[Proxy], socket.socket]


class EchoServer:
    """Sends back every byte it receives, on 127.0.0.1; ``close()`` ends every thread."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name="echo-server", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(_POLL)
            self._spawn(self._echo, conn)

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            while not self._stopping.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                view = memoryview(data)
                while view and not self._stopping.is_set():
                    try:
                        view = view[conn.send(view) :]
                    except TimeoutError:
                        continue
                    except OSError:
                        return

    def close(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(_PROMPT)
        self._listener.close()
        assert not any(thread.is_alive() for thread in self._threads), "echo server threads did not end"


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def echo_proxy(toxiproxy: Toxiproxy, echo: EchoServer) -> Proxy:
    """A proxy in front of the echo server, on a port the server picks."""
    return toxiproxy.create(upstream=echo.address, name="chaos_echo", listen="127.0.0.1:0")


@pytest.fixture
def connect() -> Iterator[Connect]:
    """Open client connections to a proxy; all are closed after the test."""
    opened: list[socket.socket] = []

    def open_to(proxy: Proxy) -> socket.socket:
        sock = socket.create_connection(_address(proxy.listen), timeout=_PROMPT)
        opened.append(sock)
        return sock

    yield open_to
    for sock in opened:
        sock.close()


def _address(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def recv_exactly(sock: socket.socket, size: int, timeout: float = _PROMPT) -> bytes:
    """``size`` bytes, or AssertionError on a close or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    received = bytearray()
    while len(received) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"received {len(received)} of {size} bytes within {timeout}s")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(size - len(received))
        except TimeoutError:
            continue
        if not chunk:
            raise AssertionError(f"connection closed after {len(received)} of {size} bytes")
        received += chunk
    return bytes(received)


def round_trip(sock: socket.socket, payload: bytes = b"ping", timeout: float = _PROMPT) -> float:
    """Send ``payload``, get it echoed back whole; the seconds that took."""
    start = time.monotonic()
    sock.sendall(payload)
    assert recv_exactly(sock, len(payload), timeout) == payload
    return time.monotonic() - start


def assert_silent(sock: socket.socket, seconds: float) -> None:
    """Nothing arrives for ``seconds``, and the connection stays open (no EOF, no reset)."""
    sock.settimeout(seconds)
    try:
        data = sock.recv(1)
    except TimeoutError:
        return
    raise AssertionError(f"expected silence, got {data!r}" if data else "expected silence, the connection closed")


def read_until_closed(sock: socket.socket, timeout: float = _PROMPT) -> tuple[bytes, str]:
    """What arrives until the peer closes, and how: "eof" (FIN) or "reset" (RST)."""
    deadline = time.monotonic() + timeout
    received = bytearray()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"connection still open after {timeout}s (received {bytes(received)!r})")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return bytes(received), "reset"
        if not chunk:
            return bytes(received), "eof"
        received += chunk


def assert_refused(proxy: Proxy) -> None:
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(_address(proxy.listen), timeout=_PROMPT).close()


# The API ------------------------------------------------------------------------------


def test_version_answers(toxiproxy: Toxiproxy) -> None:
    assert toxiproxy.running()
    assert toxiproxy.version()


def test_proxy_is_created_listed_forwards_and_is_deleted(
    toxiproxy: Toxiproxy, echo: EchoServer, connect: Connect
) -> None:
    proxy = toxiproxy.create(upstream=echo.address, name="chaos_lifecycle", listen="127.0.0.1:0")
    host, port = _address(proxy.listen)
    assert (host, proxy.enabled) == ("127.0.0.1", True)
    assert port != 0, "a listen port of 0 must come back as the port picked"

    listed = toxiproxy.proxies()["chaos_lifecycle"]
    assert (listed.listen, listed.upstream, listed.enabled) == (proxy.listen, echo.address, True)
    fetched = toxiproxy.get_proxy("chaos_lifecycle")
    assert fetched is not None
    assert fetched.listen == proxy.listen

    sock = connect(proxy)
    round_trip(sock, bytes(range(256)) * 1024)  # More than one read's worth, both ways.

    assert proxy.destroy()
    assert toxiproxy.get_proxy("chaos_lifecycle") is None
    assert read_until_closed(sock)[0] == b"", "deleting a proxy closes its connections"
    assert_refused(proxy)


def test_duplicate_unknown_and_invalid_requests_map_to_client_errors(
    toxiproxy: Toxiproxy, echo: EchoServer, echo_proxy: Proxy
) -> None:
    # The client refuses a known name itself; the server's own 409 is checked directly.
    with pytest.raises(ProxyExists):
        toxiproxy.create(upstream=echo.address, name=echo_proxy.name)
    with pytest.raises(ProxyExists):
        APIConsumer.post("/proxies", json={"name": echo_proxy.name, "listen": "127.0.0.1:0", "upstream": echo.address})

    with pytest.raises(NotFound):
        APIConsumer.get("/proxies/chaos_missing")
    with pytest.raises(NotFound):
        Proxy(name="chaos_missing", upstream=echo.address, listen="127.0.0.1:1", enabled=True).destroy()
    with pytest.raises(NotFound):
        echo_proxy.destroy_toxic("missing_toxic")

    echo_proxy.add_toxic(type="latency", attributes={"latency": 10})
    with pytest.raises(ProxyExists):
        echo_proxy.add_toxic(type="latency", attributes={"latency": 20})
    with pytest.raises(InvalidToxic):
        echo_proxy.add_toxic(type="no_such_toxic")
    with pytest.raises(InvalidToxic):
        echo_proxy.add_toxic(type="latency", stream="sideways", name="chaos_sideways")
    with pytest.raises(InvalidToxic):
        echo_proxy.add_toxic(type="latency", name="chaos_bad_value", attributes={"latency": "slow"})
    assert list(echo_proxy.toxics()) == ["latency_downstream"], "a refused toxic must not be kept"


def test_toxic_defaults_are_downstream_full_toxicity_named_by_type(echo_proxy: Proxy) -> None:
    # Posted directly: toxiproxy-python's add_toxic fills in these defaults itself.
    APIConsumer.post(f"/proxies/{echo_proxy.name}/toxics", json={"type": "latency", "attributes": {"latency": 100}})
    APIConsumer.post(
        f"/proxies/{echo_proxy.name}/toxics", json={"type": "bandwidth", "stream": "upstream", "toxicity": 0.5}
    )

    toxics = echo_proxy.toxics()
    assert sorted(toxics) == ["bandwidth_upstream", "latency_downstream"]
    latency = toxics["latency_downstream"]
    assert (latency.type, latency.stream, latency.toxicity) == ("latency", "downstream", 1.0)
    assert latency.attributes["latency"] == 100
    bandwidth = toxics["bandwidth_upstream"]
    assert (bandwidth.stream, bandwidth.toxicity) == ("upstream", 0.5)


def test_updating_a_toxic_changes_its_attributes(echo_proxy: Proxy) -> None:
    echo_proxy.add_toxic(type="latency", attributes={"latency": 10})
    response = APIConsumer.post(
        f"/proxies/{echo_proxy.name}/toxics/latency_downstream", json={"attributes": {"latency": 20}}
    )
    assert response.json()["attributes"]["latency"] == 20
    assert echo_proxy.get_toxic("latency_downstream").attributes["latency"] == 20


def test_populate_creates_proxies(toxiproxy: Toxiproxy, echo: EchoServer, connect: Connect) -> None:
    response = APIConsumer.post(
        "/populate", json=[{"name": "chaos_populated", "listen": "127.0.0.1:0", "upstream": echo.address}]
    )
    assert response.status_code == 201
    assert [proxy["name"] for proxy in response.json()["proxies"]] == ["chaos_populated"]
    proxy = toxiproxy.get_proxy("chaos_populated")
    assert proxy is not None
    round_trip(connect(proxy))


# Toxics -------------------------------------------------------------------------------


def test_timeout_zero_stops_data_keeps_the_connection_open_and_its_removal_closes_it(
    echo_proxy: Proxy, connect: Connect
) -> None:
    sock = connect(echo_proxy)
    round_trip(sock)

    echo_proxy.add_toxic(type="timeout", attributes={"timeout": 0})  # Applies to open connections too.
    sock.sendall(b"lost")
    assert_silent(sock, 0.6)

    # Toxiproxy (since 2.1.1) drops what arrived meanwhile, so it closes the connections
    # it applied to when the toxic goes: they would carry a corrupt stream.
    echo_proxy.destroy_toxic("timeout_downstream")
    data, _ = read_until_closed(sock)
    assert data == b"", "data sent under a timeout toxic is dropped, not delivered late"
    round_trip(connect(echo_proxy))


def test_timeout_closes_the_connection_after_its_time(echo_proxy: Proxy, connect: Connect) -> None:
    echo_proxy.add_toxic(type="timeout", stream="upstream", attributes={"timeout": 300})
    start = time.monotonic()
    sock = connect(echo_proxy)
    sock.sendall(b"lost")
    data, how = read_until_closed(sock)
    elapsed = time.monotonic() - start
    assert (data, how) == (b"", "eof")
    assert 0.25 <= elapsed < 0.3 + _PROMPT


def test_latency_delays_each_round_trip(echo_proxy: Proxy, connect: Connect) -> None:
    sock = connect(echo_proxy)
    baseline = min(round_trip(sock) for _ in range(3))

    echo_proxy.add_toxic(type="latency", attributes={"latency": 300})
    delayed = [round_trip(sock) for _ in range(3)]
    assert min(delayed) >= 0.29, f"round trips {delayed} with 300 ms latency (baseline {baseline:.4f}s)"
    assert max(delayed) < baseline + 0.3 + 2.0


def test_removing_latency_delivers_what_it_held_at_once(echo_proxy: Proxy, connect: Connect) -> None:
    # A held stream, unlike a timeout's, loses nothing: this is the "silence, then heal" fault.
    sock = connect(echo_proxy)
    round_trip(sock)
    echo_proxy.add_toxic(type="latency", attributes={"latency": 60_000})
    sock.sendall(b"held")
    assert_silent(sock, 0.5)

    echo_proxy.destroy_toxic("latency_downstream")
    assert recv_exactly(sock, 4) == b"held"
    assert round_trip(sock) < 2.0


@pytest.mark.parametrize(("stream", "timeout_ms"), [("upstream", 0), ("downstream", 300)])
def test_reset_peer_resets_the_connection(echo_proxy: Proxy, connect: Connect, stream: str, timeout_ms: int) -> None:
    echo_proxy.add_toxic(type="reset_peer", stream=stream, attributes={"timeout": timeout_ms})
    sock = connect(echo_proxy)
    start = time.monotonic()
    sock.sendall(b"reset me")
    data, how = read_until_closed(sock)
    assert (data, how) == (b"", "reset"), "the client must see ECONNRESET, not a clean end of stream"
    assert time.monotonic() - start >= 0.9 * timeout_ms / 1000


def test_bandwidth_limits_throughput(echo_proxy: Proxy, connect: Connect) -> None:
    payload = bytes(range(256)) * 120  # 30 720 bytes: about a second at 30 KB/s.
    sock = connect(echo_proxy)
    baseline = round_trip(sock, payload)

    echo_proxy.add_toxic(type="bandwidth", attributes={"rate": 30})
    limited = round_trip(sock, payload, timeout=15.0)
    assert limited >= 0.7, f"30 KB took {limited:.3f}s at 30 KB/s (baseline {baseline:.4f}s)"
    assert limited > baseline + 0.5


def test_limit_data_closes_after_that_many_bytes(echo_proxy: Proxy, connect: Connect) -> None:
    echo_proxy.add_toxic(type="limit_data", attributes={"bytes": 10})
    sock = connect(echo_proxy)
    payload = bytes(range(100))
    sock.sendall(payload)
    assert read_until_closed(sock) == (payload[:10], "eof")


def test_slow_close_delays_the_close(echo_proxy: Proxy, connect: Connect) -> None:
    echo_proxy.add_toxic(type="slow_close", attributes={"delay": 500})
    sock = connect(echo_proxy)
    round_trip(sock)
    start = time.monotonic()
    sock.shutdown(socket.SHUT_WR)  # Toxiproxy closes the whole connection on a client's end of stream.
    assert read_until_closed(sock) == (b"", "eof")
    assert time.monotonic() - start >= 0.45


def test_slicer_delivers_small_spaced_slices(echo_proxy: Proxy, connect: Connect) -> None:
    echo_proxy.add_toxic(type="slicer", attributes={"average_size": 10, "size_variation": 4, "delay": 30_000})
    sock = connect(echo_proxy)
    payload = bytes(range(100))
    start = time.monotonic()
    sock.sendall(payload)
    pieces: list[bytes] = []
    while sum(map(len, pieces)) < len(payload):
        pieces.append(recv_exactly(sock, 1) + _recv_available(sock))
    assert b"".join(pieces) == payload
    assert len(pieces) >= 4, f"arrived as {[len(piece) for piece in pieces]} bytes"
    assert time.monotonic() - start >= 0.1


def _recv_available(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b""
    finally:
        sock.setblocking(True)


def test_toxicity_zero_leaves_connections_alone(echo_proxy: Proxy, connect: Connect) -> None:
    echo_proxy.add_toxic(type="timeout", toxicity=0.0, attributes={"timeout": 0})
    assert echo_proxy.toxics()["timeout_downstream"].toxicity == 0
    for _ in range(3):
        round_trip(connect(echo_proxy))


# Proxy state --------------------------------------------------------------------------


def test_disabling_closes_and_refuses_connections_and_enabling_restores(
    toxiproxy: Toxiproxy, echo_proxy: Proxy, connect: Connect
) -> None:
    sock = connect(echo_proxy)
    round_trip(sock)

    echo_proxy.disable()
    read_until_closed(sock)
    assert_refused(echo_proxy)
    state = toxiproxy.get_proxy(echo_proxy.name)
    assert state is not None
    assert state.enabled is False

    echo_proxy.enable()
    state = toxiproxy.get_proxy(echo_proxy.name)
    assert state is not None
    assert (state.enabled, state.listen) == (True, echo_proxy.listen), "enabling listens on the same address"
    round_trip(connect(echo_proxy))


def test_reset_enables_proxies_and_removes_toxics(toxiproxy: Toxiproxy, echo_proxy: Proxy, connect: Connect) -> None:
    echo_proxy.add_toxic(type="latency", attributes={"latency": 2000})
    echo_proxy.disable()

    assert toxiproxy.reset()
    state = toxiproxy.get_proxy(echo_proxy.name)
    assert state is not None
    assert state.enabled is True
    assert echo_proxy.toxics() == {}
    assert round_trip(connect(echo_proxy)) < 1.5


# The in-process server ----------------------------------------------------------------


def _api(url: str, method: str, path: str, body: object = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    # The URL is the in-process server's own http://127.0.0.1 address.
    request = urllib.request.Request(url + path, data=data, method=method)
    with urllib.request.urlopen(request, timeout=_PROMPT) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def test_in_process_server_stop_ends_its_connections_and_threads(echo: EchoServer) -> None:
    before = set(threading.enumerate())
    server = ToxiproxyServer("127.0.0.1", 0)
    server.start()
    try:
        created = _api(server.url, "POST", "/proxies", {"name": "held", "upstream": echo.address})
        sock = socket.create_connection(_address(created["listen"]), timeout=_PROMPT)
    except BaseException:
        server.stop()
        raise
    with sock:
        round_trip(sock)
        _api(server.url, "POST", "/proxies/held/toxics", {"type": "latency", "attributes": {"latency": 60_000}})
        sock.sendall(b"held")
        start = time.monotonic()
        server.stop()
        assert time.monotonic() - start < _PROMPT
        read_until_closed(sock)

    with pytest.raises(urllib.error.URLError):
        _api(server.url, "GET", "/version")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(_address(created["listen"]), timeout=_PROMPT).close()
    deadline = time.monotonic() + _PROMPT
    while leftover := [t for t in set(threading.enumerate()) - before if t.name != "echo-server"]:
        assert time.monotonic() < deadline, f"threads left after stop: {leftover}"
        time.sleep(_POLL)
