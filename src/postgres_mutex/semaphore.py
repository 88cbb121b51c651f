"""`Semaphore`'s own module: the class `postgres_mutex.Semaphore` names, importable by itself.

The command line imports it from here, as it imports `Mutex` from `mutex` and
`Election` from `election`: a program that needs one lock kind loads that one.
"""

from ._kinds.semaphore import Semaphore

__all__ = ["Semaphore"]
