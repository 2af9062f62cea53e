"""``memshare.Parallel`` and ``memshare.delayed``: joblib's API, memshare's backend.

``Parallel`` is joblib's ``Parallel`` with one difference: when no backend is
given, no ``joblib.parallel_config`` chooses one and the call does not ask
for threads (``prefer="threads"``, ``require="sharedmem"``), it runs on the
``"memshare"`` backend. A backend named either way (``"loky"``,
``"threading"``, ``"dask"``...) is used unchanged, so the same code moves to a
Dask cluster under ``joblib.parallel_config(backend="dask")``.
``Parallel(backend="dask")`` fails in joblib itself with recent ``distributed``
(joblib 1.6 with distributed 2026.8: a ``TypeError`` about ``nesting_level``).

On a backend whose workers get copies of the arguments (Dask's, loky or
multiprocessing named explicitly), a writable shared array (``memshare.zeros``...)
arrives by value, so writes into it are lost: the first task that takes one
raises a ``SharedArrayCopiedWarning`` naming the fixes.

Inside a worker, joblib makes nested calls use threads or run sequentially,
so that processes are not spawned without bound; ``Parallel`` keeps that
rule, because the nested configuration is an active backend.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple

import joblib
from joblib import delayed
from joblib.parallel import BACKENDS, get_active_backend

from ._compat import iterator_exhausted, parallel_backend, parallel_config_options
from ._config import parse_max_nbytes
from ._errors import SharedArrayCopiedWarning
from ._numpy import np
from ._transport._shared_store import views_shared_array
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


def _takes_writable_shared(args: tuple, kwargs: dict) -> bool:
    """True when a call's arguments hold a writable shared array (in containers two levels deep at most)."""
    pending = [(value, 0) for value in (*args, *kwargs.values())]
    budget = 256
    while pending and budget:
        value, depth = pending.pop()
        budget -= 1
        if isinstance(value, np.ndarray):
            if value.flags.writeable and views_shared_array(value):
                return True
        elif depth < 2 and type(value) in (list, tuple, dict):
            items = list(value.values() if type(value) is dict else value)[:64]
            pending.extend((item, depth + 1) for item in items)
    return False


def _copying_backend_name(backend: Any) -> Optional[str]:
    """The name of ``backend`` when its workers get copies of the arguments; None when they share this memory."""
    if backend is None or isinstance(backend, MemshareBackend) or getattr(backend, "supports_sharedmem", False):
        return None
    names = [name for name, cls in BACKENDS.items() if cls is type(backend)]
    return names[0] if names else type(backend).__name__


def _runs_here(backend: Any, n_jobs: Any) -> bool:
    """True when the call's tasks run in this process, with its memory.

    One job (joblib then calls no worker), or a Dask cluster whose workers
    all run in this process (``LocalCluster(processes=False)``: addresses
    ``inproc://``), where tasks get the arguments themselves.
    """
    try:
        if backend.effective_n_jobs(n_jobs) == 1:
            return True
        client = getattr(backend, "client", None)
        workers = list(client.scheduler_info()["workers"]) if client is not None else []
        return bool(workers) and all(str(address).startswith("inproc://") for address in workers)
    except Exception:  # a backend that cannot tell: its workers may get copies
        return False


def _copied_message(backend_name: str) -> str:
    return (
        f"memshare: a task on joblib's {backend_name!r} backend takes a writable shared array (memshare.zeros, "
        "empty, full or share, or a view of one): that backend pickles it, so each worker in another process or "
        "on another machine gets a copy, and what tasks write into it never reaches this array. To fill a shared "
        "array, run the call on memshare's backend (memshare.Parallel with no backend named, or "
        "joblib.parallel_config(backend='memshare')) or on threads; on a cluster, return the values from the "
        "tasks and assemble them here."
    )


class _Watched:
    """A call's tasks, looked at as joblib takes them while ``copying`` names the backend that copies arguments.

    ``copying`` is asked when the first task is taken, once joblib has set
    its backend up; ``warn_of`` is given each task and that name until it
    returns True (it warned).
    """

    def __init__(
        self, iterable: Iterable, copying: Callable[[], Optional[str]], warn_of: Callable[[Any, str], bool]
    ) -> None:
        self._iterable, self._copying, self._warn_of = iterable, copying, warn_of

    def __iter__(self) -> Iterator:
        name: Optional[str] = None
        for index, task in enumerate(self._iterable):
            if index == 0:
                name = self._copying()
            if name is not None and self._warn_of(task, name):
                name = None
            yield task


def _warn_of_shared(task: Any, backend_name: str) -> bool:
    """Warn, and return True, when ``task`` (a delayed call) gives a writable shared array to the backend's workers."""
    try:
        _, args, kwargs = task
    except (TypeError, ValueError):
        return False  # not a delayed call: joblib reports it
    if not _takes_writable_shared(tuple(args), dict(kwargs)):
        return False
    # Raised in joblib's code as it takes the task: the user's frame is several levels up.
    warnings.warn(_copied_message(backend_name), SharedArrayCopiedWarning, stacklevel=2)
    return True


class _WatchedSized(_Watched):
    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]


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
    with ``parallel_config(backend="dask")`` (the manual's "joblib and scikit-learn"
    page says what then travels how).

    ``progress=True`` shows a tqdm bar (``tqdm.auto``: on stderr in a
    terminal, a widget in Jupyter): tasks done out of the total, rate and
    ETA. The total of an iterable without a length, such as a generator, is
    known once joblib has taken its last task; until then the bar counts
    tasks. It works with every ``return_as``; it is off by default.

    Parameters
    ----------
    n_jobs : int, optional
        Number of workers, by joblib's rules: -1 for all CPUs, None for
        joblib's default (one, unless a ``parallel_config`` says otherwise).
    backend : str or joblib backend, optional
        None (default) runs on ``"memshare"`` unless a
        ``joblib.parallel_config`` names a backend or the call asks for threads
        (``prefer="threads"``, ``require="sharedmem"``).
    *args, **kwargs
        joblib's ``Parallel`` arguments, in its order: ``return_as``,
        ``prefer``, ``require``, ``verbose``, ``timeout``, ``pre_dispatch``,
        ``batch_size``, ``temp_folder``, ``max_nbytes``, ``mmap_mode``...
        ``max_nbytes`` (default ``"1M"``) takes memshare's sizes.
    progress : bool, optional
        Show a tqdm progress bar (keyword only; default False).

    Raises
    ------
    ValueError, TypeError
        ``max_nbytes`` is not a size, or another argument is not one joblib
        accepts.

    Warns
    -----
    SharedArrayCopiedWarning
        A task gives a writable shared array to a backend whose workers get a
        copy of it.

    See Also
    --------
    MemmappingPool : the same sharing as a ``multiprocessing.Pool``.
    joblib.Parallel : the base class, whose arguments all work here.

    Examples
    --------
    >>> import numpy as np
    >>> from memshare import Parallel, delayed
    >>> X = np.arange(1_000_000, dtype=np.float64)  # 8 MB: written once, mapped by the workers
    >>> [float(s) for s in Parallel(n_jobs=2)(delayed(np.sum)(X[i::2]) for i in range(2))]
    [249999500000.0, 250000000000.0]
    >>> list(Parallel(n_jobs=2, return_as="generator")(delayed(abs)(-i) for i in range(3)))
    [0, 1, 2]
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
        """Run the tasks of ``iterable`` and return their results.

        Parameters
        ----------
        iterable : iterable of tasks
            Tasks made with :func:`delayed`: ``delayed(func)(*args, **kwargs)``.

        Returns
        -------
        list or generator
            The tasks' results in order; a generator for
            ``return_as="generator"`` (in order) or
            ``"generator_unordered"`` (as they complete).

        Raises
        ------
        Exception
            The first exception a task raised, as itself, with the worker's
            traceback as a :class:`RemoteTraceback` cause.
        UnpicklableArgumentError
            A task's function or arguments cannot be pickled.
        UnpicklableResultError
            A task's result or exception cannot be pickled.
        WorkerDiedError
            A worker died abruptly while tasks were pending.

        Examples
        --------
        >>> from memshare import Parallel, delayed
        >>> Parallel(n_jobs=2)(delayed(divmod)(i, 3) for i in range(5))
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
        """
        iterable = (_WatchedSized if hasattr(iterable, "__len__") else _Watched)(
            iterable, self._copying_backend, _warn_of_shared
        )
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

    def _copying_backend(self) -> Optional[str]:
        """The name of the backend this call runs on when its workers get copies of the arguments, else None.

        Asked once joblib has set the backend up: one job runs the call here.
        """
        backend = parallel_backend(self)
        name = _copying_backend_name(backend)
        return None if name is None or _runs_here(backend, self.n_jobs) else name

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
