"""Running the server: on a thread of this process (`ToxiproxyServer`), or in the foreground (`main`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from .api import Core


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
        core = Core()
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
    core = Core()
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
        prog="python -m toxiproxy_compat",
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
