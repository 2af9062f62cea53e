"""The ``"memshare"`` joblib backend, on a loky executor of its own.

Workers are long-lived loky processes (see ``_executor``: joblib's bundled
loky, an executor apart from joblib's ``"loky"`` backend); memshare only
changes what travels.
Each batch joblib submits is packed by the call's :class:`Session` when
loky's feeder thread sends it to a worker, as joblib's own loky backend
pickles it (``_deferred``), so large arrays are dumped once per call (or once
per ``with Parallel() as p:`` context) and sent as references; results come
back through shared memory the same way.

The sharing settings (``max_nbytes``, ``mmap_mode``, ``temp_folder``) are
not executor arguments: changing them between calls takes effect at once and
never restarts the workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import joblib
from joblib.externals.loky.process_executor import (
    BrokenProcessPool,
    ShutdownExecutorError,
    TerminatedWorkerError,
)
from joblib.parallel import (
    AutoBatchingMixin,
    FallbackToBackend,
    LokyBackend,
    ParallelBackendBase,
    SequentialBackend,
)

from . import _forksafe
from ._compat import (
    drop_ready_batches,
    make_loky_tracker_reentrant,
    set_auto_batch_size,
    terminated_worker_exit_codes,
    worker_env,
)
from ._config import Settings
from ._errors import WorkerDiedError, describe_exit
from ._lifetime._holdings import held_bytes
from ._stats import CallStats, enable_logging, record_finished
from ._worker._entry import run_or_return

if TYPE_CHECKING:
    from ._frontends._deferred import DeferredFeed
    from ._parent._session import Session

# The parent's side of a call (its session, feed and executor) is imported by the methods that run one, not
# with this module: joblib sends the backend along with every batch (for nested calls), so each worker
# unpickles it, and a worker needs none of that side.

BACKEND_NAME = "memshare"

# Under batch_size="auto" joblib groups fast tasks into batches of up to
# hundreds, and the files a batch dumps stay until the whole batch is done, so
# 300 fast tasks over distinct 8 MB arrays held about 500 MB of files at once.
# A batch is capped so that what it dumps stays near this budget (one task at
# least); a call then holds a few batches' worth (joblib keeps about
# pre_dispatch batches in flight), however fast its tasks. Tasks that dump
# nothing, such as tiny tasks, are batched as joblib would.
_BATCH_DUMP_BUDGET = 8 * 1024**2


def _check_n_jobs(n_jobs: Any) -> Optional[int]:
    if n_jobs is None:
        return None
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int):
        try:
            as_int = int(n_jobs)
        except (TypeError, ValueError):
            as_int = None
        if as_int is None or as_int != n_jobs:
            raise ValueError(f"n_jobs={n_jobs!r} is not an integer: pass e.g. 2, -1 (all CPUs) or None")
        n_jobs = as_int
    if n_jobs == 0:
        raise ValueError("n_jobs=0 has no meaning: pass a positive number of workers, -1 for all CPUs, or None")
    return n_jobs


class MemshareBackend(AutoBatchingMixin, ParallelBackendBase):
    """joblib backend running on loky workers with memshare's sharing.

    Registered as ``"memshare"`` on ``import memshare``; joblib makes it
    from ``joblib.parallel_config(backend="memshare", ...)`` or
    ``Parallel(backend="memshare")``. Workers are long-lived loky processes
    of an executor apart from joblib's ``"loky"`` backend.

    Parameters
    ----------
    nesting_level : int, optional
        joblib's nesting level; set by joblib.
    inner_max_num_threads : int, optional
        Thread limit of the libraries in each worker (OpenMP, BLAS), as for
        joblib's loky backend.
    idle_worker_timeout : float, optional
        Seconds an idle worker waits before it exits (default 300, as loky).
    initializer : callable, optional
        Called in every worker as it starts (and in a replacement worker).
    initargs : tuple, optional
        The initializer's arguments.
    promote : bool, optional
        Hold large ordinary arrays once; None (default) reads
        ``$MEMSHARE_PROMOTE``, which defaults to on.
    **backend_kwargs
        Passed on to joblib's backend base class.

    Raises
    ------
    ValueError
        From a call: ``n_jobs`` is 0 or not an integer.

    See Also
    --------
    register_backend, Parallel

    Examples
    --------
    >>> import joblib
    >>> import memshare
    >>> with joblib.parallel_config(backend="memshare", idle_worker_timeout=60):
    ...     joblib.Parallel(n_jobs=2)(joblib.delayed(abs)(-i) for i in range(3))
    [0, 1, 2]
    """

    supports_retrieve_callback = True
    supports_inner_max_num_threads = True

    def __init__(
        self,
        nesting_level=None,
        inner_max_num_threads=None,
        idle_worker_timeout=300,
        initializer=None,
        initargs=(),
        promote=None,
        **backend_kwargs,
    ):
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads, **backend_kwargs)
        self.idle_worker_timeout = idle_worker_timeout
        self._executor = None
        self._session: Optional[Session] = None
        self._feed: Optional[DeferredFeed] = None
        self._n_jobs = 1
        # parallel_config(backend="memshare", initializer=...) arrives here. Taken
        # as parameters, not left in backend_kwargs, because joblib before 1.5
        # passes those on to a base class that accepts none.
        self._configured_initializer = initializer
        self._configured_initargs = initargs
        self._promote = promote  # parallel_config(backend="memshare", promote=False)
        self._initializer = None
        self._initargs: tuple = ()
        # Incremented by abort_everything. joblib ignores the outcome of a
        # task that finishes once its call is aborting, so nobody will read
        # it: such a task's inputs are released in submit's callback instead.
        self._epoch = 0
        self._dumped_per_task = 0.0  # bytes dumped per task by the last batch, for compute_batch_size

    def effective_n_jobs(self, n_jobs) -> int:
        """The number of workers a call gets, by joblib's rules for its loky backend.

        memshare's workers are loky workers, so the same limits apply, with
        the same warnings: one worker (sequential) in a daemonic process such
        as a ``multiprocessing.Pool`` worker, and below a thread of a nested
        call (forking from a non-main thread is unsafe). A throwaway
        ``LokyBackend`` at this backend's nesting level decides, so the rules
        and messages stay joblib's own in every joblib version.

        Parameters
        ----------
        n_jobs : int or None
            The call's ``n_jobs``: a positive count, -1 for all CPUs
            (-2 for all but one...), or None for one.

        Returns
        -------
        int
            The number of workers the call runs on.

        Raises
        ------
        ValueError
            ``n_jobs`` is 0 or not an integer.
        """
        n_jobs = _check_n_jobs(n_jobs)
        return LokyBackend(nesting_level=self.nesting_level).effective_n_jobs(n_jobs)

    def configure(
        self,
        n_jobs=1,
        parallel=None,
        prefer=None,
        require=None,
        max_nbytes="1M",
        mmap_mode="r",
        temp_folder=None,
        verbose=0,
        idle_worker_timeout=None,
        **unused,
    ) -> int:
        settings = Settings.from_user(max_nbytes, mmap_mode, temp_folder, self._promote)
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            # Nothing crosses a process boundary: the call shares nothing, and
            # last_call_stats() must say so rather than show an older call.
            record_finished(CallStats(bytes_in_shared_memory=held_bytes()))
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        if verbose:
            enable_logging()
        self.parallel = parallel
        self._n_jobs = n_jobs
        self._timeout = idle_worker_timeout or self.idle_worker_timeout
        # joblib hands Parallel(initializer=...) to configure and
        # parallel_config(initializer=...) to __init__; the call's own wins.
        configured = {"initializer": self._configured_initializer, "initargs": self._configured_initargs}
        options = {**configured, **getattr(self, "backend_kwargs", {}), **unused}
        self._initializer = options.get("initializer")
        self._initargs = tuple(options.get("initargs") or ())
        if self._initializer is not None and not callable(self._initializer):
            raise TypeError(
                f"initializer must be a callable run in each worker, got {self._initializer!r}; "
                "pass a function and its arguments as initargs=(...)"
            )
        from ._frontends._deferred import DeferredFeed
        from ._parent._session import Session

        self._executor = self._get_executor()
        if self._session is not None:
            self._session.close()
        self._session = Session(settings)
        self._feed = DeferredFeed(self._session, n_jobs, on_packed=self._note_dumped)
        return n_jobs

    def _get_executor(self):
        from ._frontends._executor import get_executor

        return get_executor(
            self._n_jobs,
            self._timeout,
            worker_env(self, self._n_jobs),
            self._initializer,
            self._initargs,
        )

    def compute_batch_size(self) -> int:
        """joblib's automatic batch size, capped so that a batch dumps about ``_BATCH_DUMP_BUDGET`` at most."""
        batch_size = super().compute_batch_size()
        if self._dumped_per_task > 0:
            cap = max(1, int(_BATCH_DUMP_BUDGET // self._dumped_per_task))
            if batch_size > cap:
                batch_size = cap
                set_auto_batch_size(self, cap)
        return batch_size

    def reset_batch_stats(self) -> None:
        super().reset_batch_stats()
        self._dumped_per_task = 0.0

    def _note_dumped(self, nbytes: int, batch) -> None:
        # The last batch's figure, not an average: a batch that dumps an array
        # every later task reuses must not cap the batches that dump nothing.
        self._dumped_per_task = nbytes / max(1, len(batch) if hasattr(batch, "__len__") else 1)

    def start_call(self) -> None:
        if self._session is not None:
            self._session.new_generation()
        # joblib cuts tasks into batches ahead of dispatch and never empties its
        # queue of spare ones: after a call stopped by an error, a managed
        # ``with Parallel() as p:`` would run the failed call's leftover tasks in
        # its next call and raise their errors there (joblib's own loky backend
        # does). Emptying it here leaves none behind whatever the timing: joblib
        # calls start_call after the new call's id and flags are set and before
        # its first dispatch, and by then nothing of an earlier call can still
        # dispatch (its completion callbacks ran under Parallel._lock, or, when
        # it was aborted, in loky's manager thread, which abort_everything
        # joined, or in the dispatching thread itself when a future was already
        # done as its callback was added). So anything queued is an earlier call's.
        drop_ready_batches(getattr(self, "parallel", None))

    def submit(self, func, callback=None):
        # Packed later, when loky's feeder pickles it for a worker (see _deferred).
        deferred = self._feed.defer(func)
        try:
            future = self._executor.submit(run_or_return, deferred)
        except (BrokenProcessPool, ShutdownExecutorError):
            # The executor broke since the last call (a worker killed while
            # idle): this call starts on a new one. A break during this call
            # still fails the call, through its earlier futures. joblib
            # dispatches under its lock: no waiting for the old executor.
            from ._frontends._executor import discard_executor

            discard_executor(self._executor, wait=False)
            self._executor = self._get_executor()
            future = self._executor.submit(run_or_return, deferred)
        feed, epoch = self._feed, self._epoch
        future.memshare_feed = feed

        def release_then_report(done):
            feed.future_done(deferred)  # the feeder may pack the next batch that dumps
            # An infrastructure failure (dead worker, shutdown) brings no
            # outcome back: release the task's files here.
            if done.cancelled() or done.exception() is not None:
                feed.abandon(deferred)
            if epoch != self._epoch:
                if not done.cancelled() and done.exception() is None:
                    feed.abandon(deferred)  # aborted: nobody will read the outcome
                return
            if callback is not None:
                callback(done)

        future.add_done_callback(release_then_report)
        return future

    # joblib 1.3 and 1.4 call apply_async; joblib 1.5 renamed it submit, with
    # the same arguments, the same returned future and the same callback.
    apply_async = submit

    def retrieve_result_callback(self, future):
        try:
            outcome = future.result()
        except TerminatedWorkerError as exc:
            raise WorkerDiedError(_explain_terminated(exc)) from exc
        except ShutdownExecutorError:
            raise RuntimeError(
                "memshare: the executor was shut down while this call was running "
                "(an earlier generator call may have been garbage-collected unfinished)"
            ) from None
        ok, value = future.memshare_feed.outcome(outcome)
        if not ok:
            raise value
        return value

    def terminate(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
            self._feed = None
        self._executor = None
        self.reset_batch_stats()

    def abort_everything(self, ensure_ready=True) -> None:
        """Stop the call's remaining tasks by killing the workers, as joblib's loky backend does."""
        self._epoch += 1
        if self._executor is not None:
            from ._frontends._executor import discard_executor

            discard_executor(self._executor)
        self._executor = None
        if ensure_ready:
            self._executor = self._get_executor()

    @property
    def temp_folder(self) -> Optional[str]:
        """The current call's folder in shared memory, if a call is running."""
        return None if self._session is None else self._session.folder.pair.primary

    @property
    def promote(self) -> Optional[bool]:
        """The ``promote`` this backend was made with; None: ``$MEMSHARE_PROMOTE`` decides (doctor reports it)."""
        return self._promote


def _explain_terminated(exc: BaseException) -> str:
    codes = terminated_worker_exit_codes(exc)
    details = "; ".join(f"a worker {describe_exit(code)}" for code in sorted(set(codes))) or "a worker died"
    return f"memshare: {details}. The call's temporary files have been removed.\n{exc}"


# Before any memshare worker starts: loky 3.4's tracker could otherwise deadlock starting them (see _compat).
make_loky_tracker_reentrant()

_register_lock = _forksafe.lock()


def register_backend(make_default: bool = False) -> None:
    """Register the ``"memshare"`` backend with joblib (done on ``import memshare``).

    With ``make_default=True`` every joblib ``Parallel`` of the process,
    including scikit-learn's ``n_jobs``, uses it unless told otherwise.

    Parameters
    ----------
    make_default : bool, optional
        Make ``"memshare"`` joblib's default backend (default False).

    Returns
    -------
    None

    Examples
    --------
    >>> import joblib
    >>> import memshare
    >>> memshare.register_backend()  # again: harmless
    >>> "memshare" in joblib.parallel.BACKENDS
    True
    """
    with _register_lock:
        joblib.register_parallel_backend(BACKEND_NAME, MemshareBackend, make_default=make_default)


# joblib is imported now: whichever of memshare's modules came first, the backend is registered
# (when this module's own import of joblib set off the hook of _registration, it was not made yet).
register_backend()
