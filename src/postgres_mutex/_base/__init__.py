"""Building blocks that know nothing of locks: the clock, redaction of secrets, waits and threads for both flavours.

Internal: nothing here is public API; the public names are the package's.
"""
