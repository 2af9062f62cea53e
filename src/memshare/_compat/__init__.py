"""Every private name of another library that memshare relies on, and the check that each still exists.

The libraries are joblib, loky, numpy, pandas, multiprocessing and
threading: memshare extends them at a few points where they offer no public
hook. Each such use goes through a function of this module, with a line
saying why, so that a release that renames something breaks in one known
place instead of deep inside a call. :data:`CHECKS` lists every name; each is
looked up once, on first use of ``CHECKS`` (joblib and loky are imported only
by the functions that need them), and :func:`failed_checks` reports the missing
ones. ``python -m memshare doctor`` prints them with the fix. pandas' one name
is checked by ``tests/test_compat.py`` only: pandas is optional, and memshare
does not import it. The functions below degrade to doing nothing where their
name is missing, so a missing name costs a safety net, never an import error.

The private hooks of ``multiprocessing.pool.Pool`` that ``MemmappingPool``
overrides are overridden here, in :class:`PoolWithHooks`, its base class.
``tests/test_architecture.py`` fails when a private name of another library
is used anywhere else.
"""

from __future__ import annotations

import sys
from typing import Any, List

from ._arrays import gil_enabled, made_by_default_allocator, pandas_array_state, set_memmap_owner
from ._checks import Check, run_checks
from ._joblib import (
    batched_calls,
    drop_ready_batches,
    iterator_exhausted,
    loky_tracker,
    make_loky_tracker_reentrant,
    parallel_backend,
    parallel_config_options,
    set_auto_batch_size,
    set_loky_leak_limit,
    terminated_worker_exit_codes,
    worker_env,
)
from ._processes import (
    PoolWithHooks,
    drain_task_queue,
    fail_pool_result,
    pending_results,
    pool_size,
    pool_terminator,
    pool_workers,
    preload_in_fork_server,
    pseudo_main_hidden,
    reinit_lock,
    start_fork_server_with,
    worker_process,
)


def __getattr__(name: str) -> Any:
    # CHECKS, the result of looking each name up, is made on first use, not at import: looking up
    # joblib's and loky's names imports them, which a MemmappingPool and its workers do not need.
    # Immutable once made; two threads making it at once make equal tuples.
    if name == "CHECKS":
        checks = globals()["CHECKS"] = run_checks()
        return checks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def failed_checks() -> List[Check]:
    """The private names that the installed versions lack."""
    return [check for check in sys.modules[__name__].CHECKS if not check.found]


__all__ = [
    "CHECKS",  # noqa: F822 (made on first use, by the module's __getattr__)
    "Check",
    "PoolWithHooks",
    "drain_task_queue",
    "batched_calls",
    "drop_ready_batches",
    "fail_pool_result",
    "failed_checks",
    "gil_enabled",
    "iterator_exhausted",
    "made_by_default_allocator",
    "loky_tracker",
    "make_loky_tracker_reentrant",
    "pandas_array_state",
    "parallel_backend",
    "parallel_config_options",
    "pending_results",
    "pool_size",
    "pool_terminator",
    "pool_workers",
    "preload_in_fork_server",
    "pseudo_main_hidden",
    "reinit_lock",
    "set_auto_batch_size",
    "set_loky_leak_limit",
    "set_memmap_owner",
    "start_fork_server_with",
    "terminated_worker_exit_codes",
    "worker_env",
    "worker_process",
]
