"""``memshare.Parallel`` and ``memshare.delayed``: joblib's API, memshare's backend.

``Parallel`` is joblib's ``Parallel`` with one difference: when no backend is
given and no ``joblib.parallel_config`` chooses one, it runs on the
``"memshare"`` backend. Every other backend name (``"dask"``, ``"loky"``,
``"threading"``...) passes through unchanged, so the same code can move to a
Dask cluster with ``Parallel(backend="dask")``.

Inside a worker, joblib makes nested calls use threads or run sequentially,
so that processes are not spawned without bound; ``Parallel`` keeps that
rule, because the nested configuration is an active backend.
"""

from __future__ import annotations

import joblib
from joblib import delayed
from joblib.parallel import get_active_backend

from .backend import BACKEND_NAME, MemshareBackend


def _no_backend_chosen() -> bool:
    """True when joblib would fall back to its own default backend.

    joblib's default is a top-level ``LokyBackend``; a nested call sees a
    ``ThreadingBackend`` or ``SequentialBackend`` with a nesting level, and a
    ``parallel_config`` sees the backend it named.
    """
    backend, _ = get_active_backend()
    return type(backend).__name__ == "LokyBackend" and not backend.nesting_level


class Parallel(joblib.Parallel):
    """joblib's ``Parallel``, running on memshare's backend by default.

    All of joblib's arguments work as documented by joblib
    (``n_jobs``, ``backend``, ``return_as``, ``timeout``, ``batch_size``,
    ``pre_dispatch``, ``max_nbytes``, ``mmap_mode``, ``temp_folder``...).
    Results larger than ``max_nbytes`` come back through shared memory.
    """

    def __init__(self, n_jobs=None, backend=None, *args, **kwargs):
        if backend is None and _no_backend_chosen():
            backend = BACKEND_NAME
        super().__init__(n_jobs, backend, *args, **kwargs)


__all__ = ["MemshareBackend", "Parallel", "delayed"]
