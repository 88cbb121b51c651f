"""Shared by both suites (tests/ and chaos/): the fixtures live in tests/support/fixtures.py."""

pytest_plugins = ["tests.support.fixtures", "tests.support.figures"]
