"""memshare: share large NumPy arrays with parallel workers instead of copying them.

Public API: :class:`MemmappingPool` (alias ``MemmapingPool``), the joblib
backend ``"memshare"`` (registered on import), :func:`Parallel` /
:func:`delayed`, the shared-array constructors :func:`empty`, :func:`zeros`,
:func:`full`, :func:`share` and :func:`is_shared`, :func:`broadcast` for objects that
every task reads, and :func:`last_call_stats`.
"""

from ._errors import (
    RemoteTraceback,
    SharedArrayCopiedWarning,
    SharedMemoryFallbackWarning,
    SharedMemoryFullError,
    UnpicklableArgumentError,
    UnpicklableResultError,
    WorkerDiedError,
)
from ._payload._broadcast import Broadcast, broadcast
from ._stats import last_call_stats
from .arrays import empty, full, is_shared, share, zeros
from .backend import MemshareBackend, register_backend
from .parallel import Parallel, delayed
from .pool import MemmapingPool, MemmappingPool

register_backend()

__version__ = "0.1.0"

__all__ = [
    "Broadcast",
    "MemmapingPool",
    "MemmappingPool",
    "MemshareBackend",
    "Parallel",
    "RemoteTraceback",
    "SharedArrayCopiedWarning",
    "SharedMemoryFallbackWarning",
    "SharedMemoryFullError",
    "UnpicklableArgumentError",
    "UnpicklableResultError",
    "WorkerDiedError",
    "__version__",
    "broadcast",
    "delayed",
    "empty",
    "full",
    "is_shared",
    "last_call_stats",
    "register_backend",
    "share",
    "zeros",
]
