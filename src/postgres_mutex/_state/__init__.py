"""The lock states and their rules, with no I/O: settings, decisions, what a lock's life tells the hooks, the flows.

Internal: nothing here is public API; the public names are the package's.
"""
