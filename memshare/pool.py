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

import os
import pickle
import sys
import threading
from multiprocessing.connection import wait
from multiprocessing.pool import Pool
from typing import Any, Callable, Iterable, Iterator, Optional

import cloudpickle

from . import _forksafe
from ._compat import drain_task_queue, fail_pool_result, pending_pool_results, pool_size, preload_in_fork_server
from ._config import Settings
from ._errors import WorkerDiedError, describe_exit
from ._feed import TaskFeed, run_or_return
from ._owners import owner_identity
from ._pool_args import (
    check_chunksize,
    check_context_id,
    check_max_nbytes,
    check_prewarm,
    check_processes,
    check_reducers,
    check_temp_folder,
    check_verbose,
    resolve_context,
    worker_process,
)
from ._reducers import Reducers
from ._session import Session
from ._stats import enable_logging
from ._worker import set_result_reducers, watch_parent

_LOOK_AGAIN = 0.05  # seconds: wait for a recorded worker to start, or an ended one to be reaped


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
    promote
        Whether a large ordinary array, once sent, keeps its data in its
        shared file instead of a second copy (see README, "Arrays held
        once"); None (default) reads ``$MEMSHARE_PROMOTE``, which defaults to on.
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
        promote: Optional[bool] = None,
    ) -> None:
        processes = check_processes(processes)
        settings = Settings.from_user(check_max_nbytes(max_nbytes), mmap_mode, check_temp_folder(temp_folder), promote)
        forward_reducers = check_reducers("forward_reducers", forward_reducers)
        backward_reducers = check_reducers("backward_reducers", backward_reducers)
        if check_verbose(verbose):
            enable_logging()
        check_prewarm(prewarm)
        check_context_id(context_id)
        context = resolve_context(context)
        if context.get_start_method() == "forkserver":
            # Workers forked from a server that has memshare (numpy, joblib)
            # imported start at once; otherwise each imports it, and a second
            # pool or a replacement worker pays that again.
            preload_in_fork_server("memshare")
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
        self._started_lock = _forksafe.lock()
        # Written to wake the monitor when a worker is added or the pool stops;
        # closed by the monitor as it ends, under _started_lock.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        try:
            super().__init__(
                processes, _worker_init, (owner_identity(), setup, tuple(initargs)), maxtasksperchild, context
            )
        except BaseException:
            self._session.close()
            self._close_wake_pipe()
            raise
        self._monitor = threading.Thread(target=self._watch_workers, name="memshare-pool-monitor", daemon=True)
        self._monitor.start()

    def Process(self, ctx, *args, **kwds):  # noqa: N802 (Pool's name)
        process = worker_process(ctx, *args, **kwds)
        with self._started_lock:
            self._started.append(process)
        self._wake()
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
        return self._imap(super().imap, func, iterable, chunksize, progress)

    def imap_unordered(self, func, iterable, chunksize=1, progress=False):
        """``Pool.imap_unordered``; ``progress=True`` as for :meth:`imap`."""
        return self._imap(super().imap_unordered, func, iterable, chunksize, progress)

    def _imap(self, imap, func, iterable, chunksize, progress):
        chunksize = check_chunksize(chunksize)
        self._check_usable()
        self._session.new_generation()
        results = imap(run_or_return, self._feed.lazy(func, iterable, False, chunksize), 1)
        if chunksize > 1:  # each result is a chunk's list, as in the standard pool
            results = (value for chunk in results for value in chunk)
        return _progress(results, _length(iterable)) if progress else results

    def _with_progress(self, func, iterable, chunksize, star):
        # Per-chunk completion is only visible through imap; the chunking and
        # ordering of map are kept.
        self._check_usable()
        self._session.new_generation()
        items = list(iterable)
        chunksize = self._map_chunksize(len(items), chunksize)
        chunks = super().imap(run_or_return, self._feed.fill(func, items, star, chunksize), 1)
        return list(_progress((value for chunk in chunks for value in chunk), len(items)))

    def _map(self, func, iterable, chunksize, callback, error_callback, star):
        self._check_usable()
        self._session.new_generation()
        items = list(iterable)
        chunksize = self._map_chunksize(len(items), chunksize)
        tasks = self._feed.fill(func, items, star, chunksize)
        # One task per chunk, whose value is the chunk's list: the standard
        # result object collects the lists, ChunkedMapResult joins them.
        joined_callback = None if callback is None else (lambda chunks: callback(_join(chunks)))
        return ChunkedMapResult(super().map_async(run_or_return, tasks, 1, joined_callback, error_callback))

    def _map_chunksize(self, length: int, chunksize: Optional[int]) -> int:
        """``chunksize``, or the standard pool's default: about four chunks per worker."""
        if chunksize is not None:
            return check_chunksize(chunksize)
        chunks, extra = divmod(length, 4 * pool_size(self))
        return max(1, chunks + bool(extra))

    # -- results -----------------------------------------------------------------

    def _setup_queues(self) -> None:
        # A private hook of Pool (checked in _compat): the one place where every
        # message from the workers passes, in the result thread.
        super()._setup_queues()
        receive = self._quick_get  # read by Pool.__init__ right after this call
        restore = self._feed.restore

        def receive_and_restore():
            return restore(receive())

        self._quick_get = receive_and_restore

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        self._stop_monitor()
        super().close()

    def terminate(self) -> None:
        self._stop_monitor()
        try:
            super().terminate()
        finally:
            self._session.close()
            self._join_monitor()

    def join(self) -> None:
        super().join()
        self._session.close()
        self._join_monitor()

    def _stop_monitor(self) -> None:
        self._stopping = True
        self._wake()

    def _join_monitor(self) -> None:
        # No memshare thread outlives the pool: a later fork (another pool
        # with the fork context) then copies no lock a thread of ours holds.
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=5)

    @staticmethod
    def _help_stuff_finish(inqueue, task_handler, size):  # Pool's private hook, checked in _compat
        # Pool.terminate drains the task queue under its read lock. A worker
        # killed while waiting for a task never released that lock, and the
        # standard pool would then hang forever here; the workers are being
        # terminated anyway, so give up on draining after a moment.
        drain_task_queue(inqueue, task_handler, lock_timeout=1.0)

    @property
    def temp_folder(self) -> str:
        """The path of this pool's folder in shared memory (created on first use)."""
        return self._session.folder.pair.primary

    def _watch_workers(self) -> None:
        """Fail pending results promptly when a worker dies abruptly.

        Sleeps in ``multiprocessing.connection.wait`` on the workers' sentinels
        (ready when a process ends) and on a pipe written when a worker is
        added or the pool stops, as loky's executor does.
        """
        ended: set = set()
        try:
            while not self._stopping:
                ended |= self._wait_for_a_change(ended)
                if self._stopping:
                    break
                ended = self._check_exits(ended)
        finally:
            self._close_wake_pipe()

    def _wait_for_a_change(self, ended: set) -> set:
        """Wait until a worker ends, is added, or the pool stops; return the workers seen ending."""
        with self._started_lock:
            started = list(self._started)
        waitables, look_again_soon = {self._wake_r: None}, False
        for process in started:
            if process in ended:
                look_again_soon = True  # its sentinel stays ready: do not spin on it
                continue
            try:
                waitables[process.sentinel] = process
            except ValueError:  # recorded by Process() but not started yet
                look_again_soon = True
        ready = wait(list(waitables), timeout=_LOOK_AGAIN if look_again_soon else None)
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except OSError:
                pass
        return {waitables[key] for key in ready if waitables[key] is not None}

    def _check_exits(self, ended: set) -> set:
        """Handle the exit of each ended worker; return those whose exit code cannot be read yet."""
        waiting = set()
        for process in ended:
            if process in self._pool:
                # The pool's own thread reaps its workers, and reading the exit
                # status at the same time could lose it (under forkserver it is
                # read once from the sentinel): wait until it has. It then
                # starts a replacement, whose Process() call wakes us.
                waiting.add(process)
                continue
            code = process.exitcode
            if code is None:  # ended between start() and joining the pool's list
                waiting.add(process)
                continue
            with self._started_lock:
                if process in self._started:
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
        return waiting

    def _wake(self) -> None:
        with self._started_lock:
            if self._wake_w is None:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # full: the monitor has wake-ups pending anyway

    def _close_wake_pipe(self) -> None:
        with self._started_lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), None, None
        for fd in fds:
            if fd is not None:
                os.close(fd)

    def _fail_pending(self, error: BaseException) -> None:
        for result in pending_pool_results(self):
            fail_pool_result(result, error)


class ChunkedMapResult:
    """The result of ``map_async``/``starmap_async``: the standard result object, with the chunks' lists joined.

    It has the methods of :class:`multiprocessing.pool.AsyncResult`.
    """

    def __init__(self, chunks: Any) -> None:
        self._chunks = chunks

    def ready(self) -> bool:
        return self._chunks.ready()

    def successful(self) -> bool:
        return self._chunks.successful()

    def wait(self, timeout: Optional[float] = None) -> None:
        self._chunks.wait(timeout)

    def get(self, timeout: Optional[float] = None) -> list:
        return _join(self._chunks.get(timeout))


def _join(chunks: list) -> list:
    return [value for chunk in chunks for value in chunk]


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
