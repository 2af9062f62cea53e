"""``MemmappingPool``: a ``multiprocessing.Pool`` that shares large arrays.

Each task is packed by the pool's :class:`Session`: large arrays are dumped
once and travel as file references. ``apply`` packs in the calling thread;
``map`` and ``imap`` pack lazily, in the pool's task-feeding thread, through
a :class:`TaskFeed` that turns a task that cannot be packed into the
failure of its call (see ``_feed``). Workers run ``run_task`` and send back
an ``Outcome``, which the pool turns back into the value, or the exception,
on the result thread before the standard machinery sees it. Tasks and
outcomes travel as tuples, the session's result spec once per worker (see
``_feed``).

Two gaps of the standard pool are closed: a worker that dies abruptly (killed,
segfault, out of memory) fails the pending results promptly and marks the
pool broken instead of hanging forever (``_worker_watch``), and workers exit
by themselves when the parent dies.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Iterable, Optional

import cloudpickle

from ._compat import (
    PoolWithHooks,
    pending_results,
    pool_size,
    pool_terminator,
    pool_workers,
    start_fork_server_with,
    worker_process,
)
from ._config import Settings, check_temp_folder
from ._frontends._feed import TaskFeed
from ._frontends._pool_args import (
    TEMP_FOLDER_HINT,
    check_chunksize,
    check_context_id,
    check_max_nbytes,
    check_prewarm,
    check_processes,
    check_reducers,
    check_verbose,
    resolve_context,
)
from ._frontends._pool_results import ChunkedMapResult, join_chunks, length_of, with_progress_bar
from ._frontends._worker_watch import WorkerWatch
from ._lifetime._owners import owner_identity
from ._numpy import numpy_imported
from ._parent._session import Session
from ._payload._main_functions import MainFunctions
from ._payload._reducers import Reducers
from ._stats import enable_logging
from ._worker._entry import run_pool_task, start_pool_worker


class MemmappingPool(PoolWithHooks):
    """A process pool whose workers receive large NumPy arrays as shared memory.

    A drop-in :class:`multiprocessing.pool.Pool`: its whole API works, and
    ``map``, ``starmap``, ``imap`` and ``imap_unordered`` also take
    ``progress=True``. The arguments are those of joblib's
    ``MemmappingPool``, in its order, and :class:`multiprocessing.pool.Pool`'s
    ``initializer``, ``initargs``, ``maxtasksperchild`` and ``context`` as
    keywords.

    Parameters
    ----------
    processes : int, optional
        Number of worker processes; None for all CPUs.
    temp_folder : str or os.PathLike, optional
        Where the pool's private folder goes; by default ``$MEMSHARE_TEMP_FOLDER``,
        ``$JOBLIB_TEMP_FOLDER``, ``/dev/shm``, then the system temp dir.
    max_nbytes : int, float, str or None, optional
        Arrays larger than this (bytes, or a string such as ``"1M"``) are
        written once to a file in shared memory and mapped by the workers;
        None disables dumping. Arrays already backed by a file (``np.memmap``,
        memshare shared arrays, and their views) always go by reference.
        Large results come back the same way. Default ``"1M"``.
    mmap_mode : {'r', 'c', 'r+', 'w+'}, optional
        How workers map dumped arrays: ``'r'`` read-only (default), ``'c'``
        copy-on-write, ``'r+'``/``'w+'`` writable and shared among workers.
    forward_reducers, backward_reducers : dict, optional
        Dicts mapping a type to a reducer function (returning
        ``(constructor, args)``, as ``copyreg`` takes), used when pickling
        task arguments and return values respectively. NumPy arrays are
        always memshare's.
    verbose : int, optional
        Non-zero logs each sharing decision on the ``memshare`` logger.
    context_id : object, optional
        Accepted for compatibility and ignored (joblib deprecated it); a
        value other than None warns ``DeprecationWarning``.
    prewarm : bool or "auto", optional
        Accepted for compatibility; it has nothing to do. joblib reads each
        array back after dumping it, so that it is in the page cache before
        the workers map it; memshare's dumps are written with ``write()``
        through the page cache (on ``/dev/shm`` they are the memory itself),
        so they are there already.
    initializer : callable, optional
        Called in every worker as it starts, with ``initargs``.
    initargs : iterable, optional
        The initializer's arguments.
    maxtasksperchild : int, optional
        Tasks a worker runs before it is replaced; None for no limit.
    context : multiprocessing context or str, optional
        A multiprocessing context or start method name; by default
        ``forkserver`` where it exists.
    promote : bool, optional
        Whether a large ordinary array, once sent, keeps its data in its
        shared file instead of a second copy (see the manual, "Arrays held
        once"); None (default) reads ``$MEMSHARE_PROMOTE``, which defaults to on.

    Raises
    ------
    ValueError, TypeError
        An argument has a value the pool cannot use (a bad ``max_nbytes``,
        ``mmap_mode``, ``temp_folder``, ``processes``, reducer or context);
        the message names the accepted forms.
    UnpicklableArgumentError
        From a call whose function or arguments cannot be pickled (the call
        fails; the pool stays usable).
    WorkerDiedError
        From the pending calls when a worker dies abruptly; the pool is broken
        then.

    See Also
    --------
    Parallel : the same sharing through joblib.

    Notes
    -----
    The pool's folder is deleted by ``terminate()``, by ``close()`` then
    ``join()``, on leaving a ``with`` block, and at interpreter exit; a
    running pool collected unclosed warns (``ResourceWarning``), ends its
    workers and deletes its folder. Under the default ``forkserver`` and
    under ``spawn``, a script that makes a pool needs an
    ``if __name__ == "__main__":`` guard.

    Examples
    --------
    >>> import numpy as np
    >>> from memshare import MemmappingPool
    >>> X = np.ones((500, 500))  # 2 MB: written once for every task
    >>> with MemmappingPool(2) as pool:
    ...     sums = pool.map(np.sum, [X] * 4)
    >>> [float(x) for x in sums]
    [250000.0, 250000.0, 250000.0, 250000.0]
    """

    def __init__(
        self,
        processes: Optional[int] = None,
        temp_folder: Optional[str] = None,
        max_nbytes: Any = "1M",
        mmap_mode: str = "r",
        forward_reducers: Optional[Reducers] = None,
        backward_reducers: Optional[Reducers] = None,
        verbose: int = 0,
        context_id: Any = None,
        prewarm: Any = False,
        *,
        initializer: Optional[Callable] = None,
        initargs: Iterable = (),
        maxtasksperchild: Optional[int] = None,
        context: Any = None,
        promote: Optional[bool] = None,
    ) -> None:
        processes = check_processes(processes)
        max_nbytes = check_max_nbytes(max_nbytes)
        temp_folder = check_temp_folder(temp_folder, TEMP_FOLDER_HINT)
        settings = Settings.from_user(max_nbytes, mmap_mode, temp_folder, promote)
        forward_reducers = check_reducers("forward_reducers", forward_reducers)
        backward_reducers = check_reducers("backward_reducers", backward_reducers)
        if check_verbose(verbose):
            enable_logging()
        check_prewarm(prewarm)
        check_context_id(context_id)
        context = resolve_context(context)
        if context.get_start_method() == "forkserver":
            # Workers forked from a server that has imported what they run (memshare's worker side, not
            # joblib: see _registration) start at once; otherwise each imports it, and a replacement worker
            # pays that again. numpy too, once this process has it: it will send arrays. Started now, not by
            # the first worker: the server imports while this process sets up the pool's session.
            start_fork_server_with("memshare._worker._entry", *(("numpy",) if numpy_imported() else ()))
        self._session = Session(
            settings, forward_reducers, "use a multiprocessing.pool.ThreadPool (threads need no pickling)"
        )
        try:
            setup = cloudpickle.dumps((initializer, backward_reducers, self._session.results))
        except BaseException:
            self._session.close()
            raise
        # Pool starts every worker through self.Process, which its worker
        # thread keeps: a method of the watch, not of the pool, so that the
        # thread does not keep alive a pool nobody closes.
        self._watch = watch = WorkerWatch(context.get_start_method(), worker_process)
        # The result thread keeps the feed: what it holds must not hold the pool (the watch does not).
        self._feed = TaskFeed(
            self._session,
            MainFunctions(context.get_start_method()),
            workers=processes or os.cpu_count() or 1,
            stopped=lambda: watch.broken is not None,
        )
        self.Process = self._watch.new_process
        try:
            # Each worker's message is restored on the result thread, before
            # the standard machinery sees it, by the feed (not the pool: that
            # thread keeps what it is given).
            super().__init__(
                processes,
                start_pool_worker,
                (owner_identity(), setup, tuple(initargs)),
                maxtasksperchild,
                context,
                message_filter=self._feed.restore,
                results_abandoned=lambda: watch.results_abandoned,
            )
        except BaseException:
            self._session.close()
            self._watch.close()
            raise
        self._watch.start(pool_workers(self), pending_results(self), pool_terminator(self))
        # A pool collected unclosed stops its watch (Pool's own finalizer ends
        # the workers); at exit the watch's daemon thread just ends.
        self._close_watch = weakref.finalize(self, self._watch.close)
        self._close_watch.atexit = False

    # -- task submission ---------------------------------------------------------

    def _check_usable(self) -> None:
        if self._watch.broken is not None:
            raise self._watch.broken

    def apply_async(self, func, args=(), kwds={}, callback=None, error_callback=None):  # noqa: B006 (Pool's signature)
        self._check_usable()
        self._session.new_generation()
        task = self._feed.pack_call(func, tuple(args), dict(kwds))
        return super().apply_async(run_pool_task, (task,), {}, callback, error_callback)

    def map_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        return self._map(func, iterable, chunksize, callback, error_callback, star=False)

    def starmap_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        return self._map(func, iterable, chunksize, callback, error_callback, star=True)

    def map(self, func, iterable, chunksize=None, progress=False):
        """``Pool.map``; ``progress=True`` shows a tqdm bar on stderr.

        Parameters
        ----------
        func : callable
            Called with each item.
        iterable : iterable
            The items; an array repeated across items is written once.
        chunksize : int, optional
            Items per task; by default about four chunks per worker.
        progress : bool, optional
            Show a progress bar (default False).

        Returns
        -------
        list
            ``func(item)`` for each item, in order.

        Raises
        ------
        Exception
            The first exception a task raised, as itself.
        UnpicklableArgumentError, WorkerDiedError
            As for the pool.

        Examples
        --------
        >>> from memshare import MemmappingPool
        >>> with MemmappingPool(2) as pool:
        ...     pool.map(abs, [-1, -2, 3])
        [1, 2, 3]
        """
        if progress:
            return self._with_progress(func, iterable, chunksize, star=False)
        return self.map_async(func, iterable, chunksize).get()

    def starmap(self, func, iterable, chunksize=None, progress=False):
        """``Pool.starmap``; ``progress=True`` shows a tqdm bar on stderr.

        Parameters
        ----------
        func : callable
            Called with each item's elements as arguments.
        iterable : iterable of iterables
            The argument tuples.
        chunksize : int, optional
            Items per task; by default about four chunks per worker.
        progress : bool, optional
            Show a progress bar (default False).

        Returns
        -------
        list
            ``func(*item)`` for each item, in order.

        Raises
        ------
        Exception
            The first exception a task raised, as itself.

        Examples
        --------
        >>> from memshare import MemmappingPool
        >>> with MemmappingPool(2) as pool:
        ...     pool.starmap(pow, [(2, 3), (3, 2)])
        [8, 9]
        """
        if progress:
            return self._with_progress(func, iterable, chunksize, star=True)
        return self.starmap_async(func, iterable, chunksize).get()

    def imap(self, func, iterable, chunksize=1, progress=False):
        """``Pool.imap``; with ``progress=True`` the result is a generator that drives a tqdm bar.

        Parameters
        ----------
        func : callable
            Called with each item.
        iterable : iterable
            The items, taken lazily.
        chunksize : int, optional
            Items per task (default 1).
        progress : bool, optional
            Show a progress bar (default False).

        Returns
        -------
        iterator
            ``func(item)`` for each item, in order, as they complete.

        Raises
        ------
        Exception
            A task's exception, as itself, when its result is reached.

        Examples
        --------
        >>> from memshare import MemmappingPool
        >>> with MemmappingPool(2) as pool:
        ...     list(pool.imap(abs, [-1, -2]))
        [1, 2]
        """
        return self._imap(super().imap, func, iterable, chunksize, progress)

    def imap_unordered(self, func, iterable, chunksize=1, progress=False):
        """``Pool.imap_unordered``; ``progress=True`` as for :meth:`imap`.

        Parameters
        ----------
        func : callable
            Called with each item.
        iterable : iterable
            The items, taken lazily.
        chunksize : int, optional
            Items per task (default 1).
        progress : bool, optional
            Show a progress bar (default False).

        Returns
        -------
        iterator
            ``func(item)`` for each item, in the order they complete.

        Raises
        ------
        Exception
            A task's exception, as itself, when its result is reached.

        Examples
        --------
        >>> from memshare import MemmappingPool
        >>> with MemmappingPool(2) as pool:
        ...     sorted(pool.imap_unordered(abs, [-1, -2]))
        [1, 2]
        """
        return self._imap(super().imap_unordered, func, iterable, chunksize, progress)

    def _imap(self, imap, func, iterable, chunksize, progress):
        chunksize = check_chunksize(chunksize)
        self._check_usable()
        self._session.new_generation()
        results = imap(run_pool_task, self._feed.lazy(func, iterable, False, chunksize), 1)
        if chunksize > 1:  # each result is a chunk's list, as in the standard pool
            results = (value for chunk in results for value in chunk)
        return with_progress_bar(results, length_of(iterable)) if progress else results

    def _with_progress(self, func, iterable, chunksize, star):
        # Per-chunk completion is only visible through imap; the chunking and
        # ordering of map are kept.
        self._check_usable()
        self._session.new_generation()
        items = list(iterable)
        chunksize = self._map_chunksize(len(items), chunksize)
        chunks = super().imap(run_pool_task, self._feed.fill(func, items, star, chunksize), 1)
        return list(with_progress_bar((value for chunk in chunks for value in chunk), len(items)))

    def _map(self, func, iterable, chunksize, callback, error_callback, star):
        self._check_usable()
        self._session.new_generation()
        items = list(iterable)
        chunksize = self._map_chunksize(len(items), chunksize)
        tasks = self._feed.fill(func, items, star, chunksize)
        # One task per chunk, whose value is the chunk's list: the standard
        # result object collects the lists, ChunkedMapResult joins them.
        joined_callback = None if callback is None else (lambda chunks: callback(join_chunks(chunks)))
        return ChunkedMapResult(super().map_async(run_pool_task, tasks, 1, joined_callback, error_callback))

    def _map_chunksize(self, length: int, chunksize: Optional[int]) -> int:
        """``chunksize``, or the standard pool's default: about four chunks per worker."""
        if chunksize is not None:
            return check_chunksize(chunksize)
        chunks, extra = divmod(length, 4 * pool_size(self))
        return max(1, chunks + bool(extra))

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        self._watch.pool_closed()  # a worker that dies abruptly while the pool finishes still fails it
        super().close()

    def terminate(self) -> None:
        self._feed.stop()  # a map waiting for room in the task thread goes on, so that the thread can end
        self._watch.stop()  # before the workers are ended: their exits are no failure
        try:
            super().terminate()
        finally:
            self._close_watch()  # first: the watch may be ending the pool itself, for a worker that died
            self._session.close()

    def join(self) -> None:
        super().join()
        self._close_watch()
        self._session.close()

    @property
    def temp_folder(self) -> str:
        """The path of this pool's folder in shared memory (created on first use)."""
        return self._session.folder.pair.primary


MemmapingPool = MemmappingPool
