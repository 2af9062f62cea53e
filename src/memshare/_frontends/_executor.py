"""memshare's own long-lived loky executor, kept apart from joblib's.

joblib's ``"loky"`` backend runs on loky's process-wide reusable executor,
and that singleton is recreated whenever it is asked for with other
arguments. memshare's workers need another initializer (they watch their
owner and lift loky's memory-leak limit), so sharing the singleton would make
every switch between a memshare call and a plain joblib call wait for one set
of workers to stop and spawn the other. memshare therefore owns one
``ProcessPoolExecutor`` of joblib's bundled loky (the same loky, hence the
same resource tracker and multiprocessing context, as joblib): it is reused
from call to call, its idle workers exit after the call's
``idle_worker_timeout``, and it is replaced when it broke, was shut down, or
is asked for with another worker count, environment, timeout or user
initializer (compared with ``==`` as joblib's loky backend does: the same
function object and equal ``initargs`` keep the workers). The user's
initializer runs after memshare's own, in every worker the executor starts,
including one that replaces a crashed worker; it travels to the workers with
loky's process pickler (cloudpickle), so lambdas and ``__main__`` functions
work. An
executor found broken when a call submits to it (a worker died while idle)
is discarded by the backend, which then asks for a new one.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

from joblib.externals.loky import ProcessPoolExecutor

from .. import _forksafe
from .._compat import set_loky_leak_limit
from .._lifetime._owners import owner_identity
from .._lifetime._temp_folder import leave_loky_semaphores_to_watchdog
from .._worker._run import watch_parent

#: The variable newer loky releases read for their leak limit; memshare
#: honours it in its workers, with no limit by default.
LEAK_LIMIT_VARIABLE = "LOKY_MAX_MEMORY_LEAK_SIZE"

_lock = _forksafe.lock()  # a call in another thread may hold it when this process forks
_executor: Optional[ProcessPoolExecutor] = None
_executor_key: Optional[Tuple] = None
_executor_owner: Optional[int] = None  # the pid that created _executor


def get_executor(
    n_jobs: int,
    timeout: float,
    env: Dict[str, str],
    initializer: Optional[Callable[..., Any]] = None,
    initargs: Tuple = (),
) -> ProcessPoolExecutor:
    """The executor for a call with ``n_jobs`` workers, reused when nothing changed."""
    global _executor, _executor_key, _executor_owner
    initargs = tuple(initargs)
    key = (n_jobs, timeout, tuple(sorted(env.items())), initializer, initargs)
    with _lock:
        if _executor_owner != os.getpid():
            # A fork of the process that made the executor: the executor and
            # its workers belong to the parent, and its threads did not
            # survive the fork. Leave it alone and start one of our own.
            _executor, _executor_key = None, None
        if _executor is not None and _executor_key == key:
            return _executor
        old, _executor, _executor_key = _executor, None, None
        if old is not None:
            # Tasks still running on the old executor (another thread's call)
            # finish first, as when loky replaces its own singleton.
            old.shutdown(wait=True)
        leave_loky_semaphores_to_watchdog()  # before the executor makes any
        _executor = ProcessPoolExecutor(
            max_workers=n_jobs,
            timeout=timeout,
            env=env,
            initializer=start_worker,
            initargs=(*owner_identity(), initializer, initargs),
        )
        _executor_key, _executor_owner = key, os.getpid()
        return _executor


def current_executor() -> Optional[ProcessPoolExecutor]:
    """The executor the next call with unchanged settings would get, if any."""
    with _lock:
        return _executor if _executor_owner == os.getpid() else None


def discard_executor(executor: ProcessPoolExecutor, wait: bool = True) -> None:
    """Kill ``executor``'s workers (aborting its tasks); the next call gets a new executor.

    ``wait=False`` when the caller may hold joblib's lock: loky's manager
    thread, failing the pending futures, runs joblib's callbacks, which take
    that lock, so waiting for the thread there would deadlock.
    """
    global _executor, _executor_key
    with _lock:
        if _executor is executor:
            _executor, _executor_key = None, None
    executor.shutdown(wait=wait, kill_workers=True)


def start_worker(
    parent: int,
    parent_start: Optional[int],
    user_initializer: Optional[Callable[..., Any]] = None,
    user_initargs: Tuple = (),
) -> None:
    """Initializer of memshare's loky workers, then the user's one if given."""
    lift_leak_limit()
    watch_parent(parent, parent_start)
    if user_initializer is not None:
        user_initializer(*user_initargs)


def lift_leak_limit() -> None:
    """Keep loky from recycling this worker for the shared pages it maps.

    After each task a loky worker compares its RSS with the RSS after its
    first task and exits when it grew by more than ``_MAX_MEMORY_LEAK_SIZE``
    (300 MB), taking that for a leak. RSS counts the shared-memory pages the
    worker maps, and memshare keeps those mappings open across tasks on
    purpose, so the check would restart workers over and over, with a warning
    each time. The loky releases joblib 1.3 to 1.6 bundle (3.4.0 to 3.6.0)
    hard-code the limit in that module global and read it at each check, so
    setting it here, in the worker, before its first task, is enough.
    ``LOKY_MAX_MEMORY_LEAK_SIZE`` (bytes) still sets a limit if the user wants one.
    """
    limit = os.environ.get(LEAK_LIMIT_VARIABLE)
    try:
        value = int(float(limit)) if limit else 2**62
    except ValueError:
        value = 2**62
    set_loky_leak_limit(value)
