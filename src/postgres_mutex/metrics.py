"""The hooks' interfaces: 0.1.0's home of `MetricsHook`, kept so that its programs import unchanged.

`ExtendedMetricsHook` (the optional calls) is here beside it; ``postgres_mutex`` names the same.
"""

from ._observe.hooks import ExtendedMetricsHook, MetricsHook, NullMetrics

__all__ = ["ExtendedMetricsHook", "MetricsHook", "NullMetrics"]
