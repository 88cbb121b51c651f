"""Spans around every acquire, heartbeat and release, on ``opentelemetry-api`` only.

Without an OpenTelemetry SDK the tracer is a no-op and costs next to nothing;
with one, the user's provider decides where spans go. Attributes follow
OpenTelemetry's database conventions (``db.system.name``, ``server.address``,
``server.port``, ``db.namespace``) plus this library's own under
``postgres_mutex.``. Nothing from a DSN but host, port and database name ever
becomes an attribute: never the DSN itself, never a password.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, TracerProvider
from psycopg.conninfo import conninfo_to_dict

from .._version import __version__ as _version

AttributeValue = str | bool | int | float

LOCK_NAME = "postgres_mutex.lock_name"
INSTANCE_ID = "postgres_mutex.instance_id"
OUTCOME = "postgres_mutex.outcome"
MODE = "postgres_mutex.mode"
"""A read/write lock's holder's mode, ``read`` or ``write``: its spans carry the lock's name, not its row's."""
PERMIT = "postgres_mutex.permit"
"""The permit a semaphore's acquire took, on its span."""

# The global providers of opentelemetry-api alone: no SDK configured.
_NO_SDK = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
_UNKNOWN = object()


def database_attributes(conninfo: str | None, table: str) -> dict[str, AttributeValue]:
    """The OpenTelemetry database attributes for a connection string, with PG* fallbacks.

    Only host, port and database name are read; an unparsable string yields
    just the system name.
    """
    attributes: dict[str, AttributeValue] = {"db.system.name": "postgresql", "db.collection.name": table}
    try:
        params = conninfo_to_dict(conninfo or "")
    except Exception:
        return attributes
    host = params.get("host") or os.environ.get("PGHOST")
    port = params.get("port") or os.environ.get("PGPORT")
    dbname = params.get("dbname") or os.environ.get("PGDATABASE")
    if host:
        attributes["server.address"] = str(host)
    if port and str(port).isdigit():
        attributes["server.port"] = int(str(port))
    if dbname:
        attributes["db.namespace"] = str(dbname)
    return attributes


class Tracing:
    """Starts this library's spans with the common attributes already set."""

    def __init__(self, tracer_provider: TracerProvider | None, attributes: Mapping[str, AttributeValue]) -> None:
        self._tracer = trace.get_tracer("postgres_mutex", _version, tracer_provider)
        self._provider = tracer_provider
        self._attributes = dict(attributes)
        # A provider named by OTEL_PYTHON_TRACER_PROVIDER is loaded by this first
        # look; after it, the global one is read without touching the environment.
        trace.get_tracer_provider()

    def silent(self) -> bool:
        """No SDK anywhere: spans would be dropped, so none is made (a lock cycle is a fraction of a ms).

        Checked at each span, since an application may configure its SDK after
        creating its Mutexes: one read of the global provider, which is set once.
        """
        if self._provider is not None:
            return isinstance(self._provider, trace.NoOpTracerProvider)
        provider = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
        if provider is _UNKNOWN:  # an opentelemetry-api that keeps it elsewhere: ask it
            provider = trace.get_tracer_provider()
        return provider is None or isinstance(provider, _NO_SDK)

    def span(
        self,
        name: str,
        attributes: Mapping[str, AttributeValue] | Callable[[], Mapping[str, AttributeValue]],
        *,
        links: Sequence[SpanContext | None] = (),
    ) -> contextlib.AbstractContextManager[Span]:
        """A client span, current for its duration; an exception escaping it is recorded as an error.

        ``attributes`` may be a function that makes them: it is called only for a span that records.
        """
        if self.silent():
            # One shared, reusable block: a silent span costs the check alone, twice per lock cycle.
            return _SILENT
        return self._recorded(name, attributes, links)

    @contextlib.contextmanager
    def _recorded(
        self,
        name: str,
        attributes: Mapping[str, AttributeValue] | Callable[[], Mapping[str, AttributeValue]],
        links: Sequence[SpanContext | None],
    ) -> Iterator[Span]:
        valid = [Link(context) for context in links if context is not None and context.is_valid]
        with self._tracer.start_as_current_span(
            name,
            kind=SpanKind.CLIENT,
            links=valid or None,
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            if span.is_recording():
                made = attributes() if callable(attributes) else attributes
                span.set_attributes({**self._attributes, **made})
            yield span


NO_SPAN: Span = trace.INVALID_SPAN
"""What an operation records on while no span records: nothing."""

NO_SPAN_CONTEXT: SpanContext = NO_SPAN.get_span_context()
"""Its context, which links nothing: a hold acquired while no span records carries it."""

_SILENT: contextlib.nullcontext[Span] = contextlib.nullcontext(NO_SPAN)
"""The span of every operation while no SDK is configured: records nothing, and is never current."""


def set_outcome(span: Span, outcome: str, **attributes: Any) -> None:
    """Record how an operation ended; values that are None are left out."""
    if span is NO_SPAN or not span.is_recording():
        return
    span.set_attribute(OUTCOME, outcome)
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(f"postgres_mutex.{key}", value)


def mark_error(span: Span, description: str) -> None:
    """Mark a span failed without an exception escaping it (for example a lost lock)."""
    if span.is_recording():
        span.set_status(Status(StatusCode.ERROR, description))
