"""0.1.0's home of `Mutex`, kept so that programs written for it import unchanged.

New code imports it from ``postgres_mutex``.
"""

from ._metrics import MetricsHook
from ._mutex import Mutex

__all__ = ["MetricsHook", "Mutex"]
