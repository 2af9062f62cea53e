"""``MemmappingPool``: a ``multiprocessing.Pool`` that shares large arrays.

Each task is packed by the pool's :class:`Session`: large arrays are dumped
once and travel as file references. ``apply`` packs in the calling thread;
``map`` and ``imap`` pack lazily, in the pool's task-feeding thread, through
a :class:`TaskFeed` that turns a task that cannot be packed into the
failure of its call (see ``_feed``). Workers run ``run_task`` and send back
an ``Outcome``, which the pool turns back into the value, or the exception,
on the result thread before the standard machinery sees it.

Two gaps of the standard pool are closed: a worker that dies abruptly (killed,
segfault, out of memory) fails the pending results promptly and marks the
pool broken instead of hanging forever, and workers exit by themselves when
the parent dies.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from multiprocessing.pool import ApplyResult, IMapIterator, MapResult, Pool
from typing import Any, Callable, Iterable, Iterator, Optional

import cloudpickle

from ._config import Settings
from ._errors import WorkerDiedError, describe_exit
from ._feed import TaskFeed, run_or_return
from ._owners import owner_identity
from ._pool_args import (
    check_context_id,
    check_max_nbytes,
    check_prewarm,
    check_processes,
    check_reducers,
    check_temp_folder,
    check_verbose,
    resolve_context,
)
from ._reducers import Reducers
from ._session import Session
from ._stats import enable_logging
from ._worker import set_result_reducers, watch_parent

_MONITOR_INTERVAL = 0.1  # seconds between checks for dead workers


def _worker_init(owner: tuple, setup: bytes, initargs: tuple) -> None:
    watch_parent(*owner)
    # The initializer and the result reducers travel cloudpickled, so that
    # functions of __main__ and lambdas work under every start method; initargs
    # do not, so that multiprocessing locks and queues can still be inherited.
    initializer, backward_reducers = pickle.loads(setup)
    set_result_reducers(backward_reducers)
    if initializer is not None:
        initializer(*initargs)


class MemmappingPool(Pool):
    """A process pool whose workers receive large NumPy arrays as shared memory.

    The arguments are those of joblib's ``MemmappingPool``, in its order, and
    :class:`multiprocessing.pool.Pool`'s ``initializer``, ``initargs``,
    ``maxtasksperchild`` and ``context`` as keywords:

    processes
        Number of worker processes; None for all CPUs.
    temp_folder
        Where the pool's private folder goes; by default ``$MEMSHARE_TEMP_FOLDER``,
        ``$JOBLIB_TEMP_FOLDER``, ``/dev/shm``, then the system temp dir.
    max_nbytes
        Arrays larger than this (bytes, or a string such as ``"1M"``) are
        written once to a file in shared memory and mapped by the workers;
        None disables dumping. Arrays already backed by a file (``np.memmap``,
        memshare shared arrays, and their views) always go by reference.
        Large results come back the same way.
    mmap_mode
        How workers map dumped arrays: ``'r'`` read-only, ``'c'``
        copy-on-write, ``'r+'``/``'w+'`` writable and shared among workers.
    forward_reducers, backward_reducers
        Dicts mapping a type to a reducer function (returning
        ``(constructor, args)``, as ``copyreg`` takes), used when pickling
        task arguments and return values respectively. NumPy arrays are
        always memshare's.
    verbose
        Non-zero logs each sharing decision on the ``memshare`` logger.
    context_id
        Accepted for compatibility and ignored (joblib deprecated it).
    prewarm
        Accepted for compatibility (``True``, ``False`` or ``"auto"``); it has
        nothing to do. joblib reads each array back after dumping it, so that
        it is in the page cache before the workers map it; memshare's dumps
        are written with ``write()`` through the page cache (on ``/dev/shm``
        they are the memory itself), so they are there already.
    context
        A multiprocessing context or start method name; by default
        ``forkserver`` where it exists (see ``_pool_args.default_context``).

    The pool's folder is deleted by ``terminate()``, by ``close()`` then
    ``join()``, on leaving a ``with`` block, and at interpreter exit.
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
    ) -> None:
        processes = check_processes(processes)
        settings = Settings.from_user(check_max_nbytes(max_nbytes), mmap_mode, check_temp_folder(temp_folder))
        forward_reducers = check_reducers("forward_reducers", forward_reducers)
        backward_reducers = check_reducers("backward_reducers", backward_reducers)
        if check_verbose(verbose):
            enable_logging()
        check_prewarm(prewarm)
        check_context_id(context_id)
        context = resolve_context(context)
        setup = cloudpickle.dumps((initializer, backward_reducers))
        self._session = Session(settings, forward_reducers)
        self._feed = TaskFeed(self._session)  # before Pool.__init__: _setup_queues uses it
        self._stopping = False
        self._broken: Optional[BaseException] = None
        # Every worker ever started, recorded by Process() below. The pool's own
        # thread drops exited workers from its list at once (and starts
        # replacements), so a worker that starts and dies between two looks at
        # that list would go unnoticed and its task would hang forever.
        self._started: list = []
        self._started_lock = threading.Lock()
        try:
            super().__init__(
                processes, _worker_init, (owner_identity(), setup, tuple(initargs)), maxtasksperchild, context
            )
        except BaseException:
            self._session.close()
            raise
        self._monitor = threading.Thread(target=self._watch_workers, name="memshare-pool-monitor", daemon=True)
        self._monitor.start()

    def Process(self, ctx, *args, **kwds):  # noqa: N802 (Pool's name)
        process = super().Process(ctx, *args, **kwds)
        with self._started_lock:
            self._started.append(process)
        return process

    def __del__(self) -> None:
        # Pool.__del__ reads attributes that do not exist when __init__
        # rejected its arguments before the pool was set up.
        if "_state" in self.__dict__:
            super().__del__()

    # -- task submission ---------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken

    def apply_async(self, func, args=(), kwds={}, callback=None, error_callback=None):  # noqa: B006 (Pool's signature)
        self._check_usable()
        self._session.new_generation()
        task = self._session.pack_task(func, tuple(args), dict(kwds))
        return super().apply_async(run_or_return, (task,), {}, callback, error_callback)

    def map_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        return self._map(func, iterable, chunksize, callback, error_callback, star=False)

    def starmap_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        return self._map(func, iterable, chunksize, callback, error_callback, star=True)

    def map(self, func, iterable, chunksize=None, progress=False):
        """``Pool.map``; ``progress=True`` shows a tqdm bar on stderr."""
        if progress:
            return self._with_progress(func, iterable, chunksize, star=False)
        return self.map_async(func, iterable, chunksize).get()

    def starmap(self, func, iterable, chunksize=None, progress=False):
        """``Pool.starmap``; ``progress=True`` shows a tqdm bar on stderr."""
        if progress:
            return self._with_progress(func, iterable, chunksize, star=True)
        return self.starmap_async(func, iterable, chunksize).get()

    def imap(self, func, iterable, chunksize=1, progress=False):
        """``Pool.imap``; with ``progress=True`` the result is a generator that drives a tqdm bar."""
        self._check_usable()
        self._session.new_generation()
        results = super().imap(run_or_return, self._feed.lazy(func, iterable, star=False), chunksize)
        return _progress(results, _length(iterable)) if progress else results

    def imap_unordered(self, func, iterable, chunksize=1, progress=False):
        """``Pool.imap_unordered``; ``progress=True`` as for :meth:`imap`."""
        self._check_usable()
        self._session.new_generation()
        results = super().imap_unordered(run_or_return, self._feed.lazy(func, iterable, star=False), chunksize)
        return _progress(results, _length(iterable)) if progress else results

    def _with_progress(self, func, iterable, chunksize, star):
        # Per-task completion is only visible through imap; the chunking and
        # ordering of map are kept.
        self._check_usable()
        self._session.new_generation()
        items = list(iterable)
        if chunksize is None:
            chunksize = max(1, len(items) // (4 * self._processes) + bool(len(items) % (4 * self._processes)))
        tasks = self._feed.lazy(func, items, star)
        return list(_progress(super().imap(run_or_return, tasks, chunksize), len(items)))

    def _map(self, func, iterable, chunksize, callback, error_callback, star):
        self._check_usable()
        self._session.new_generation()
        tasks = self._feed.fill(func, list(iterable), star)
        return super().map_async(run_or_return, tasks, chunksize, callback, error_callback)

    # -- results -----------------------------------------------------------------

    def _setup_queues(self) -> None:
        super()._setup_queues()
        receive = self._quick_get  # read by Pool.__init__ right after this call
        restore = self._feed.restore

        def receive_and_restore():
            return restore(receive())

        self._quick_get = receive_and_restore

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        self._stopping = True
        super().close()

    def terminate(self) -> None:
        self._stopping = True
        try:
            super().terminate()
        finally:
            self._session.close()

    def join(self) -> None:
        super().join()
        self._session.close()

    @staticmethod
    def _help_stuff_finish(inqueue, task_handler, size):
        # Pool.terminate drains the task queue under its read lock. A worker
        # killed while waiting for a task never released that lock, and the
        # standard pool would then hang forever here; the workers are being
        # terminated anyway, so give up on draining after a moment.
        if not inqueue._rlock.acquire(timeout=1.0):
            return
        while task_handler.is_alive() and inqueue._reader.poll():
            inqueue._reader.recv()
            time.sleep(0)

    @property
    def temp_folder(self) -> str:
        """The path of this pool's folder in shared memory (created on first use)."""
        return self._session.folder.pair.primary

    def _watch_workers(self) -> None:
        """Fail pending results promptly when a worker dies abruptly."""
        while not self._stopping:
            time.sleep(_MONITOR_INTERVAL)
            with self._started_lock:
                started = list(self._started)
            for process in started:
                code = process.exitcode
                if code is None:
                    continue
                with self._started_lock:
                    self._started.remove(process)
                if code == 0 or self._stopping:
                    continue  # a normal exit (maxtasksperchild, shutdown)
                # An idle worker blocks in the task queue's read lock; killed
                # there, it takes the lock with it and no other worker can ever
                # receive a task. So the pool is broken, as concurrent.futures
                # says of its own: fail everything now rather than hang.
                hint = ""
                if code == 1 and self._ctx.get_start_method() != "fork":
                    hint = (
                        f" If it failed as it started (its error is above), note that under the "
                        f"{self._ctx.get_start_method()} start method a script must create the pool under "
                        "`if __name__ == '__main__':`, or pass context='fork'."
                    )
                self._broken = WorkerDiedError(
                    f"memshare: worker process {process.pid} {describe_exit(code)}. Its pool cannot run "
                    f"tasks any more: terminate it and create a new one.{hint}"
                )
                self._fail_pending(self._broken)

    def _fail_pending(self, error: BaseException) -> None:
        # The standard result objects have no public way to fail them; _set is
        # what the pool's own result thread calls, with the same arguments.
        for result in list(self._cache.values()):
            try:
                if isinstance(result, IMapIterator):
                    index = result._index
                    result._set(index, (False, error))
                    result._set_length(index + 1)
                elif isinstance(result, MapResult):
                    while not result.ready():
                        result._set(0, (False, error))
                elif isinstance(result, ApplyResult):
                    result._set(0, (False, error))
            except (KeyError, IndexError, TypeError):
                pass  # finished concurrently


def _length(iterable: Any) -> Optional[int]:
    return len(iterable) if hasattr(iterable, "__len__") else None


def _progress(results: Iterable, total: Optional[int]) -> Iterator:
    """Yield ``results`` while a tqdm bar on stderr counts them."""
    from tqdm.auto import tqdm

    with tqdm(total=total, file=sys.stderr, unit="task", desc="memshare", dynamic_ncols=True) as bar:
        for result in results:
            bar.update(1)
            yield result


MemmapingPool = MemmappingPool
