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
from .._lifetime._owners import owner_identity
from .._lifetime._temp_folder import leave_loky_semaphores_to_watchdog
from .._worker._entry import start_backend_worker

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
            initializer=start_backend_worker,
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
