"""Shared by both suites (tests/ and chaos/): the fixtures live in tests/fixtures.py."""

pytest_plugins = ["tests.fixtures", "tests.figures"]
