"""memshare: share large NumPy arrays with parallel workers instead of copying them.

Public API: :class:`MemmappingPool` (alias ``MemmapingPool``), the joblib
backend ``"memshare"`` (registered on import), :func:`Parallel` /
:func:`delayed`, the shared-array constructors :func:`empty`, :func:`zeros`,
:func:`full`, :func:`share` and :func:`is_shared`, and
:func:`last_call_stats`.
"""

from ._folders import SharedMemoryFallbackWarning, SharedMemoryFullError
from ._stats import last_call_stats
from ._worker import RemoteTraceback, UnpicklableResultError
from .pool import MemmapingPool, MemmappingPool, WorkerDiedError

__version__ = "0.1.0"

__all__ = [
    "MemmapingPool",
    "MemmappingPool",
    "RemoteTraceback",
    "SharedMemoryFallbackWarning",
    "SharedMemoryFullError",
    "UnpicklableResultError",
    "WorkerDiedError",
    "__version__",
    "last_call_stats",
]
