"""0.1.0's home of the metrics hook, kept so that programs written for it import unchanged.

New code imports these from ``postgres_mutex``.
"""

from ._observe.hooks import MetricsHook, NullMetrics

__all__ = ["MetricsHook", "NullMetrics"]
