"""0.1.0's home of the errors, kept so that programs written for it import unchanged.

New code imports them from ``postgres_mutex`` (or `postgres_mutex.errors`).
"""

from .errors import LockAcquisitionTimeout, LockNotHeldError, PgMutexError

__all__ = ["LockAcquisitionTimeout", "LockNotHeldError", "PgMutexError"]
