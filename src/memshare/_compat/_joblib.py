"""joblib's and loky's private names: the state of a call, batching, worker environments, the resource tracker."""

from __future__ import annotations

import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

from ._probes import exit_codes_in, joblib_parallel, loky_process_executor, loky_resource_tracker


def drop_ready_batches(parallel: Any) -> None:
    """Empty the batches joblib cut ahead of dispatch for an earlier call of ``parallel``.

    joblib keeps spare batches in a queue on the ``Parallel`` object and never
    empties it after a call stopped by an error.
    """
    ready = getattr(parallel, "_ready_batches", None)
    get = getattr(ready, "get_nowait", None)
    while get is not None:
        try:
            get()
        except Exception:  # queue.Empty
            return


def iterator_exhausted(parallel: Any) -> bool:
    """True once joblib has dropped its reference to the call's iterable (it found it exhausted)."""
    return getattr(parallel, "_original_iterator", None) is None and not getattr(parallel, "_iterating", False)


def parallel_config_options() -> Dict[str, Any]:
    """The options the innermost ``joblib.parallel_config`` of this thread sets, without joblib's defaults.

    joblib keeps the active configuration in a private thread-local and
    offers no public way to read it; empty outside any ``parallel_config``
    (or where the name is missing).
    """
    module = joblib_parallel()
    config = getattr(getattr(module, "_backend", None), "config", None)
    defaults = getattr(module, "default_parallel_config", {})
    if not isinstance(config, dict):
        return {}
    return {key: value for key, value in config.items() if value is not defaults.get(key)}


def parallel_backend(parallel: Any) -> Any:
    """The backend a ``joblib.Parallel`` runs its call on (after any fallback); None where the name is missing."""
    return getattr(parallel, "_backend", None)


def batched_calls(task: Any) -> Optional[List[Tuple[Any, tuple, dict]]]:
    """The ``(function, args, kwargs)`` calls of a joblib batch; None when ``task`` is not one.

    joblib sends a batch of calls as one ``BatchedCalls`` object whose
    ``items`` (an attribute its docs do not name) lists them.
    """
    # Without joblib imported, no task is a joblib batch: a pool's tasks do not import it to find out.
    batch_class = getattr(sys.modules.get("joblib.parallel"), "BatchedCalls", None)
    if batch_class is not None and isinstance(task, batch_class):
        return getattr(task, "items", None)
    return None


def set_auto_batch_size(backend: Any, batch_size: int) -> None:
    """Make ``batch_size`` the batch size joblib's ``AutoBatchingMixin`` takes to be in use.

    The mixin records the size it returned last and learns durations only
    from batches of that size, so a size made smaller than its choice must
    be recorded there too (where the mixin has no such record, nothing reads it).
    """
    backend._effective_batch_size = batch_size


def worker_env(backend: Any, n_jobs: int) -> Dict[str, str]:
    """The environment joblib gives the workers of ``backend``: thread limits for ``n_jobs`` workers.

    joblib computes it in a private method of its backend base class; where
    it is missing, the workers get no limits of their own.
    """
    prepare = getattr(backend, "_prepare_worker_env", None)
    return {} if prepare is None else prepare(n_jobs=n_jobs)


# -- loky --------------------------------------------------------------------


def terminated_worker_exit_codes(error: BaseException) -> List[int]:
    """The exit codes of the dead workers that loky names in the message of a ``TerminatedWorkerError``.

    loky puts them in the message only, as ``get_exitcodes_terminated_worker``
    formats them (``{SIGSEGV(-11), EXIT(1)}``); CHECKS verifies that this
    format still reads back.
    """
    return exit_codes_in(str(error))


def set_loky_leak_limit(nbytes: int) -> None:
    """Set, in this loky worker, the RSS growth after which loky recycles it as leaking.

    The loky releases bundled by joblib 1.3 to 1.6 hard-code the limit in this
    module global and read it at each check.
    """
    process_executor = loky_process_executor()
    if hasattr(process_executor, "_MAX_MEMORY_LEAK_SIZE"):
        process_executor._MAX_MEMORY_LEAK_SIZE = nbytes


def make_loky_tracker_reentrant() -> None:
    """Give loky's resource tracker a re-entrant lock where it has a plain one (loky 3.4, joblib 1.3 and 1.4).

    ``ResourceTracker.ensure_running`` holds that lock while it probes the
    tracker process. A garbage collection there may finalize a loky
    semaphore of an earlier executor, whose finalizer unregisters it through
    ``ensure_running`` again, in the same thread: with a plain lock the
    thread waits for itself forever (seen starting a call's workers). Later
    loky releases build on the standard library's tracker, whose lock is
    re-entrant already. Called once, at import, before any worker starts.
    """
    tracker = getattr(loky_resource_tracker(), "_resource_tracker", None)
    lock = getattr(tracker, "_lock", None)
    if lock is not None and isinstance(lock, type(threading.Lock())) and not lock.locked():
        tracker._lock = threading.RLock()


def loky_tracker() -> Tuple[Optional[int], Optional[int]]:
    """(pid, descriptor) of loky's resource tracker of this process, started if it was not; Nones when unknown.

    The pid is None, the descriptor not, in a child forked from the process
    that started the tracker: loky keeps the parent's tracker there (always
    before Python 3.15, under ``multiprocessing`` only from then on) and
    forgets its pid. The descriptor is the write end of the tracker's pipe.
    """
    resource_tracker = loky_resource_tracker()
    try:
        resource_tracker.ensure_running()
    except Exception:  # the tracker is loky's business: starting a worker will say what is wrong
        return None, None
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    pid, fd = getattr(tracker, "_pid", None), getattr(tracker, "_fd", None)
    return (pid if isinstance(pid, int) and pid > 0 else None), (fd if isinstance(fd, int) and fd >= 0 else None)
