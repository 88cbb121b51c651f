"""0.1.0's home of `Mutex`, kept so that programs written for it import unchanged.

New code imports it from ``postgres_mutex``.
"""

from ._kinds.mutex import Mutex
from ._observe.hooks import MetricsHook

__all__ = ["MetricsHook", "Mutex"]
