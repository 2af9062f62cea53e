"""Every public error and warning of memshare, and how a worker's death is explained."""

from __future__ import annotations

import pickle
import signal
from typing import Any, Optional

from . import _forksafe

# WorkerDiedError subclasses loky's error, and loky comes with joblib, which neither a MemmappingPool nor its
# workers need otherwise: the class is made on first use (importing it from this module, or memshare's),
# once per process, under this lock.
_made_lock = _forksafe.lock()


def _make_worker_died_error(base: type) -> type:
    class WorkerDiedError(base):
        """A worker process ended abruptly (killed, crashed) while tasks were pending.

        A subclass of ``joblib.externals.loky.process_executor.TerminatedWorkerError``
        (hence of ``RuntimeError``), so code written for joblib's loky backend
        catches it too. The message names the signal, with a hint for the usual
        ones: ``SIGKILL`` (the out-of-memory killer, probably), ``SIGBUS``
        (shared memory exhausted, probably) and ``SIGSEGV`` (native code).

        The call's temporary files are removed before it is raised. A
        :class:`MemmappingPool` is broken after it: make a new one.

        See Also
        --------
        joblib.externals.loky.process_executor.TerminatedWorkerError : joblib's error, its base class.

        Examples
        --------
        >>> import os
        >>> from memshare import Parallel, WorkerDiedError, delayed
        >>> try:  # a task that ends its own worker
        ...     Parallel(n_jobs=2)(delayed(os._exit)(3) for _ in range(2))
        ... except WorkerDiedError as exc:
        ...     print("exited with code 3" in str(exc))
        True
        """

    WorkerDiedError.__module__ = __name__
    WorkerDiedError.__qualname__ = "WorkerDiedError"
    return WorkerDiedError


def __getattr__(name: str) -> Any:
    if name != "WorkerDiedError":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Imported before the lock is taken: a first import of joblib registers memshare's backend, whose
    # module asks for this class in the same thread.
    from joblib.externals.loky.process_executor import TerminatedWorkerError

    with _made_lock:
        # A module global from now on: pickle and every later import find the same class.
        made = globals().get(name)
        if made is None:
            made = globals()[name] = _make_worker_died_error(TerminatedWorkerError)
    return made


class SharedMemoryFullError(OSError):
    """Neither shared memory nor the disk fallback has room for a file.

    An ``OSError`` with ``errno.ENOSPC``. Its message says how much was
    needed, how much is free where, and the fixes: give shared memory more
    room (``docker run --shm-size=...``), point ``MEMSHARE_TEMP_FOLDER`` at a
    larger folder, or raise ``max_nbytes`` (``None`` pickles arrays instead).

    Examples
    --------
    >>> import errno
    >>> from memshare import SharedMemoryFullError
    >>> issubclass(SharedMemoryFullError, OSError)
    True
    >>> SharedMemoryFullError(errno.ENOSPC, "no room for a 1.0 GiB array").errno == errno.ENOSPC
    True
    """


class SharedMemoryFallbackWarning(UserWarning):
    """Shared data took a slower way, or lives on disk.

    An array went to the disk temp folder because shared memory was full, a
    result that fitted in no file at all was pickled back to the parent, or
    the temp folder the user chose is on a disk file system. The call still
    succeeds; each case warns once per folder.

    Examples
    --------
    Turn it into an error where a fallback must not go unnoticed:

    >>> import warnings
    >>> from memshare import SharedMemoryFallbackWarning
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("error", SharedMemoryFallbackWarning)
    """


class SharedArrayCopiedWarning(UserWarning):
    """A writable shared array went by value to workers that do not share this process's memory.

    Another backend's pickler (Dask's, loky's named explicitly) copies it into
    each worker of another process or machine: writes there never reach the
    parent's array. :class:`Parallel` gives it at the first such task of a
    call. Run the call on memshare's backend or on threads, or return the
    values from the tasks.

    Examples
    --------
    >>> import warnings
    >>> import joblib
    >>> import numpy as np
    >>> import memshare
    >>> out = memshare.zeros(4)
    >>> with warnings.catch_warnings(record=True) as caught, joblib.parallel_config(backend="loky"):
    ...     warnings.simplefilter("always")
    ...     _ = memshare.Parallel(n_jobs=2)(memshare.delayed(np.copyto)(out, 1.0) for _ in range(2))
    >>> any(issubclass(w.category, memshare.SharedArrayCopiedWarning) for w in caught)
    True
    >>> out.tolist()  # the workers filled their copies
    [0.0, 0.0, 0.0, 0.0]
    """


class UnpicklableArgumentError(pickle.PicklingError, TypeError):
    """A task's function or arguments cannot be pickled to reach a worker.

    A ``pickle.PicklingError`` and a ``TypeError``. The call fails at once;
    a :class:`MemmappingPool` stays usable. Locks, open files, generators,
    sockets and database connections cannot be pickled: create them inside
    the task, or use threads.

    Examples
    --------
    >>> import threading
    >>> from memshare import Parallel, UnpicklableArgumentError, delayed
    >>> try:
    ...     Parallel(n_jobs=2)(delayed(id)(threading.Lock()) for _ in range(2))
    ... except UnpicklableArgumentError as exc:
    ...     print(type(exc).__name__)
    UnpicklableArgumentError
    """


class UnpicklableResultError(RuntimeError):
    """A task's return value or exception could not be pickled.

    The task ran in the worker, but what it returned or raised cannot travel
    back to the parent. Return plain data and build the rest in the parent.

    Examples
    --------
    >>> import threading
    >>> from memshare import Parallel, UnpicklableResultError, delayed
    >>> try:
    ...     Parallel(n_jobs=2)(delayed(threading.Lock)() for _ in range(2))
    ... except UnpicklableResultError as exc:
    ...     print("cannot be pickled" in str(exc))
    True
    """


class RemoteTraceback(Exception):
    """The worker-side traceback, attached as ``__cause__`` of a re-raised error.

    Never raised by itself: a task's own exception is raised again in the
    parent as itself, with a ``RemoteTraceback`` holding the worker's
    traceback as its cause, which Python prints above it.

    Examples
    --------
    >>> from memshare import Parallel, RemoteTraceback, delayed
    >>> try:
    ...     Parallel(n_jobs=2)(delayed(int)("x") for _ in range(2))
    ... except ValueError as exc:
    ...     print(isinstance(exc.__cause__, RemoteTraceback))
    True
    """

    def __str__(self) -> str:
        return "\n\n" + str(self.args[0])


_HINTS = {
    "SIGKILL": "it was killed, probably by the out-of-memory killer: use fewer workers or less memory per task",
    "SIGBUS": "shared memory is probably exhausted: give /dev/shm more room (docker run --shm-size=...) "
    "or set MEMSHARE_TEMP_FOLDER",
    "SIGSEGV": "it crashed in native code (segmentation fault)",
}


def describe_exit(exitcode: Optional[int]) -> str:
    """A human explanation of a worker's exit code, with a hint for common signals."""
    if exitcode is None or exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    hint = _HINTS.get(name)
    return f"was terminated by {name}" + (f" ({hint})" if hint else "")
