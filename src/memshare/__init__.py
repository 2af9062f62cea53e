"""memshare: share large NumPy arrays with parallel workers instead of copying them.

Public API: :class:`MemmappingPool` (alias ``MemmapingPool``), the joblib
backend ``"memshare"`` (registered on import), :func:`Parallel` /
:func:`delayed`, the shared-array constructors :func:`empty`, :func:`zeros`,
:func:`full`, :func:`share` and :func:`is_shared`, :func:`broadcast` for objects that
every task reads, and :func:`last_call_stats`.
"""

from typing import Any

from ._errors import (
    RemoteTraceback,
    SharedArrayCopiedWarning,
    SharedMemoryFallbackWarning,
    SharedMemoryFullError,
    UnpicklableArgumentError,
    UnpicklableResultError,
)
from ._payload._broadcast import Broadcast, broadcast
from ._registration import register_when_joblib_is_imported
from ._stats import last_call_stats
from .arrays import empty, full, is_shared, share, zeros

# Imported on first use. What needs joblib: a MemmappingPool and its workers need none of it, and joblib with
# loky costs them more than the rest of memshare; the backend is registered all the same (_registration). The
# pool: worker processes import this package too, and need none of the parent's side it brings.
_LAZY = {
    "MemmappingPool": "pool",
    "MemmapingPool": "pool",
    "MemshareBackend": "backend",
    "register_backend": "backend",
    "Parallel": "parallel",
    "delayed": "parallel",
    "WorkerDiedError": "_errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


register_when_joblib_is_imported()

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
