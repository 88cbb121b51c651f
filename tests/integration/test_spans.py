"""Spans around every acquire, heartbeat and release, read back with the SDK's in-memory exporter."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from postgres_mutex import LockAcquisitionTimeout, LockNotHeldError, Mutex, RWLock, SchemaError, Semaphore
from tests.support.fixtures import FAST, frozen_holder, wait_until
from tests.support.postgres_server import PostgresServer


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.clear()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


def spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def attr(span: ReadableSpan, key: str) -> object:
    assert span.attributes is not None
    return span.attributes.get(key)


def test_acquire_heartbeat_and_release_spans_carry_lock_and_database_attributes(
    make_mutex: Callable[..., Mutex], provider: TracerProvider, exporter: InMemorySpanExporter, pg: PostgresServer
) -> None:
    mutex = make_mutex(tracer_provider=provider)
    caller = provider.get_tracer("the-job")
    with caller.start_as_current_span("nightly-report") as parent, mutex.acquire():
        mutex.heartbeat()
    (acquire,) = spans(exporter, "postgres_mutex.acquire")
    (release,) = spans(exporter, "postgres_mutex.release")
    heartbeats = spans(exporter, "postgres_mutex.heartbeat")
    assert heartbeats
    for span in (acquire, release, *heartbeats):
        assert span.kind is SpanKind.CLIENT
        assert attr(span, "postgres_mutex.lock_name") == mutex.lock_name
        assert attr(span, "postgres_mutex.instance_id") == mutex.instance_id
        assert attr(span, "db.system.name") == "postgresql"
        assert attr(span, "server.address") == pg.host
        assert attr(span, "server.port") == pg.port
        assert attr(span, "db.namespace") == pg.dbname
        assert attr(span, "db.collection.name") == "mutex_lock"
    parent_id = parent.get_span_context().span_id
    assert acquire.parent is not None
    assert acquire.parent.span_id == parent_id, "the acquire nests under the caller's span"
    assert release.parent is not None
    assert release.parent.span_id == parent_id
    assert attr(acquire, "postgres_mutex.outcome") == "acquired"
    assert attr(acquire, "postgres_mutex.attempts") == 1
    assert attr(acquire, "postgres_mutex.blocking") is False
    assert [event.name for event in acquire.events] == ["postgres_mutex.attempt"]
    assert attr(release, "postgres_mutex.outcome") == "released"
    manual = [span for span in heartbeats if span.parent is not None and span.parent.span_id == parent_id]
    assert manual, "a manual heartbeat nests under the caller"
    assert attr(manual[0], "postgres_mutex.outcome") == "renewed"
    assert manual[0].links[0].context.span_id == acquire.context.span_id, "heartbeats link to their hold's acquire"


def test_a_semaphores_and_a_read_write_locks_spans_name_them_with_the_permit_and_the_mode(
    dsn: str, lock_name: str, provider: TracerProvider, exporter: InMemorySpanExporter, schema: None
) -> None:
    semaphore = Semaphore(dsn, lock_name, permits=2, tracer_provider=provider, **FAST)  # type: ignore[arg-type]
    rwlock = RWLock(dsn, f"{lock_name}-rw", tracer_provider=provider, **FAST)  # type: ignore[arg-type]
    try:
        with semaphore.acquire():
            permit = semaphore.permit
        with rwlock.read():
            pass
        with rwlock.write():
            pass
    finally:
        semaphore.close()
        rwlock.close()
    taken, read, written = spans(exporter, "postgres_mutex.acquire")
    assert (attr(taken, "postgres_mutex.lock_name"), attr(taken, "postgres_mutex.permit")) == (lock_name, permit)
    assert attr(taken, "postgres_mutex.mode") is None
    for span, mode in ((read, "read"), (written, "write")):
        assert attr(span, "postgres_mutex.lock_name") == f"{lock_name}-rw", "the lock's name, not its row's"
        assert attr(span, "postgres_mutex.mode") == mode
    released = spans(exporter, "postgres_mutex.release")
    assert [attr(span, "postgres_mutex.mode") for span in released] == [None, "read", "write"]


def test_a_blocking_acquire_shows_every_attempt_and_its_wait(
    make_mutex: Callable[..., Mutex], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    holder, waiter = make_mutex(), make_mutex(tracer_provider=provider, poll_interval=0.05)
    with holder.acquire(), pytest.raises(LockAcquisitionTimeout), waiter.acquire(blocking=True, timeout=0.3):
        pass
    (span,) = spans(exporter, "postgres_mutex.acquire")
    assert attr(span, "postgres_mutex.outcome") == "timeout"
    assert attr(span, "postgres_mutex.holder") == holder.instance_id
    assert attr(span, "postgres_mutex.timeout") == 0.3
    attempts = attr(span, "postgres_mutex.attempts")
    assert isinstance(attempts, int)
    assert attempts >= 2
    outcomes = [
        e.attributes["postgres_mutex.outcome"]
        for e in span.events
        if e.name == "postgres_mutex.attempt" and e.attributes
    ]
    assert len(outcomes) == attempts
    assert set(outcomes) == {"contended"}
    wait = attr(span, "postgres_mutex.wait_seconds")
    assert isinstance(wait, float)
    assert wait >= 0.3
    assert span.status.status_code is StatusCode.ERROR
    assert any(event.name == "exception" for event in span.events), "the timeout is recorded"


def test_a_reclaim_names_the_previous_holder(
    make_mutex: Callable[..., Mutex], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    holder, waiter = make_mutex(), make_mutex(tracer_provider=provider)
    with frozen_holder(holder), waiter.acquire(blocking=True, timeout=10):
        pass
    (span,) = spans(exporter, "postgres_mutex.acquire")
    assert attr(span, "postgres_mutex.outcome") == "reclaimed"
    assert attr(span, "postgres_mutex.previous_holder") == holder.instance_id


def test_errors_are_recorded_with_status(
    make_mutex: Callable[..., Mutex], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    mutex = make_mutex(table="no_such_table", tracer_provider=provider)
    with pytest.raises(SchemaError), mutex.acquire():
        pass
    (span,) = spans(exporter, "postgres_mutex.acquire")
    assert span.status.status_code is StatusCode.ERROR
    assert attr(span, "postgres_mutex.outcome") == "error"
    (event,) = [e for e in span.events if e.name == "exception"]
    assert event.attributes is not None
    assert str(event.attributes["exception.type"]).endswith("SchemaError")


def test_a_lost_lock_shows_on_the_heartbeat_span(
    make_mutex: Callable[..., Mutex],
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    admin: psycopg.Connection[Any],
) -> None:
    mutex = make_mutex(tracer_provider=provider)
    with pytest.raises(LockNotHeldError), mutex.acquire():
        admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (mutex.lock_name,))
        wait_until(lambda: not mutex.held)

    def lost_beats() -> list[Any]:
        beats = spans(exporter, "postgres_mutex.heartbeat")
        return [s for s in beats if attr(s, "postgres_mutex.outcome") == "lost"]

    # The heartbeat marks the hold lost, then ends its span: wait for the span, not the flag.
    wait_until(lambda: len(lost_beats()) >= 1)
    lost = lost_beats()
    assert len(lost) == 1
    assert lost[0].status.status_code is StatusCode.ERROR


async def test_async_spans_nest_under_the_callers_span(
    amake_mutex: Callable[..., Mutex], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    mutex = amake_mutex(tracer_provider=provider)
    caller = provider.get_tracer("the-job")
    with caller.start_as_current_span("async-job") as parent:
        async with mutex.acquire_async():
            await mutex.heartbeat_async()
    parent_id = parent.get_span_context().span_id
    for name in ("postgres_mutex.acquire", "postgres_mutex.release"):
        (span,) = spans(exporter, name)
        assert span.parent is not None
        assert span.parent.span_id == parent_id


def test_no_span_attribute_holds_the_password(
    provider: TracerProvider, exporter: InMemorySpanExporter, lock_name: str
) -> None:
    from tests.support.postgres_server import free_port

    secret = "Sp4n-s3cret"
    mutex = Mutex(f"postgresql://app:{secret}@127.0.0.1:{free_port()}/db", lock_name, tracer_provider=provider)
    with pytest.raises(Exception, match="could not connect"), mutex.acquire():
        pass
    finished = exporter.get_finished_spans()
    assert finished
    for span in finished:
        text = repr(span.attributes) + repr([(e.name, e.attributes) for e in span.events]) + repr(span.status)
        assert secret not in text
