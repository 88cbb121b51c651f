"""Tests that need no server: pure logic, parsers, generators, the architecture, the rules (see conftest.py)."""
