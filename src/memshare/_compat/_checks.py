"""The list of private names memshare uses, each with why, and the lookup that says whether each still exists."""

from __future__ import annotations

import multiprocessing.forkserver as _mp_forkserver
import multiprocessing.pool as _mp_pool
import multiprocessing.queues as _mp_queues
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Tuple

from .._numpy import np
from ._arrays import numpy_multiarray, numpy_pluggable_allocator
from ._probes import (
    exit_codes_in,
    has,
    joblib_parallel,
    loky_process_executor,
    loky_resource_tracker,
    takes_parameter,
    uses_attribute,
)


@dataclass(frozen=True)
class Check:
    """One private name memshare uses: where it is, why, and whether it was found."""

    name: str
    why: str
    found: bool


_SPECS: Tuple[Tuple[str, str, Callable[[], bool]], ...] = (
    (
        "joblib.Parallel._ready_batches",
        "a new call empties the batches a failed call fetched ahead, or a managed context would run them",
        lambda: uses_attribute(joblib_parallel().Parallel, "_ready_batches"),
    ),
    (
        "joblib.Parallel._original_iterator / _iterating",
        "the progress bar learns a generator's total when joblib has taken its last task",
        lambda: all(uses_attribute(joblib_parallel().Parallel, name) for name in ("_original_iterator", "_iterating")),
    ),
    (
        "joblib.parallel._backend (the thread's parallel_config)",
        "doctor reports the options of an enclosing joblib.parallel_config(backend='memshare', ...); "
        "memshare.Parallel follows the backend one names",
        lambda: has(joblib_parallel(), "_backend") and isinstance(joblib_parallel().default_parallel_config, dict),
    ),
    (
        "joblib.Parallel._backend",
        "memshare.Parallel warns when the backend a call runs on copies a writable shared array into its workers",
        lambda: uses_attribute(joblib_parallel().Parallel, "_backend"),
    ),
    (
        "joblib BatchedCalls.items",
        "a large object passed to many tasks is pickled once per call: memshare finds the calls' arguments",
        lambda: uses_attribute(joblib_parallel().BatchedCalls, "items"),
    ),
    (
        "joblib AutoBatchingMixin._effective_batch_size",
        "a batch that would dump too much is made smaller, and joblib then measures batches of that size",
        lambda: uses_attribute(joblib_parallel().AutoBatchingMixin, "_effective_batch_size"),
    ),
    (
        "joblib ParallelBackendBase._prepare_worker_env",
        "memshare's workers get the thread limits joblib gives its own (inner_max_num_threads)",
        lambda: has(joblib_parallel().ParallelBackendBase, "_prepare_worker_env"),
    ),
    (
        "loky TerminatedWorkerError's message: the exit codes as get_exitcodes_terminated_worker writes them",
        "a call whose worker died names the signal that killed it (loky gives the exit codes in no other way)",
        lambda: (
            exit_codes_in(
                loky_process_executor().get_exitcodes_terminated_worker(
                    {1: SimpleNamespace(exitcode=-11), 2: SimpleNamespace(exitcode=1)}
                )
            )
            == [-11, 1]
        ),
    ),
    (
        "loky process_executor._MAX_MEMORY_LEAK_SIZE",
        "workers lift loky's 300 MB leak limit, which the shared pages they map would trip",
        lambda: has(loky_process_executor(), "_MAX_MEMORY_LEAK_SIZE"),
    ),
    (
        "multiprocessing Pool._setup_queues / _quick_get",
        "the pool restores each outcome on its result thread, before the standard machinery sees it",
        lambda: has(_mp_pool.Pool, "_setup_queues") and uses_attribute(_mp_pool.Pool, "_quick_get"),
    ),
    (
        "multiprocessing Pool._help_stuff_finish / SimpleQueue._rlock / _reader",
        "terminate() gives up draining a task queue whose lock a killed worker took with it",
        lambda: (
            has(_mp_pool.Pool, "_help_stuff_finish")
            and uses_attribute(_mp_queues.SimpleQueue, "_rlock")
            and uses_attribute(_mp_queues.SimpleQueue, "_reader")
        ),
    ),
    (
        "multiprocessing Pool._outqueue / _inqueue / _quick_put / _terminate / SimpleQueue._wlock / _writer",
        "the parent reads and writes the pool's queues without waiting forever on a killed worker (its "
        "lock, or a task it was reading); a worker dying ends the pool as terminate() would",
        lambda: (
            all(uses_attribute(_mp_pool.Pool, name) for name in ("_outqueue", "_inqueue", "_quick_put", "_terminate"))
            and all(uses_attribute(_mp_queues.SimpleQueue, name) for name in ("_wlock", "_writer"))
        ),
    ),
    (
        "multiprocessing Pool._get_sentinels / _change_notifier",
        "the pool's worker thread sleeps until a worker exits or the pool changes, instead of spinning "
        "while each result waits in the pipe",
        lambda: has(_mp_pool.Pool, "_get_sentinels") and uses_attribute(_mp_pool.Pool, "_change_notifier"),
    ),
    (
        "multiprocessing Pool._cache / _pool / _processes",
        "a dead worker fails the pool's pending results once the pool reaped it; map picks a chunk size "
        "from the pool's size",
        lambda: all(uses_attribute(_mp_pool.Pool, name) for name in ("_cache", "_pool", "_processes")),
    ),
    (
        "multiprocessing Pool._worker_handler / _task_handler / _result_handler",
        "join() waits for the workers together once the pool's threads have ended, and ends the others when "
        "one was killed holding the task queue's lock",
        lambda: all(
            uses_attribute(_mp_pool.Pool, name) for name in ("_worker_handler", "_task_handler", "_result_handler")
        ),
    ),
    (
        "multiprocessing Pool.Process, read from the instance",
        "the pool records each worker it starts, without its threads holding the pool",
        lambda: uses_attribute(_mp_pool.Pool, "Process"),
    ),
    (
        "multiprocessing Pool.__del__(_warn) / _state",
        "an unclosed pool warns once, naming MemmappingPool, and does the rest of what Pool.__del__ does",
        lambda: takes_parameter(_mp_pool.Pool.__del__, "_warn") and uses_attribute(_mp_pool.Pool, "_state"),
    ),
    (
        "multiprocessing ApplyResult._set / IMapIterator._index / _set_length",
        "a dead worker fails pending results the way the pool's own result thread completes them",
        lambda: (
            has(_mp_pool.ApplyResult, "_set")
            and has(_mp_pool.IMapIterator, "_set")
            and uses_attribute(_mp_pool.IMapIterator, "_index")
            and has(_mp_pool.IMapIterator, "_set_length")
        ),
    ),
    (
        "numpy multiarray.get_handler_name",
        "an array is held once only when NumPy's default allocator (malloc) made its memory",
        lambda: has(numpy_multiarray(), "get_handler_name") or not numpy_pluggable_allocator(),
    ),
    (
        "numpy memmap._mmap",
        "slices of an array mapped without a descriptor stay np.memmap objects, as for a memmap numpy opened",
        lambda: uses_attribute(np.memmap, "_mmap"),
    ),
    (
        "sys._is_gil_enabled",
        "arrays are held once only where the GIL keeps other threads out of each copy-then-remap step",
        lambda: has(sys, "_is_gil_enabled") or sys.version_info < (3, 13),
    ),
    (
        "multiprocessing forkserver._forkserver._preload_modules / _forkserver_pid / _preload_on_error (3.15)",
        "a MemmappingPool's fork server imports memshare once, keeping the modules the user asked it to preload "
        "and what to do when one fails to import",
        lambda: (
            isinstance(getattr(getattr(_mp_forkserver, "_forkserver", None), "_preload_modules", None), list)
            and has(_mp_forkserver._forkserver, "_forkserver_pid")
            and (
                has(_mp_forkserver._forkserver, "_preload_on_error")
                or not takes_parameter(_mp_forkserver.set_forkserver_preload, "on_error")
            )
        ),
    ),
    (
        "loky resource_tracker._resource_tracker._lock",
        "loky 3.4's tracker lock is made re-entrant: a semaphore finalized by the garbage collector inside it "
        "would otherwise deadlock the call that starts workers",
        lambda: has(getattr(loky_resource_tracker(), "_resource_tracker", None), "_lock"),
    ),
    (
        "loky resource_tracker._resource_tracker._pid / _fd",
        "a killed owner's watchdog waits for loky's tracker to exit (its workers gone) before removing its semaphores",
        lambda: all(has(getattr(loky_resource_tracker(), "_resource_tracker", None), n) for n in ("_pid", "_fd")),
    ),
    (
        "threading.Lock._at_fork_reinit",
        "memshare's locks are unlocked in a forked child, as the standard library does for its own",
        lambda: has(threading.Lock(), "_at_fork_reinit") and has(threading.RLock(), "_at_fork_reinit"),
    ),
)


def run_checks() -> Tuple[Check, ...]:
    checks = []
    for name, why, probe in _SPECS:
        try:
            found = bool(probe())
        except Exception:
            found = False
        checks.append(Check(name, why, found))
    return tuple(checks)


__all__ = ["Check", "run_checks"]
