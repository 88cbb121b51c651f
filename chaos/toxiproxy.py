"""Find or start a Toxiproxy server for the chaos suite.

``toxiproxy_endpoint()`` yields the first of these that is available, and logs which:

1. ``TOXIPROXY_URL`` (e.g. ``http://127.0.0.1:8474``): a server someone already runs,
   used as is; it must answer ``GET /version`` within a few seconds.
2. A ``toxiproxy-server`` binary on PATH, started on 127.0.0.1 and a free port.
3. The official image ``ghcr.io/shopify/toxiproxy`` through ``testcontainers``, when a
   Docker daemon answers. It runs with host networking, so that its proxies listen on
   this machine's loopback and reach a PostgreSQL listening there (Linux hosts).
4. The project's fallback, ``python -m toxiproxy_compat``, as a subprocess.

A server it starts is stopped when the block ends; a ``TOXIPROXY_URL`` server is left
alone. A server that is found but does not come up raises RuntimeError rather than
falling through, so that a broken setup is noticed; only a missing Docker daemon
(testcontainers raises DockerException at once) falls through to the fallback.

toxiproxy-python keeps the API address in class attributes: ``toxiproxy_client(url)``
points every ``Toxiproxy`` and ``Proxy`` object of the process at ``url``.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

from toxiproxy import Toxiproxy

__all__ = [
    "TOXIPROXY_IMAGE",
    "ServerKind",
    "ToxiproxyEndpoint",
    "toxiproxy_client",
    "toxiproxy_endpoint",
    "toxiproxy_server",
]

log = logging.getLogger(__name__)

TOXIPROXY_IMAGE = "ghcr.io/shopify/toxiproxy"

# Starting a binary or the fallback takes well under a second; pulling and starting the
# image can take a while on a cold machine.
_START_TIMEOUT = 15.0
_CONTAINER_START_TIMEOUT = 60.0
_STOP_TIMEOUT = 5.0
_REPO_ROOT = Path(__file__).resolve().parent.parent


class ServerKind(enum.Enum):
    """Where the Toxiproxy server came from."""

    ENV = "TOXIPROXY_URL"
    BINARY = "toxiproxy-server binary"
    CONTAINER = "container"
    COMPAT = "toxiproxy_compat fallback"


@dataclass(frozen=True)
class ToxiproxyEndpoint:
    """A Toxiproxy API base URL (no trailing slash) and where the server came from."""

    url: str
    kind: ServerKind

    @property
    def host(self) -> str:
        return _host_port(self.url)[0]

    @property
    def port(self) -> int:
        return _host_port(self.url)[1]


@contextlib.contextmanager
def toxiproxy_endpoint() -> Iterator[ToxiproxyEndpoint]:
    """Yield a running Toxiproxy server, found or started as the module docstring says.

    Raises RuntimeError if the server chosen does not answer in time.
    """
    with contextlib.ExitStack() as stack:
        endpoint = _pick(stack)
        log.info("Toxiproxy: using the %s at %s", endpoint.kind.value, endpoint.url)
        yield endpoint


@contextlib.contextmanager
def toxiproxy_server() -> Iterator[str]:
    """Yield the API base URL of a running Toxiproxy server (see ``toxiproxy_endpoint``)."""
    with toxiproxy_endpoint() as endpoint:
        yield endpoint.url


def toxiproxy_client(url: str) -> Toxiproxy:
    """A toxiproxy-python client for the server at ``url``.

    The address is class-level state of toxiproxy-python: this repoints every client in
    the process, which is why fixtures call it again for each test.
    """
    host, port = _host_port(url)
    client = Toxiproxy()
    client.update_api_consumer(host, port)
    return client


def _pick(stack: contextlib.ExitStack) -> ToxiproxyEndpoint:
    url = os.environ.get("TOXIPROXY_URL")
    if url:
        url = url.rstrip("/")
        _host_port(url)  # Refuse a malformed value before waiting on it.
        _wait_for_api(url, _START_TIMEOUT, what=f"TOXIPROXY_URL={url}")
        return ToxiproxyEndpoint(url, ServerKind.ENV)

    binary = shutil.which("toxiproxy-server")
    if binary is not None:
        return ToxiproxyEndpoint(stack.enter_context(_binary_server(binary)), ServerKind.BINARY)

    container_url = _container_server(stack)
    if container_url is not None:
        return ToxiproxyEndpoint(container_url, ServerKind.CONTAINER)

    return ToxiproxyEndpoint(stack.enter_context(_compat_server()), ServerKind.COMPAT)


@contextlib.contextmanager
def _binary_server(binary: str) -> Iterator[str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with _server_log() as (log_path, log_file):
        process = subprocess.Popen(
            [binary, "-host", "127.0.0.1", "-port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for_api(url, _START_TIMEOUT, what=binary, process=process, log_path=log_path)
            yield url
        finally:
            _terminate(process)


def _container_server(stack: contextlib.ExitStack) -> str | None:
    """Start the official image; None (logged) if testcontainers or Docker is missing."""
    try:
        # docker (a testcontainers dependency) ships no type hints; types-docker may be installed.
        from docker.errors import DockerException  # type: ignore[import-untyped,unused-ignore]
        from testcontainers.core.container import DockerContainer
    except ImportError:
        log.info("Toxiproxy: testcontainers is not installed, not trying a container")
        return None
    port = _free_port()
    try:
        # Host networking: proxies must listen on this machine and reach its loopback.
        container = (
            DockerContainer(TOXIPROXY_IMAGE)
            .with_kwargs(network_mode="host")
            .with_command(["-host=127.0.0.1", f"-port={port}"])
        )
        container.start()
    except DockerException as exc:
        reason = str(exc)
    else:
        stack.callback(container.stop)
        url = f"http://127.0.0.1:{port}"
        _wait_for_api(url, _CONTAINER_START_TIMEOUT, what=f"container {TOXIPROXY_IMAGE} (host networking)")
        return url
    # docker-py leaves the socket of its failed attempt to the garbage collector: collect
    # it now, quietly, rather than let a ResourceWarning surface in some later test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    log.info("Toxiproxy: no Docker (%s), not using a container", reason)
    return None


@contextlib.contextmanager
def _compat_server() -> Iterator[str]:
    env = dict(os.environ)
    # Importable from any working directory: the package lives at the repository root.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    with _server_log() as (log_path, log_file):
        process = subprocess.Popen(
            [sys.executable, "-m", "toxiproxy_compat", "--host", "127.0.0.1", "--port", "0"],
            cwd=_REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            bufsize=0,
        )
        try:
            # Port 0 and the announced address leave no window for another process to
            # take a port picked in advance.
            url = _read_announced_url(process, time.monotonic() + _START_TIMEOUT, log_path)
            _wait_for_api(url, _START_TIMEOUT, what="toxiproxy_compat", process=process, log_path=log_path)
            yield url
        finally:
            _terminate(process)


def _read_announced_url(process: subprocess.Popen[bytes], deadline: float, log_path: Path) -> str:
    assert process.stdout is not None
    fd = process.stdout.fileno()
    received = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in received:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"toxiproxy_compat did not announce its address: {_tail(log_path)}")
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"toxiproxy_compat exited at start: {_tail(log_path)}")
            received += chunk
    line = received.split(b"\n", 1)[0].decode()
    return line.rsplit(" ", 1)[-1]


def _wait_for_api(
    url: str,
    timeout: float,
    *,
    what: str,
    process: subprocess.Popen[bytes] | None = None,
    log_path: Path | None = None,
) -> None:
    """Poll ``GET /version`` until it answers 200; RuntimeError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error = "no answer yet"
    while True:
        if process is not None and process.poll() is not None:
            detail = _tail(log_path) if log_path else ""
            raise RuntimeError(f"{what} exited with status {process.returncode}: {detail}")
        try:
            # The URL is ours or the user's, and http(s) by _host_port's check.
            with urllib.request.urlopen(f"{url}/version", timeout=1.0) as response:
                if response.status == 200:
                    return
                last_error = f"status {response.status}"
        except (urllib.error.URLError, OSError) as exc:
            last_error = str(exc)
        if time.monotonic() >= deadline:
            detail = f"; log: {_tail(log_path)}" if log_path else ""
            raise RuntimeError(f"{what} did not answer GET {url}/version within {timeout}s ({last_error}){detail}")
        time.sleep(0.05)


def _terminate(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(_STOP_TIMEOUT)
    if process.stdout is not None:
        process.stdout.close()


@contextlib.contextmanager
def _server_log() -> Iterator[tuple[Path, BinaryIO]]:
    """A file for a server's output, quoted in errors and removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="toxiproxy-") as directory:
        path = Path(directory) / "server.log"
        with path.open("wb") as log_file:
            yield path, log_file


def _tail(path: Path, limit: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-limit:].strip() or "(empty log)"
    return "(no log)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
