"""Checking ``MemmappingPool``'s arguments, which follow joblib's ``MemmappingPool``; the default start method.

joblib's order is ``(processes, temp_folder, max_nbytes, mmap_mode,
forward_reducers, backward_reducers, verbose, context_id, prewarm)``, while
``multiprocessing.Pool``'s is ``(processes, initializer, initargs,
maxtasksperchild, context)``. Code written for the standard pool that passes
those positionally lands them in joblib's slots; the checks here recognise
that and say so, instead of failing later in an obscure way (a callable used
as a folder) or silently.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.context
import sys
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, Optional

from .._payload._reducers import Reducers

_ORDER_HINT = (
    "MemmappingPool takes joblib's positional order (processes, temp_folder, max_nbytes, mmap_mode, "
    "forward_reducers, backward_reducers, verbose, context_id, prewarm); pass multiprocessing.Pool's "
    "initializer, initargs, maxtasksperchild and context as keywords"
)
#: What a callable ``temp_folder`` is told (``_config.check_temp_folder``): most likely the standard
#: pool's initializer, passed in joblib's position of the folder.
TEMP_FOLDER_HINT = f"{_ORDER_HINT}, e.g. MemmappingPool(2, initializer=setup). "


def check_processes(processes: Any) -> Optional[int]:
    if processes is not None and (isinstance(processes, bool) or not isinstance(processes, int) or processes < 1):
        raise ValueError(f"processes={processes!r}: pass a positive number of worker processes, or None for all CPUs")
    return processes


def check_max_nbytes(max_nbytes: Any) -> Any:
    """Recognise the standard pool's initargs (a tuple) before the size check rejects it obscurely."""
    if isinstance(max_nbytes, (tuple, list)):
        raise TypeError(f"max_nbytes={max_nbytes!r} is not a size. {_ORDER_HINT}.")
    return max_nbytes


def check_chunksize(chunksize: Any) -> int:
    """A chunk size given to ``map``/``imap``: a positive int (the standard pool hangs or misbehaves on others)."""
    if isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1:
        raise ValueError(
            f"chunksize={chunksize!r} is not a positive number of items per task: pass an int >= 1, "
            "or leave it out for map's default (about four chunks per worker)."
        )
    return chunksize


def check_reducers(name: str, reducers: Any) -> Dict[type, Callable]:
    """``reducers`` as a dict of type -> reducer function; None is empty."""
    if reducers is None:
        return {}
    if not isinstance(reducers, dict) or not all(
        isinstance(kind, type) and callable(reduce) for kind, reduce in reducers.items()
    ):
        raise TypeError(
            f"{name}={reducers!r} must be a dict mapping types to reducer functions that return "
            f"(constructor, args), as joblib takes. {_ORDER_HINT}."
        )
    return dict(reducers)


def check_verbose(verbose: Any) -> int:
    if not isinstance(verbose, int) or verbose < 0:  # bools are ints: True means 1
        raise TypeError(f"verbose={verbose!r} must be a non-negative integer. {_ORDER_HINT}.")
    return int(verbose)


def check_prewarm(prewarm: Any) -> None:
    """Accept joblib's values; there is nothing to warm (see ``MemmappingPool``)."""
    if not isinstance(prewarm, bool) and prewarm != "auto":
        raise TypeError(f"prewarm={prewarm!r} must be True, False or 'auto'. {_ORDER_HINT}.")


def check_context_id(context_id: Any) -> None:
    if context_id is not None:
        warnings.warn(
            "MemmappingPool: context_id has no effect (joblib deprecated it too); do not pass it",
            DeprecationWarning,
            stacklevel=3,
        )


def resolve_context(context: Any) -> Any:
    """The multiprocessing context to start workers with.

    None means memshare's default (see ``default_context``); a start method
    name (``"fork"``, ``"spawn"``, ``"forkserver"``) is accepted as well as a
    context object.
    """
    if context is None:
        return default_context()
    if isinstance(context, str):
        try:
            return mp.get_context(context)
        except ValueError:
            raise ValueError(
                f"context={context!r} is not a start method here: use one of {mp.get_all_start_methods()}"
            ) from None
    if not hasattr(context, "Process"):
        raise TypeError(f"context={context!r} is not a multiprocessing context. {_ORDER_HINT}.")
    return context


def default_context() -> Any:
    """``forkserver`` where it exists, else the standard default.

    Workers forked from a process whose memshare or pool threads are running
    may inherit locks held by those threads (Python 3.12 warns about it), and
    the standard pool forks replacement workers from its own thread. The fork
    server is single-threaded, so that never happens; it is also Python
    3.14's default. Tasks are pickled with cloudpickle, so functions defined
    in ``__main__`` or as lambdas work as with fork.
    """
    if "forkserver" in mp.get_all_start_methods():
        return mp.get_context("forkserver")
    return mp.get_context()


class _StartsWithoutPseudoMain:
    """A worker process that starts even when ``__main__`` came from standard input.

    Under forkserver and spawn, a new process re-runs the parent's
    ``__main__`` from its ``__file__``. A script piped to the interpreter
    (``python - < script.py``, a heredoc) has the ``__file__`` ``'<stdin>'``,
    which names no file, so every worker would die at start with
    ``FileNotFoundError``. Such a ``__main__`` is treated as ``python -c``
    treats its own: not re-run. memshare sends the functions of a
    ``__main__`` without a file by value (see ``_main_functions``), so the
    workers need nothing from it.

    The attribute is hidden only for the instant of ``start()``, which reads
    it synchronously, under a lock shared by all pools of the process (the
    worker handler thread of one pool may start a replacement worker while
    another pool starts its own).
    """

    def start(self) -> None:
        with pseudo_main_hidden():
            super().start()  # type: ignore[misc]


@contextlib.contextmanager
def pseudo_main_hidden() -> Iterator[None]:
    """While inside, a ``__main__`` from standard input (``__file__`` like ``'<stdin>'``) has no ``__file__``.

    For whatever reads it to start a process: a worker's ``start()``, and the
    fork server's own start, which preloads ``__main__`` from that path (from
    Python 3.14 a path that names no file kills the server, and with it every
    worker).
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not (isinstance(path, str) and path.startswith("<") and path.endswith(">")):
        yield
        return
    with _MAIN_FILE_LOCK:
        del main.__file__
        try:
            yield
        finally:
            main.__file__ = path


# Process-wide because __main__ is: every pool that hides its __file__ takes it.
_MAIN_FILE_LOCK = threading.Lock()

# Module level, so that the process object, pickled to the fork server or the
# spawned child, is found again there by name.
_PROCESS_CLASSES: Dict[type, type] = {}
for _name in ("ForkServerProcess", "SpawnProcess"):
    _base = getattr(multiprocessing.context, _name, None)
    if _base is not None:
        _PROCESS_CLASSES[_base] = type(_name, (_StartsWithoutPseudoMain, _base), {"__module__": __name__})
        globals()[_name] = _PROCESS_CLASSES[_base]
del _name, _base


def worker_process(context: Any, *args: Any, **kwargs: Any) -> Any:
    """A new worker process of ``context`` (not started): ``context.Process``, made safe for a piped ``__main__``."""
    process_class = _PROCESS_CLASSES.get(context.Process, context.Process)
    return process_class(*args, **kwargs)


__all__ = ["Reducers"]
