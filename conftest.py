"""Shared by every suite (tests/, chaos/, toxiproxy_compat/tests/): the plugins below hold the fixtures.

tests/support/fixtures.py: PostgreSQL, Mutexes, worker processes; tests/support/figures.py: the
measured figures the docs include; chaos/toxiproxy_fixtures.py: a Toxiproxy server and client.
"""

pytest_plugins = ["tests.support.fixtures", "tests.support.figures", "chaos.toxiproxy_fixtures"]
