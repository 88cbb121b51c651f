"""Chaos tests: network faults between each Mutex and PostgreSQL, injected through Toxiproxy.

`chaos.toxiproxy` finds or starts a Toxiproxy server; `chaos.toxiproxy_compat` is the
project's standard-library stand-in, used when no real Toxiproxy is at hand.
"""
