"""Chaos tests: network faults between each Mutex and PostgreSQL, injected through Toxiproxy.

`chaos.toxiproxy` finds or starts a Toxiproxy server; the package `toxiproxy_compat` (at the
repository root) is the project's standard-library stand-in, used when no real Toxiproxy is at hand.
"""
