"""postgres-mutex: a distributed mutex on the PostgreSQL you already run.

One table, heartbeat-based liveness, an alert before any reclaim, automatic
recovery from crashed holders. See the README for the full contract.
"""

from ._metrics import MetricsHook
from ._mutex import Mutex
from .errors import (
    DatabaseError,
    LockAcquisitionTimeout,
    LockAlreadyHeldError,
    LockNotHeldError,
    MutexError,
    OperationTimeout,
    SchemaError,
)

__version__ = "0.1.0"

__all__ = [
    "DatabaseError",
    "LockAcquisitionTimeout",
    "LockAlreadyHeldError",
    "LockNotHeldError",
    "MetricsHook",
    "Mutex",
    "MutexError",
    "OperationTimeout",
    "SchemaError",
    "__version__",
]
