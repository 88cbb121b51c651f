"""postgres-mutex: a distributed mutex on the PostgreSQL you already run.

One table, heartbeat-based liveness, an alert before any reclaim, automatic
recovery from crashed holders, fencing tokens, and leader election on top. See the README for the full
contract.
"""

from ._io.acquisition import Acquisition
from ._io.acquisition_async import AsyncAcquisition
from ._kinds.mutex import Mutex
from ._kinds.rwlock import RWLock
from ._kinds.semaphore import Semaphore
from ._observe.hooks import ExtendedMetricsHook, FanOutMetrics, LockObservation, MetricsHook, NullMetrics
from ._version import __version__
from .client import MutexClient
from .election import Election, Leader, Leadership
from .errors import (
    DatabaseError,
    LockAcquisitionTimeout,
    LockAlreadyHeldError,
    LockNotHeldError,
    MutexError,
    OperationTimeout,
    PermitsMismatchError,
    PgMutexError,
    SchemaError,
)
from .shutdown import exit_on_sigterm
from .table import ForcedRelease, HoldRecord, LockTable

__all__ = [
    "Acquisition",
    "AsyncAcquisition",
    "DatabaseError",
    "Election",
    "ExtendedMetricsHook",
    "FanOutMetrics",
    "ForcedRelease",
    "HoldRecord",
    "Leader",
    "Leadership",
    "LockAcquisitionTimeout",
    "LockAlreadyHeldError",
    "LockNotHeldError",
    "LockObservation",
    "LockTable",
    "MetricsHook",
    "Mutex",
    "MutexClient",
    "MutexError",
    "NullMetrics",
    "OperationTimeout",
    "PermitsMismatchError",
    "PgMutexError",
    "RWLock",
    "SchemaError",
    "Semaphore",
    "__version__",
    "exit_on_sigterm",
]
