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

import multiprocessing as mp
import multiprocessing.context
import warnings
from typing import Any, Callable, Dict, Optional

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


__all__ = ["Reducers"]
