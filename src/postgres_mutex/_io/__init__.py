"""Connections and the engine that talks to the server; each ``*_async`` module beside its generated twin.

Internal: nothing here is public API; the public names are the package's.
"""
