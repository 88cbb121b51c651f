"""An election's parts; the public `election` module is its face.

Internal: nothing here is public API; the public names are the package's.
"""
