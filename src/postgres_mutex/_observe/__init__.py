"""What the library tells: the metrics hooks' interface, tracing, what both exporters share.

Internal: nothing here is public API; the public names are the package's.
"""
