"""The toxics: how each one acts on the data of one direction of one connection.

A `Toxic` is what the API shows; each link it applies to runs a `Stage` for it, the
chain of stages of one direction in the order the toxics were added (see `proxies`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, Final, NoReturn, Protocol

from .common import STREAMS, ApiError, LinkEnded, loop_time

# Toxicity and jitter are chances, not secrets.
_random = random.Random()

Emit = Callable[[bytes, float], Awaitable[None]]


class LinkControl(Protocol):
    """What a stage may do to the link it works on (a `proxies.Link`)."""

    def spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]: ...

    def end(self, *, rst: bool = False) -> None: ...


@dataclass
class Toxic:
    """A toxic as the API shows it; each link it applies to runs a Stage for it."""

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


class Stage:
    """One toxic at work on one link (Toxiproxy's ToxicStub).

    Subclasses act on data (``on_data``, which hands what passes to ``emit``) and on the
    end of the stream (``on_eof``, which returns to let it pass). A stage is detached when
    its toxic is removed or updated or its link ends: waits end at once and what the stage
    holds goes on, as an interrupted Toxiproxy toxic hands on its data.
    """

    ATTRIBUTES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, toxic: Toxic, link: LinkControl) -> None:
        self.toxic = toxic
        self.link = link
        self.active = _random.random() < toxic.toxicity
        self.detached = asyncio.Event()

    @classmethod
    def validate(cls, attributes: dict[str, int]) -> None:
        """Raise a 400 ApiError if the attributes make no sense together."""

    @property
    def attrs(self) -> dict[str, int]:
        return self.toxic.attributes

    @property
    def applies(self) -> bool:
        return self.active and not self.detached.is_set()

    def start(self) -> None:
        """Called once the stage is in its link's chain."""

    def inherit(self, old: Stage) -> None:
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
        delay = due - loop_time()
        if delay <= 0:
            return True
        try:
            async with asyncio.timeout(delay):
                await self.detached.wait()
        except TimeoutError:
            return True
        return False


class _Latency(Stage):
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
            await emit(data, loop_time())


class _Timeout(Stage):
    ATTRIBUTES = ("timeout",)

    def __init__(self, toxic: Toxic, link: LinkControl) -> None:
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


class _ResetPeer(Stage):
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
        raise LinkEnded


class _Bandwidth(Stage):
    ATTRIBUTES = ("rate",)

    def __init__(self, toxic: Toxic, link: LinkControl) -> None:
        super().__init__(toxic, link)
        self._next_send = 0.0

    def inherit(self, old: Stage) -> None:
        if isinstance(old, _Bandwidth):
            self._next_send = old._next_send

    async def on_data(self, data: bytes, ts: float, emit: Emit) -> None:
        rate = self.attrs["rate"]
        if rate <= 0:
            # Toxiproxy's rate 0 sends empty slices forever: nothing passes until removal.
            await self.detached.wait()
            await emit(data, loop_time())
            return
        per_second = rate * 1000
        step = rate * 100  # A tenth of a second's worth, Toxiproxy's slice for big chunks.
        offset = 0
        while offset < len(data):
            piece = data[offset : offset + step]
            # An idle link earns no credit: pacing restarts from now.
            due = max(loop_time(), self._next_send) + len(piece) / per_second
            if not await self._sleep_until(due):
                await emit(data[offset:], loop_time())
                return
            self._next_send = due
            offset += len(piece)
            await emit(piece, due)


class _LimitData(Stage):
    ATTRIBUTES = ("bytes",)

    def __init__(self, toxic: Toxic, link: LinkControl) -> None:
        super().__init__(toxic, link)
        self._passed = 0

    def inherit(self, old: Stage) -> None:
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
            raise LinkEnded


class _SlowClose(Stage):
    ATTRIBUTES = ("delay",)

    async def on_eof(self) -> None:
        await self._sleep_until(loop_time() + self.attrs["delay"] / 1000)


class _Slicer(Stage):
    ATTRIBUTES = ("average_size", "size_variation", "delay")

    @classmethod
    def validate(cls, attributes: dict[str, int]) -> None:
        if attributes["average_size"] < 1:
            raise ApiError(400, "bad request body: slicer average_size must be at least 1")
        if attributes["size_variation"] >= attributes["average_size"]:
            raise ApiError(400, "bad request body: slicer size_variation must be smaller than average_size")

    async def on_data(self, data: bytes, ts: float, emit: Emit) -> None:
        average, variation, delay_us = (self.attrs[key] for key in self.ATTRIBUTES)
        offset = 0
        while offset < len(data):
            # variation < average, so every slice has at least one byte.
            size = average + _random.randint(-variation, variation)
            piece = data[offset : offset + size]
            offset += len(piece)
            await emit(piece, ts)
            if offset < len(data) and delay_us > 0 and not await self._sleep_until(loop_time() + delay_us / 1e6):
                await emit(data[offset:], ts)
                return


STAGES: Final[dict[str, type[Stage]]] = {
    "latency": _Latency,
    "timeout": _Timeout,
    "reset_peer": _ResetPeer,
    "bandwidth": _Bandwidth,
    "limit_data": _LimitData,
    "slow_close": _SlowClose,
    "slicer": _Slicer,
}


def parse_toxicity(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ApiError(400, "bad request body: toxicity must be a number from 0 to 1")
    return float(value)


def parse_attributes(kind: str, value: object) -> dict[str, int]:
    """The attributes given, checked against what the toxic type knows; 400 otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, "bad request body: attributes must be a JSON object")
    known = STAGES[kind].ATTRIBUTES
    parsed: dict[str, int] = {}
    for key, number in value.items():
        if key not in known:
            raise ApiError(400, f"bad request body: {kind} has no attribute {key!r} (it has {', '.join(known)})")
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ApiError(400, f"bad request body: attribute {key} must be a non-negative integer")
        parsed[key] = number
    return parsed


def parse_toxic(body: object) -> Toxic:
    if not isinstance(body, dict):
        raise ApiError(400, "bad request body: expected a JSON object")
    stream = body.get("stream")
    stream = "downstream" if stream is None else stream
    if stream not in STREAMS:
        raise ApiError(400, "stream was invalid, can be either upstream or downstream")
    kind = body.get("type")
    if not isinstance(kind, str) or kind not in STAGES:
        raise ApiError(400, "invalid toxic type")
    name = body.get("name") or f"{kind}_{stream}"
    if not isinstance(name, str):
        raise ApiError(400, "bad request body: name must be a string")
    toxicity = parse_toxicity(1.0 if body.get("toxicity") is None else body["toxicity"])
    attributes = dict.fromkeys(STAGES[kind].ATTRIBUTES, 0)
    attributes.update(parse_attributes(kind, body.get("attributes")))
    STAGES[kind].validate(attributes)
    return Toxic(name=name, type=kind, stream=stream, toxicity=toxicity, attributes=attributes)
