"""`LockTable`'s methods, each flavour's, and what both share; the public `table` module is their face.

Internal: nothing here is public API; the public names are the package's.
"""
