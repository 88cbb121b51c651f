"""One Toxiproxy server a session, a clean client a test: a pytest plugin (see the root conftest.py).

Shared by the chaos suite and the Toxiproxy conformance tests (toxiproxy_compat/tests/),
which check whichever server `chaos.toxiproxy` picks.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from toxiproxy import Toxiproxy

from chaos.toxiproxy import ToxiproxyEndpoint, toxiproxy_client, toxiproxy_endpoint


@pytest.fixture(scope="session")
def toxiproxy_server_endpoint() -> Iterator[ToxiproxyEndpoint]:
    """The session's Toxiproxy server, with the kind that was picked (see chaos.toxiproxy)."""
    with toxiproxy_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def toxiproxy_url(toxiproxy_server_endpoint: ToxiproxyEndpoint) -> str:
    """The API base URL of the session's Toxiproxy server, e.g. http://127.0.0.1:8474."""
    return toxiproxy_server_endpoint.url


@pytest.fixture
def toxiproxy(toxiproxy_url: str) -> Iterator[Toxiproxy]:
    """A toxiproxy-python client for the session's server; every proxy is deleted afterwards.

    Repointed for each test because the client's address is process-wide state.
    """
    client = toxiproxy_client(toxiproxy_url)
    yield client
    # Repoint again: the test may have pointed the client elsewhere.
    toxiproxy_client(toxiproxy_url).destroy_all()
