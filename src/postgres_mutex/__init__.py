"""postgres-mutex: a distributed mutex on the PostgreSQL you already run.

One table, heartbeat-based liveness, an alert before any reclaim, automatic
recovery from crashed holders. See the README for the full contract.
"""

from ._metrics import FanOutMetrics, LockObservation, MetricsHook
from ._mutex import Mutex
from ._version import __version__
from .errors import (
    DatabaseError,
    LockAcquisitionTimeout,
    LockAlreadyHeldError,
    LockNotHeldError,
    MutexError,
    OperationTimeout,
    SchemaError,
)

__all__ = [
    "DatabaseError",
    "FanOutMetrics",
    "LockAcquisitionTimeout",
    "LockAlreadyHeldError",
    "LockNotHeldError",
    "LockObservation",
    "MetricsHook",
    "Mutex",
    "MutexError",
    "OperationTimeout",
    "SchemaError",
    "__version__",
]
