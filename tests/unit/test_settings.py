"""The public constructors' keywords and the one settings object they are checked into cannot drift apart.

The API reference and IDEs read a constructor's signature; the library reads
`Settings`. A keyword added, renamed or given another default in one place
only would be silently dropped or mis-defaulted: these tests say where.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from postgres_mutex import Election, Mutex, RWLock, Semaphore
from postgres_mutex._state.settings import KEYWORDS, Settings

DSN = "host=127.0.0.1 dbname=app"

CONNECTION = {"pool", "async_pool", "client"}
"""How a primitive reaches PostgreSQL: the client's business, not a setting."""

OWN: dict[type, set[str]] = {
    Mutex: {"fair"},
    Semaphore: {"permits", "fair"},
    RWLock: {"fair"},
    Election: {"grace_period", "failure_backoff", "max_failure_backoff"},
}
"""What a constructor takes besides the settings and the connection."""

SET_BY_ITSELF: dict[type, set[str]] = {
    Election: {"on_lost", "watch", "hold_at_least"},
    Semaphore: {"hold_at_least"},
    RWLock: {"hold_at_least"},
}
"""Settings a constructor does not offer: it sets them itself (an election's on_lost ends its term), or they
are a Mutex's alone (a minimum hold: a permit's and a read/write lock's holds end when released)."""


def _settings_fields() -> dict[str, tuple[object, str]]:
    return {field.name: (field.default, str(field.type)) for field in dataclasses.fields(Settings) if field.init}


@pytest.mark.parametrize("constructor", list(OWN), ids=lambda kind: kind.__name__)
def test_each_constructor_lists_exactly_the_settings_with_their_defaults_and_types(constructor: type) -> None:
    parameters = inspect.signature(constructor).parameters.values()
    keywords = {
        parameter.name: (parameter.default, str(parameter.annotation))
        for parameter in parameters
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.name not in CONNECTION | OWN[constructor]
    }
    expected = {
        name: described
        for name, described in _settings_fields().items()
        if name not in SET_BY_ITSELF.get(constructor, set())
    }
    assert keywords == expected


def test_the_keywords_are_the_settings_fields_in_the_order_the_constructors_list_them() -> None:
    # Mutex's order is the API reference's.
    listed = tuple(name for name in inspect.signature(Mutex).parameters if name in KEYWORDS)
    assert listed == KEYWORDS


def test_a_constructor_forwards_every_keyword_it_was_given() -> None:
    # A keyword the constructor listed but did not forward would fall back to its default unseen.
    given: dict[str, Any] = {
        "instance_id": "worker-7",
        "table": "app.locks",
        "heartbeat_interval": 2.0,
        "alert_threshold": 9.0,
        "stale_threshold": 40.0,
        "poll_interval": 0.25,
        "operation_timeout": 1.5,
        "reclaim_disconnected_after": 20.0,
    }
    assert set(given) | {"metrics", "on_lost", "watch", "tracer_provider", "hold_at_least"} == set(KEYWORDS)
    mutex = Mutex(DSN, "job", **given, hold_at_least=30.0)
    semaphore = Semaphore(DSN, "api", permits=2, **given)
    election = Election(DSN, "leader", **given)
    try:
        for config in (mutex.config, semaphore.config):
            assert {name: getattr(config, name) for name in given} == given
        assert mutex.config.hold_at_least == 30.0
        assert election.instance_id == "worker-7"
    finally:
        mutex.close()
        semaphore.close()
        election.close()


def test_an_empty_instance_id_means_the_default_one() -> None:
    # As in 0.1.0: an unset environment variable passed through means "choose one".
    assert Settings(instance_id="").instance_id is None
