"""The metrics hook: every README call arrives, any subset works, a broken hook breaks nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg

from postgres_mutex import MetricsHook, Mutex
from tests.support.fixtures import RecordingMetrics, frozen_holder, wait_until


def test_the_readme_calls_arrive_with_their_arguments(
    make_mutex: Callable[..., Mutex], metrics: RecordingMetrics, lock_name: str, admin: psycopg.Connection[Any]
) -> None:
    holder, contender = make_mutex(), make_mutex(metrics=metrics)
    with contender.acquire():
        wait_until(lambda: len(metrics.named("heartbeat_latency")) >= 1)
    with frozen_holder(holder):  # goes silent: alert, then reclaim
        with contender.acquire() as acquired:
            assert not acquired
        with contender.acquire(blocking=True, timeout=10):
            pass
    names = {name for name, _, _ in metrics.calls}
    assert {"acquired", "released", "contended", "alert", "stale_reclaimed", "heartbeat_latency"} <= names
    assert all(name == lock_name for _, name, _ in metrics.calls)
    first = metrics.named("acquired")[0]
    assert first == {"instance_id": contender.instance_id, "token": first["token"]}
    assert isinstance(first["token"], int), "the hold's fencing token, to hooks that take it"
    assert metrics.named("released")[0] == {"instance_id": contender.instance_id}
    assert metrics.named("contended")[0] == {"instance_id": contender.instance_id}
    alert = metrics.named("alert")[0]
    assert alert["holder"] == holder.instance_id
    assert alert["seconds_since_heartbeat"] >= 0.6
    (reclaimed,) = metrics.named("stale_reclaimed")
    assert reclaimed == {
        "instance_id": contender.instance_id,
        "previous_holder": holder.instance_id,
        "token": reclaimed["token"],
        "reason": "stale",
    }
    assert reclaimed["token"] > first["token"]


class Exploding:
    """Every method raises: the lock must not notice."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        def explode(*args: object, **kwargs: object) -> None:
            raise RuntimeError(f"metrics backend down ({name})")

        return explode


def test_a_broken_hook_never_breaks_the_lock(make_mutex: Callable[..., Mutex]) -> None:
    holder, contender = make_mutex(metrics=Exploding()), make_mutex(metrics=Exploding())
    with holder.acquire() as acquired:
        assert acquired
        holder.heartbeat()
        with contender.acquire() as second:
            assert not second
    with frozen_holder(holder), contender.acquire(blocking=True, timeout=10) as reclaimed:
        assert reclaimed
    assert not holder.held


def test_a_partial_hook_and_a_subclass_both_work(make_mutex: Callable[..., Mutex]) -> None:
    seen: list[str] = []
    event = threading.Event()

    class OnlyAcquired:
        def acquired(self, lock_name: str, *, instance_id: str) -> None:
            seen.append("acquired")

    class Latency(MetricsHook):
        def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
            event.set()

    with make_mutex(metrics=OnlyAcquired()).acquire():
        pass
    with make_mutex(metrics=Latency()).acquire():
        assert event.wait(5)
    assert seen == ["acquired"]
