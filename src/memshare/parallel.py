"""``memshare.Parallel`` and ``memshare.delayed``: joblib's API, memshare's backend.

``Parallel`` is joblib's ``Parallel`` with one difference: when no backend is
given, no ``joblib.parallel_config`` chooses one and the call does not ask
for threads (``prefer="threads"``, ``require="sharedmem"``), it runs on the
``"memshare"`` backend. A backend named either way (``"loky"``,
``"threading"``, ``"dask"``...) is used unchanged, so the same code moves to a
Dask cluster under ``joblib.parallel_config(backend="dask")``.
``Parallel(backend="dask")`` fails in joblib itself with recent ``distributed``
(joblib 1.6 with distributed 2026.8: a ``TypeError`` about ``nesting_level``).

Inside a worker, joblib makes nested calls use threads or run sequentially,
so that processes are not spawned without bound; ``Parallel`` keeps that
rule, because the nested configuration is an active backend.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Iterator, Optional, Tuple

import joblib
from joblib import delayed
from joblib.parallel import get_active_backend

from ._compat import iterator_exhausted, parallel_config_options
from ._config import parse_max_nbytes
from .backend import BACKEND_NAME, MemshareBackend


def _no_backend_chosen() -> bool:
    """True when joblib would fall back to its own default backend.

    joblib's default is a top-level ``LokyBackend`` that no
    ``parallel_config`` named (one that names ``"loky"`` gives the same
    type); a nested call sees a ``ThreadingBackend`` or ``SequentialBackend``
    with a nesting level, and a ``parallel_config`` sees the backend it named.
    """
    backend, _ = get_active_backend()
    if "backend" in parallel_config_options():
        return False
    return type(backend).__name__ == "LokyBackend" and not backend.nesting_level


_JOBLIB_PARAMETERS = list(inspect.signature(joblib.Parallel.__init__).parameters)


def _asks_for_threads(args: tuple, kwargs: dict) -> bool:
    """True for ``prefer="threads"`` or ``require="sharedmem"``: with no backend named, joblib then uses threads.

    memshare's backend runs processes, so it is not the default for a call
    that asks for threads: joblib chooses, as it would without memshare.
    """
    given = dict(zip(_JOBLIB_PARAMETERS[3:], args), **kwargs)  # after self, n_jobs and backend
    return given.get("prefer") == "threads" or given.get("require") == "sharedmem"


_MAX_NBYTES_DEFAULT = inspect.signature(joblib.Parallel.__init__).parameters["max_nbytes"].default


def _with_max_nbytes_parsed(args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """``Parallel``'s arguments after ``n_jobs`` and ``backend``, with ``max_nbytes`` in bytes.

    joblib parses a string ``max_nbytes`` itself, with a narrower grammar
    than memshare's (no ``"10 KiB"``, ``"1 GB"`` or ``"0"``) and its own
    message. Parsing it here first gives ``Parallel`` and ``MemmappingPool``
    one grammar and one error, whatever the backend.
    """
    position = _JOBLIB_PARAMETERS.index("max_nbytes") - 3  # after self, n_jobs and backend
    if "max_nbytes" in kwargs:
        if kwargs["max_nbytes"] is not _MAX_NBYTES_DEFAULT:
            kwargs = {**kwargs, "max_nbytes": parse_max_nbytes(kwargs["max_nbytes"])}
    elif len(args) > position and args[position] is not _MAX_NBYTES_DEFAULT:
        args = args[:position] + (parse_max_nbytes(args[position]),) + args[position + 1 :]
    return args, kwargs


class Parallel(joblib.Parallel):
    """joblib's ``Parallel``, running on memshare's backend by default.

    All of joblib's arguments work as documented by joblib
    (``n_jobs``, ``backend``, ``return_as``, ``timeout``, ``batch_size``,
    ``pre_dispatch``, ``max_nbytes``, ``mmap_mode``, ``temp_folder``...).
    Results larger than ``max_nbytes`` come back through shared memory.
    ``max_nbytes`` is read by memshare's parser whatever the backend, so it
    takes the same sizes as ``MemmappingPool`` (``"10 KiB"``, ``"1 GB"``,
    ``"0"`` as well as joblib's ``"1M"``). A backend named here or by a
    ``joblib.parallel_config`` is used instead of memshare's; on Dask, name it
    with ``parallel_config(backend="dask")`` (see the module's docstring).

    ``progress=True`` shows a tqdm bar (``tqdm.auto``: on stderr in a
    terminal, a widget in Jupyter): tasks done out of the total, rate and
    ETA. The total of an iterable without a length, such as a generator, is
    known once joblib has taken its last task; until then the bar counts
    tasks. It works with every ``return_as``; it is off by default.
    """

    def __init__(self, n_jobs=None, backend=None, *args, progress: bool = False, **kwargs):
        if backend is None and _no_backend_chosen() and not _asks_for_threads(args, kwargs):
            backend = BACKEND_NAME
        args, kwargs = _with_max_nbytes_parsed(args, kwargs)
        super().__init__(n_jobs, backend, *args, **kwargs)
        self.progress = bool(progress)
        self._bar: Optional[Any] = None
        self._dispatched_all = False

    def __call__(self, iterable):
        if not self.progress:
            return super().__call__(iterable)
        from tqdm.auto import tqdm

        total = len(iterable) if hasattr(iterable, "__len__") else None
        self._dispatched_all = False
        self._bar = tqdm(total=total, file=sys.stderr, unit="task", desc="memshare", dynamic_ncols=True)
        try:
            output = super().__call__(iterable)
        except BaseException:
            self._close_bar()
            raise
        self._dispatched_all = True
        if self.return_generator:
            return self._close_bar_after(output)
        self._close_bar()
        return output

    def print_progress(self) -> None:
        # joblib calls this after every completed batch, from whichever
        # thread completed it, holding the call's lock; tqdm serialises its
        # own updates.
        super().print_progress()
        bar = self._bar
        if bar is not None:
            if bar.total is None and self._dispatch_finished():
                bar.total = self.n_dispatched_tasks  # from now on the bar shows n/total and an ETA
            bar.update(self.n_completed_tasks - bar.n)

    def _dispatch_finished(self) -> bool:
        """True once joblib has taken the last task from the iterable, so ``n_dispatched_tasks`` is the total.

        joblib drops its reference to the iterable when it finds it exhausted
        (or when the call ends), which is how its own ``verbose`` output learns
        the total of a generator. With ``pre_dispatch="all"`` the reference is
        dropped before dispatching starts: the total is known once joblib's
        ``__call__`` has returned, after dispatching everything.
        """
        if self.pre_dispatch == "all" and not self._dispatched_all:
            return False
        return iterator_exhausted(self)

    def _close_bar_after(self, output: Iterator) -> Iterator:
        try:
            yield from output
        finally:
            self._close_bar()

    def _close_bar(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            if bar.total is None and self._dispatch_finished():
                bar.total = self.n_dispatched_tasks
            bar.update(max(self.n_completed_tasks, getattr(self, "n_dispatched_tasks", 0)) - bar.n)
            bar.close()


__all__ = ["MemshareBackend", "Parallel", "delayed"]
