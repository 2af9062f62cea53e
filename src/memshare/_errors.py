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
        catches it too.
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
    """Neither shared memory nor the disk fallback has room for a file."""


class SharedMemoryFallbackWarning(UserWarning):
    """Shared data took a slower way, or lives on disk.

    An array went to the disk temp folder because shared memory was full, a
    result that fitted in no file at all was pickled back to the parent, or
    the temp folder the user chose is on a disk file system.
    """


class SharedArrayCopiedWarning(UserWarning):
    """A writable shared array went by value to workers that do not share this process's memory.

    Another backend's pickler (Dask's, loky's named explicitly) copies it into
    each worker of another process or machine: writes there never reach the
    parent's array.
    """


class UnpicklableArgumentError(pickle.PicklingError, TypeError):
    """A task's function or arguments cannot be pickled to reach a worker."""


class UnpicklableResultError(RuntimeError):
    """A task's return value or exception could not be pickled."""


class RemoteTraceback(Exception):
    """The worker-side traceback, attached as ``__cause__`` of a re-raised error."""

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
