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

import inspect
import multiprocessing.forkserver as _mp_forkserver
import multiprocessing.pool as _mp_pool
import multiprocessing.queues as _mp_queues
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

try:  # numpy >= 2
    from numpy._core import multiarray as _np_multiarray
except ImportError:  # numpy 1.x
    from numpy.core import multiarray as _np_multiarray


# joblib and loky are imported on first use, not with this module: a MemmappingPool needs neither, and its
# workers would otherwise import them, which costs more than the rest of memshare.


def _joblib_parallel() -> ModuleType:
    import joblib.parallel

    return joblib.parallel


def _loky_process_executor() -> ModuleType:
    from joblib.externals.loky import process_executor

    return process_executor


def _loky_resource_tracker() -> ModuleType:
    from joblib.externals.loky.backend import resource_tracker

    return resource_tracker


#: numpy before 1.22 has one allocator, malloc; later releases let a library plug its own.
_NUMPY_PLUGGABLE_ALLOCATOR = tuple(int(part) for part in np.__version__.split(".")[:2]) >= (1, 22)


@dataclass(frozen=True)
class Check:
    """One private name memshare uses: where it is, why, and whether it was found."""

    name: str
    why: str
    found: bool


def _has(owner: Any, attribute: str) -> bool:
    return hasattr(owner, attribute)


def _takes_parameter(function: Any, name: str) -> bool:
    return name in inspect.signature(function).parameters


def _exit_codes_in(text: str) -> List[int]:
    return [int(code) for code in re.findall(r"\((-?\d+)\)", text)]


def _uses_attribute(cls: type, attribute: str) -> bool:
    """True when a method of ``cls`` (or of a base) reads or sets ``self.<attribute>``.

    Instance attributes exist only on instances; their names do appear in the
    code of the methods that set them, without making an instance.
    """
    for klass in getattr(cls, "__mro__", ()):
        for member in vars(klass).values():
            code = getattr(getattr(member, "__func__", member), "__code__", None)
            if code is not None and attribute in code.co_names:
                return True
    return False


_SPECS: Tuple[Tuple[str, str, Callable[[], bool]], ...] = (
    (
        "joblib.Parallel._ready_batches",
        "a new call empties the batches a failed call fetched ahead, or a managed context would run them",
        lambda: _uses_attribute(_joblib_parallel().Parallel, "_ready_batches"),
    ),
    (
        "joblib.Parallel._original_iterator / _iterating",
        "the progress bar learns a generator's total when joblib has taken its last task",
        lambda: all(
            _uses_attribute(_joblib_parallel().Parallel, name) for name in ("_original_iterator", "_iterating")
        ),
    ),
    (
        "joblib.parallel._backend (the thread's parallel_config)",
        "doctor reports the options of an enclosing joblib.parallel_config(backend='memshare', ...); "
        "memshare.Parallel follows the backend one names",
        lambda: _has(_joblib_parallel(), "_backend") and isinstance(_joblib_parallel().default_parallel_config, dict),
    ),
    (
        "joblib.Parallel._backend",
        "memshare.Parallel warns when the backend a call runs on copies a writable shared array into its workers",
        lambda: _uses_attribute(_joblib_parallel().Parallel, "_backend"),
    ),
    (
        "joblib BatchedCalls.items",
        "a large object passed to many tasks is pickled once per call: memshare finds the calls' arguments",
        lambda: _uses_attribute(_joblib_parallel().BatchedCalls, "items"),
    ),
    (
        "joblib AutoBatchingMixin._effective_batch_size",
        "a batch that would dump too much is made smaller, and joblib then measures batches of that size",
        lambda: _uses_attribute(_joblib_parallel().AutoBatchingMixin, "_effective_batch_size"),
    ),
    (
        "joblib ParallelBackendBase._prepare_worker_env",
        "memshare's workers get the thread limits joblib gives its own (inner_max_num_threads)",
        lambda: _has(_joblib_parallel().ParallelBackendBase, "_prepare_worker_env"),
    ),
    (
        "loky TerminatedWorkerError's message: the exit codes as get_exitcodes_terminated_worker writes them",
        "a call whose worker died names the signal that killed it (loky gives the exit codes in no other way)",
        lambda: (
            _exit_codes_in(
                _loky_process_executor().get_exitcodes_terminated_worker(
                    {1: SimpleNamespace(exitcode=-11), 2: SimpleNamespace(exitcode=1)}
                )
            )
            == [-11, 1]
        ),
    ),
    (
        "loky process_executor._MAX_MEMORY_LEAK_SIZE",
        "workers lift loky's 300 MB leak limit, which the shared pages they map would trip",
        lambda: _has(_loky_process_executor(), "_MAX_MEMORY_LEAK_SIZE"),
    ),
    (
        "multiprocessing Pool._setup_queues / _quick_get",
        "the pool restores each outcome on its result thread, before the standard machinery sees it",
        lambda: _has(_mp_pool.Pool, "_setup_queues") and _uses_attribute(_mp_pool.Pool, "_quick_get"),
    ),
    (
        "multiprocessing Pool._help_stuff_finish / SimpleQueue._rlock / _reader",
        "terminate() gives up draining a task queue whose lock a killed worker took with it",
        lambda: (
            _has(_mp_pool.Pool, "_help_stuff_finish")
            and _uses_attribute(_mp_queues.SimpleQueue, "_rlock")
            and _uses_attribute(_mp_queues.SimpleQueue, "_reader")
        ),
    ),
    (
        "multiprocessing Pool._get_sentinels / _change_notifier",
        "the pool's worker thread sleeps until a worker exits or the pool changes, instead of spinning "
        "while each result waits in the pipe",
        lambda: _has(_mp_pool.Pool, "_get_sentinels") and _uses_attribute(_mp_pool.Pool, "_change_notifier"),
    ),
    (
        "multiprocessing Pool._cache / _pool / _processes",
        "a dead worker fails the pool's pending results once the pool reaped it; map picks a chunk size "
        "from the pool's size",
        lambda: all(_uses_attribute(_mp_pool.Pool, name) for name in ("_cache", "_pool", "_processes")),
    ),
    (
        "multiprocessing Pool.Process, read from the instance",
        "the pool records each worker it starts, without its threads holding the pool",
        lambda: _uses_attribute(_mp_pool.Pool, "Process"),
    ),
    (
        "multiprocessing Pool.__del__(_warn) / _state",
        "an unclosed pool warns once, naming MemmappingPool, and does the rest of what Pool.__del__ does",
        lambda: _takes_parameter(_mp_pool.Pool.__del__, "_warn") and _uses_attribute(_mp_pool.Pool, "_state"),
    ),
    (
        "multiprocessing ApplyResult._set / IMapIterator._index / _set_length",
        "a dead worker fails pending results the way the pool's own result thread completes them",
        lambda: (
            _has(_mp_pool.ApplyResult, "_set")
            and _has(_mp_pool.IMapIterator, "_set")
            and _uses_attribute(_mp_pool.IMapIterator, "_index")
            and _has(_mp_pool.IMapIterator, "_set_length")
        ),
    ),
    (
        "numpy multiarray.get_handler_name",
        "an array is held once only when NumPy's default allocator (malloc) made its memory",
        lambda: _has(_np_multiarray, "get_handler_name") or not _NUMPY_PLUGGABLE_ALLOCATOR,
    ),
    (
        "numpy memmap._mmap",
        "slices of an array mapped without a descriptor stay np.memmap objects, as for a memmap numpy opened",
        lambda: _uses_attribute(np.memmap, "_mmap"),
    ),
    (
        "sys._is_gil_enabled",
        "arrays are held once only where the GIL keeps other threads out of each copy-then-remap step",
        lambda: _has(sys, "_is_gil_enabled") or sys.version_info < (3, 13),
    ),
    (
        "multiprocessing forkserver._forkserver._preload_modules / _forkserver_pid / _preload_on_error (3.15)",
        "a MemmappingPool's fork server imports memshare once, keeping the modules the user asked it to preload "
        "and what to do when one fails to import",
        lambda: (
            isinstance(getattr(getattr(_mp_forkserver, "_forkserver", None), "_preload_modules", None), list)
            and _has(_mp_forkserver._forkserver, "_forkserver_pid")
            and (
                _has(_mp_forkserver._forkserver, "_preload_on_error")
                or not _takes_parameter(_mp_forkserver.set_forkserver_preload, "on_error")
            )
        ),
    ),
    (
        "loky resource_tracker._resource_tracker._lock",
        "loky 3.4's tracker lock is made re-entrant: a semaphore finalized by the garbage collector inside it "
        "would otherwise deadlock the call that starts workers",
        lambda: _has(getattr(_loky_resource_tracker(), "_resource_tracker", None), "_lock"),
    ),
    (
        "loky resource_tracker._resource_tracker._pid",
        "a killed owner's watchdog waits for loky's tracker to exit (its workers gone) before removing its semaphores",
        lambda: _has(getattr(_loky_resource_tracker(), "_resource_tracker", None), "_pid"),
    ),
    (
        "threading.Lock._at_fork_reinit",
        "memshare's locks are unlocked in a forked child, as the standard library does for its own",
        lambda: _has(threading.Lock(), "_at_fork_reinit") and _has(threading.RLock(), "_at_fork_reinit"),
    ),
)


def _run_checks() -> Tuple[Check, ...]:
    checks = []
    for name, why, probe in _SPECS:
        try:
            found = bool(probe())
        except Exception:
            found = False
        checks.append(Check(name, why, found))
    return tuple(checks)


def __getattr__(name: str) -> Any:
    # CHECKS, the result of looking each name up, is made on first use, not at import: looking up
    # joblib's and loky's names imports them, which a MemmappingPool and its workers do not need.
    # Immutable once made; two threads making it at once make equal tuples.
    if name == "CHECKS":
        checks = globals()["CHECKS"] = _run_checks()
        return checks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def failed_checks() -> List[Check]:
    """The private names that the installed versions lack."""
    return [check for check in sys.modules[__name__].CHECKS if not check.found]


# -- joblib ------------------------------------------------------------------


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
    joblib_parallel = _joblib_parallel()
    config = getattr(getattr(joblib_parallel, "_backend", None), "config", None)
    defaults = getattr(joblib_parallel, "default_parallel_config", {})
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
    return _exit_codes_in(str(error))


def set_loky_leak_limit(nbytes: int) -> None:
    """Set, in this loky worker, the RSS growth after which loky recycles it as leaking.

    The loky releases bundled by joblib 1.3 to 1.6 hard-code the limit in this
    module global and read it at each check.
    """
    process_executor = _loky_process_executor()
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
    tracker = getattr(_loky_resource_tracker(), "_resource_tracker", None)
    lock = getattr(tracker, "_lock", None)
    if lock is not None and isinstance(lock, type(threading.Lock())) and not lock.locked():
        tracker._lock = threading.RLock()


def loky_tracker_pid() -> Optional[int]:
    """The pid of loky's resource tracker of this process, started if it was not; None when unknown.

    None too in a child forked by ``multiprocessing``, which shares its
    parent's tracker without knowing its pid.
    """
    resource_tracker = _loky_resource_tracker()
    try:
        resource_tracker.ensure_running()
    except Exception:  # the tracker is loky's business: starting a worker will say what is wrong
        return None
    pid = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)
    return pid if isinstance(pid, int) and pid > 0 else None


# -- multiprocessing's fork server ----------------------------------------------


def preload_in_fork_server(module: str) -> None:
    """Have the fork server import ``module`` when it starts, besides the modules already asked for.

    ``multiprocessing.set_forkserver_preload`` only replaces the list, which
    is private: read it to keep what the user set. From 3.15 the call also
    sets what to do when a module fails to import (``on_error``), back to its
    default unless given: the user's choice is read and passed on. Once the
    server runs, the list no longer matters and is left alone.
    """
    server = getattr(_mp_forkserver, "_forkserver", None)
    modules = getattr(server, "_preload_modules", None)
    if not isinstance(modules, list) or module in modules or getattr(server, "_forkserver_pid", None) is not None:
        return
    on_error = getattr(server, "_preload_on_error", None)
    _mp_forkserver.set_forkserver_preload([*modules, module], **({} if on_error is None else {"on_error": on_error}))


# -- numpy ---------------------------------------------------------------------


def made_by_default_allocator(array: np.ndarray) -> bool:
    """True when ``array`` owns memory that NumPy's default allocator (malloc) gave it.

    Before numpy 1.22 every array that owns its data got it from malloc. The
    handler's name is what NEP 49 documents for telling allocators apart; numpy
    2 moved the module that exposes it.
    """
    if not array.flags.owndata:
        return False
    if not _NUMPY_PLUGGABLE_ALLOCATOR:
        return True
    get_handler_name = getattr(_np_multiarray, "get_handler_name", None)
    return get_handler_name is not None and get_handler_name(array) == "default_allocator"


def set_memmap_owner(array: np.memmap, owner: Any) -> None:
    """Give ``array`` the object owning its mapping as numpy's ``np.memmap.__new__`` does (``_mmap``).

    numpy turns a slice of a memmap whose ``_mmap`` is None into a plain
    ndarray, and copies ``_mmap`` to every view; an ``np.memmap`` that memshare
    builds over a mapping that keeps no descriptor must carry it for its
    slices to stay memmaps. Setting it is harmless where numpy stops using it.
    """
    array._mmap = owner


def gil_enabled() -> bool:
    """False on a free-threaded CPython running without its GIL (3.13+); True everywhere else."""
    is_gil_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_gil_enabled is None else bool(is_gil_enabled())


# -- pandas --------------------------------------------------------------------


def pandas_array_state(array: Any) -> Dict[str, Any]:
    """The state pandas pickles an Arrow-backed array with, minus the copy: its ``__dict__``, cached properties emptied.

    pandas' ``__getstate__`` also combines the column's chunks into a new
    Arrow array, which is what memshare avoids; its cached properties live in
    ``_cache``, which it empties (they are recomputed). pandas is optional and
    is not imported to check this at import: ``tests/test_compat.py`` compares
    this state with pandas' own where pandas is installed.
    """
    state = dict(array.__dict__)
    if "_cache" in state:
        state["_cache"] = {}
    return state


# -- multiprocessing -----------------------------------------------------------


def pool_workers(pool: _mp_pool.Pool) -> list:
    """The live list of ``pool``'s worker processes: the pool's thread adds and drops them in place."""
    return getattr(pool, "_pool", [])


def pending_results(pool: _mp_pool.Pool) -> Mapping:
    """The live table of ``pool``'s results that have not completed (its values are the result objects)."""
    return getattr(pool, "_cache", {})


def pool_size(pool: _mp_pool.Pool) -> int:
    """The number of worker processes ``pool`` keeps."""
    return int(getattr(pool, "_processes", 1) or 1)


def fail_pool_result(result: Any, error: BaseException) -> None:
    """Complete a pending pool result with ``error``, as the pool's result thread would.

    The standard result objects have no public way to fail them; ``_set`` is
    what the result thread calls, with the same arguments.
    """
    try:
        if isinstance(result, _mp_pool.IMapIterator):
            index = result._index
            result._set(index, (False, error))
            result._set_length(index + 1)
        elif isinstance(result, _mp_pool.MapResult):
            while not result.ready():
                result._set(0, (False, error))
        elif isinstance(result, _mp_pool.ApplyResult):
            result._set(0, (False, error))
    except (KeyError, IndexError, TypeError, AttributeError):
        pass  # finished concurrently, or a Python without these names


def _same(message: Any) -> Any:
    return message


def _no_warning(*args: Any, **kwargs: Any) -> None:
    pass


class PoolWithHooks(_mp_pool.Pool):
    """``multiprocessing.Pool`` with the private hooks memshare overrides, offered as an argument.

    Every message from the workers passes through ``message_filter``, on the
    pool's result thread, before the standard machinery sees it. That thread
    keeps the function as long as it runs, so the function must not hold the
    pool. Its worker thread wakes for worker exits and pool changes only, not
    for every result. ``terminate()`` drains the task queue without waiting
    forever for its lock. An unclosed running pool, collected, warns once, naming its class.
    """

    def __init__(self, *args: Any, message_filter: Callable[[Any], Any] = _same, **kwargs: Any) -> None:
        self._message_filter = message_filter  # before Pool.__init__: _setup_queues reads it
        super().__init__(*args, **kwargs)

    def _setup_queues(self) -> None:
        # Pool reads _quick_get right after this call, to hand it to its result thread.
        super()._setup_queues()
        receive, restore = self._quick_get, self._message_filter

        def receive_and_restore() -> Any:
            return restore(receive())

        self._quick_get = receive_and_restore

    def _get_sentinels(self) -> list:
        # Pool's worker thread waits on these and on the workers' sentinels, then polls every worker.
        # The standard list has the result pipe's read end, ready from when a worker writes a result
        # until the result thread reads it: with small tasks that thread spins a few times per task,
        # taking the CPU and the GIL from the threads that feed and restore them. Worker exits wake it
        # through their sentinels; close(), terminate() and an emptied cache through the change
        # notifier, which is all ThreadPool waits on.
        reader = getattr(getattr(self, "_change_notifier", None), "_reader", None)
        return [reader] if reader is not None else super()._get_sentinels()

    @staticmethod
    def _help_stuff_finish(inqueue: Any, task_handler: threading.Thread, size: int) -> None:
        # Pool.terminate drains the task queue under its read lock. A worker
        # killed while waiting for a task never released that lock, and the
        # standard pool would then hang forever here; the workers are being
        # terminated anyway, so give up on draining after a moment.
        drain_task_queue(inqueue, task_handler, lock_timeout=1.0)

    def __del__(self) -> None:
        # Pool.__del__ reads attributes that do not exist when __init__
        # rejected its arguments before the pool was set up.
        if "_state" not in vars(self):
            return
        if self._state == _mp_pool.RUN:
            message = f"unclosed running {type(self).__name__} {self!r}"
            warnings.warn(message, ResourceWarning, stacklevel=1, source=self)
        if _POOL_DEL_TAKES_WARN:
            super().__del__(_warn=_no_warning)  # the rest of what it does: wake the pool's worker thread
        else:
            super().__del__()


_POOL_DEL_TAKES_WARN = _takes_parameter(_mp_pool.Pool.__del__, "_warn")


def drain_task_queue(inqueue: Any, task_handler: threading.Thread, lock_timeout: float = 1.0) -> None:
    """Drain a pool's task queue as ``Pool._help_stuff_finish`` does, without hanging.

    The standard version waits forever for the queue's read lock, which a
    worker killed while waiting for a task never releases.
    """
    rlock: Optional[Any] = getattr(inqueue, "_rlock", None)
    reader = getattr(inqueue, "_reader", None)
    if rlock is None or reader is None or not rlock.acquire(timeout=lock_timeout):
        return
    while task_handler.is_alive() and reader.poll():
        reader.recv()
        time.sleep(0)


# -- threading -----------------------------------------------------------------


def reinit_lock(lock: Any) -> None:
    """Make ``lock`` unlocked and usable again in a forked child (the standard library's own reset)."""
    reinit = getattr(lock, "_at_fork_reinit", None)
    if reinit is not None:
        reinit()


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
    "make_loky_tracker_reentrant",
    "pandas_array_state",
    "parallel_backend",
    "parallel_config_options",
    "pending_results",
    "pool_size",
    "pool_workers",
    "preload_in_fork_server",
    "reinit_lock",
    "set_auto_batch_size",
    "set_loky_leak_limit",
    "set_memmap_owner",
    "terminated_worker_exit_codes",
    "worker_env",
]
