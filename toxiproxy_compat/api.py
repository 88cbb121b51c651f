"""The HTTP API and the state it drives: Toxiproxy 2.x's endpoints, one request per connection."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import unquote, urlsplit

from .common import CLOSE_GRACE, ApiError, bind, format_address, split_address
from .proxies import Proxy, parse_proxy
from .toxics import STAGES, Toxic, parse_attributes, parse_toxic, parse_toxicity

VERSION: Final = "toxiproxy_compat 1.0 (Toxiproxy 2.x API)"

_HTTP_TIMEOUT: Final = 30.0
_MAX_BODY: Final = 1 << 20
_MAX_HEADERS: Final = 100


def _json_body(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"bad request body: {exc}") from exc


def _allow(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise ApiError(405, f"method {method} not allowed here (use {', '.join(allowed)})")


class Core:
    """The server's state and HTTP API; used on its event loop only."""

    def __init__(self) -> None:
        self.proxies: dict[str, Proxy] = {}
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
        sock = bind(host, port)
        try:
            self._api = await asyncio.start_server(self._serve_http, sock=sock, backlog=128)
        except OSError:
            sock.close()
            raise
        return f"http://{format_address(sock.getsockname())}"

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
            await asyncio.wait(tasks, timeout=CLOSE_GRACE)

    # HTTP ---------------------------------------------------------------------------

    async def _serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.track(task)
        try:
            async with asyncio.timeout(_HTTP_TIMEOUT):
                try:
                    status, payload = await self._exchange(reader)
                except ApiError as exc:
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
            raise ApiError(400, "malformed request line")
        method, target = parts[0].upper(), parts[1]
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADERS):
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            key, colon, value = line.decode("latin-1").partition(":")
            if not colon:
                raise ApiError(400, "malformed header")
            headers[key.strip().lower()] = value.strip()
        else:
            raise ApiError(431, "too many headers")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise ApiError(411, "send the body with a Content-Length")
        length_text = headers.get("content-length", "0")
        if not (length_text.isascii() and length_text.isdigit()):
            raise ApiError(400, "malformed Content-Length")
        if int(length_text) > _MAX_BODY:
            raise ApiError(413, "request body too large")
        body = await reader.readexactly(int(length_text))
        # As Toxiproxy does: a web page must not be able to drive the proxies.
        if headers.get("user-agent", "").startswith("Mozilla/"):
            raise ApiError(403, "User agent not allowed")
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
                toxic = parse_toxic(_json_body(body))
                if proxy.find_toxic(toxic.name) is not None:
                    raise ApiError(409, "toxic already exists")
                proxy.add_toxic(toxic)
                return 200, toxic.to_json()
            case ["proxies", name, "toxics", toxic_name]:
                _allow(method, "GET", "POST", "PATCH", "DELETE")
                proxy = self._proxy(name)
                found = proxy.find_toxic(toxic_name)
                if found is None:
                    raise ApiError(404, "toxic not found")
                if method == "GET":
                    return 200, found.to_json()
                if method == "DELETE":
                    proxy.remove_toxic(found)
                    return 204, None
                self._update_toxic(found, _json_body(body))
                proxy.update_toxic(found)
                return 200, found.to_json()
            case _:
                raise ApiError(404, "not found")

    def _proxy(self, name: str) -> Proxy:
        proxy = self.proxies.get(name)
        if proxy is None:
            raise ApiError(404, "proxy not found")
        return proxy

    async def _create(self, body: object) -> tuple[int, object]:
        spec = parse_proxy(body)
        if spec.name in self.proxies:
            raise ApiError(409, "proxy already exists")
        proxy = Proxy(self, spec)
        if spec.enabled:
            await proxy.start()  # On failure the proxy is not kept, as in Toxiproxy.
        self.proxies[spec.name] = proxy
        return 201, proxy.to_json()

    async def _update(self, proxy: Proxy, body: object) -> tuple[int, object]:
        if not isinstance(body, dict):
            raise ApiError(400, "bad request body: expected a JSON object")
        listen = body.get("listen") or proxy.listen
        upstream = body.get("upstream") or proxy.upstream
        split_address(listen, "listen", allow_port_zero=True)
        split_address(upstream, "upstream", allow_port_zero=False)
        enabled = body.get("enabled")
        enabled = proxy.enabled if enabled is None else enabled
        if not isinstance(enabled, bool):
            raise ApiError(400, "bad request body: enabled must be true or false")
        # Both checked by split_address; the asserts tell the type checker.
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
    def _update_toxic(toxic: Toxic, body: object) -> None:
        if not isinstance(body, dict):
            raise ApiError(400, "bad request body: expected a JSON object")
        attributes = dict(toxic.attributes)
        attributes.update(parse_attributes(toxic.type, body.get("attributes")))
        STAGES[toxic.type].validate(attributes)
        toxicity = body.get("toxicity")
        toxic.toxicity = toxic.toxicity if toxicity is None else parse_toxicity(toxicity)
        toxic.attributes = attributes

    async def _populate(self, body: object) -> tuple[int, object]:
        if not isinstance(body, list):
            raise ApiError(400, "bad request body: expected a JSON list of proxies")
        # Check the whole list before changing anything, as Toxiproxy does.
        specs = [parse_proxy(item, f" at proxy {index + 1}") for index, item in enumerate(body)]
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ApiError(400, "bad request body: duplicate proxy names")
        done: list[Proxy] = []
        try:
            for spec in specs:
                existing = self.proxies.get(spec.name)
                if existing is not None and (existing.listen, existing.upstream) == (spec.listen, spec.upstream):
                    done.append(existing)
                    continue
                if existing is not None:
                    existing.stop()
                    del self.proxies[spec.name]
                proxy = Proxy(self, spec)
                if spec.enabled:
                    await proxy.start()
                self.proxies[spec.name] = proxy
                done.append(proxy)
        except ApiError as exc:
            return exc.status, {**exc.to_json(), "proxies": [proxy.to_json() for proxy in done]}
        return 201, {"proxies": [proxy.to_json() for proxy in done]}

    async def _reset(self) -> None:
        for proxy in self.proxies.values():
            await proxy.start()
            for toxic in list(proxy.toxics):
                proxy.remove_toxic(toxic)


class _ClientGone(Exception):
    """The HTTP client closed the connection without sending a request."""
