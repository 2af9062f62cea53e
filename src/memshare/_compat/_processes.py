"""multiprocessing's and threading's private names: the pool's hooks and state, the fork server, lock resets.

And the process classes a pool starts its workers with: a child imports them by name, so they live here, in
a module a worker imports anyway, not with the pool.
"""

from __future__ import annotations

import contextlib
import multiprocessing.context
import multiprocessing.forkserver as _mp_forkserver
import multiprocessing.pool as _mp_pool
import sys
import threading
import time
import warnings
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

from ._pool_queues import ParentPut, ResultPipe, TaskSender
from ._probes import takes_parameter


def preload_in_fork_server(module: str) -> None:
    """Have the fork server import ``module`` when it starts, besides the modules already asked for.

    ``multiprocessing.set_forkserver_preload`` only replaces the list, which
    is private: read it to keep what the user set. From 3.15 the call also
    sets what to do when a module fails to import (``on_error``), back to its
    default unless given: the user's choice is read and passed on. Once the
    server runs, the list no longer matters and is left alone.
    """
    server = getattr(_mp_forkserver, "_forkserver", None)
    modules = getattr(server, "_preload_modules", None)
    if not isinstance(modules, list) or module in modules or getattr(server, "_forkserver_pid", None) is not None:
        return
    on_error = getattr(server, "_preload_on_error", None)
    _mp_forkserver.set_forkserver_preload([*modules, module], **({} if on_error is None else {"on_error": on_error}))


def pool_workers(pool: _mp_pool.Pool) -> list:
    """The live list of ``pool``'s worker processes: the pool's thread adds and drops them in place."""
    return getattr(pool, "_pool", [])


def pending_results(pool: _mp_pool.Pool) -> Mapping:
    """The live table of ``pool``'s results that have not completed (its values are the result objects)."""
    return getattr(pool, "_cache", {})


def pool_size(pool: _mp_pool.Pool) -> int:
    """The number of worker processes ``pool`` keeps."""
    return int(getattr(pool, "_processes", 1) or 1)


def pool_terminator(pool: _mp_pool.Pool) -> Callable[[], Any]:
    """What ``pool.terminate()`` runs once the pool's state is set: ends its threads and workers, runs once.

    It holds the pool's parts, not the pool, so a thread may keep it without keeping the pool alive.
    """
    return pool._terminate


def fail_pool_result(result: Any, error: BaseException) -> None:
    """Complete a pending pool result with ``error``, as the pool's result thread would.

    The standard result objects have no public way to fail them; ``_set`` is
    what the result thread calls, with the same arguments.
    """
    try:
        if isinstance(result, _mp_pool.IMapIterator):
            index = result._index
            result._set(index, (False, error))
            result._set_length(index + 1)
        elif isinstance(result, _mp_pool.MapResult):
            while not result.ready():
                result._set(0, (False, error))
        elif isinstance(result, _mp_pool.ApplyResult):
            result._set(0, (False, error))
    except (KeyError, IndexError, TypeError, AttributeError):
        pass  # finished concurrently, or a Python without these names


def _same(message: Any) -> Any:
    return message


def _never() -> bool:
    return False


def _no_warning(*args: Any, **kwargs: Any) -> None:
    pass


class PoolWithHooks(_mp_pool.Pool):
    """``multiprocessing.Pool`` with the private hooks memshare overrides, offered as an argument.

    Every message from the workers passes through ``message_filter``, on the
    pool's result thread, before the standard machinery sees it. That thread
    keeps the function as long as it runs, so the function must not hold the
    pool. Its worker thread wakes for worker exits and pool changes only, not
    for every result. ``terminate()`` drains the task queue without waiting
    forever for its lock. The parent reads results and writes tasks and
    sentinels through ``_pool_queues``: once ``results_abandoned()`` is true
    (a worker died abruptly, the pool is ending), none of them waits on a
    dead worker. ``join()`` returns when a worker was killed after ``close()``. An unclosed running pool,
    collected, warns once, naming its class.
    """

    def __init__(
        self,
        *args: Any,
        message_filter: Callable[[Any], Any] = _same,
        results_abandoned: Callable[[], bool] = _never,
        **kwargs: Any,
    ) -> None:
        # Before Pool.__init__: _setup_queues reads them.
        self._message_filter, self._results_abandoned = message_filter, results_abandoned
        super().__init__(*args, **kwargs)

    def _setup_queues(self) -> None:
        # Pool reads _quick_get and _quick_put right after this call, to hand them to its threads. The
        # parent reads and writes both queues through _pool_queues, which never waits forever on a dead
        # worker; the queues' own methods stay the workers' (what a worker unpickles).
        super()._setup_queues()
        pipe = ResultPipe(self._outqueue._reader)
        self._outqueue.put = ParentPut(self._outqueue, pipe, self._results_abandoned)
        self._quick_put = TaskSender(self._inqueue._writer, self._results_abandoned)
        receive, restore = pipe.recv, self._message_filter

        def receive_and_restore() -> Any:
            return restore(receive())

        self._quick_get = receive_and_restore

    def _get_sentinels(self) -> list:
        # Pool's worker thread waits on these and on the workers' sentinels, then polls every worker.
        # The standard list has the result pipe's read end, ready from when a worker writes a result
        # until the result thread reads it: with small tasks that thread spins a few times per task,
        # taking the CPU and the GIL from the threads that feed and restore them. Worker exits wake it
        # through their sentinels; close(), terminate() and an emptied cache through the change
        # notifier, which is all ThreadPool waits on.
        reader = getattr(getattr(self, "_change_notifier", None), "_reader", None)
        return [reader] if reader is not None else super()._get_sentinels()

    def join(self) -> None:
        # Pool.join joins the workers one after another. A worker killed while it waited for a task
        # took the task queue's read lock with it; with nothing pending no call fails, but the others
        # never read the sentinel that ends them. Once the pool's threads have ended, nothing else reaps
        # the workers: wait for them together here, and end the rest after an abrupt exit.
        if self._state != _mp_pool.RUN:
            for thread in (self._worker_handler, self._task_handler, self._result_handler):
                thread.join()
            end_workers_after_an_abrupt_exit(list(self._pool))
        super().join()

    @staticmethod
    def _help_stuff_finish(inqueue: Any, task_handler: threading.Thread, size: int) -> None:
        # Pool.terminate drains the task queue under its read lock. A worker
        # killed while waiting for a task never released that lock, and the
        # standard pool would then hang forever here; the workers are being
        # terminated anyway, so give up on draining after a moment.
        drain_task_queue(inqueue, task_handler, lock_timeout=1.0)

    def __del__(self) -> None:
        # Pool.__del__ reads attributes that do not exist when __init__
        # rejected its arguments before the pool was set up.
        if "_state" not in vars(self):
            return
        if self._state == _mp_pool.RUN:
            message = f"unclosed running {type(self).__name__} {self!r}"
            warnings.warn(message, ResourceWarning, stacklevel=1, source=self)
        if _POOL_DEL_TAKES_WARN:
            super().__del__(_warn=_no_warning)  # the rest of what it does: wake the pool's worker thread
        else:
            super().__del__()


_POOL_DEL_TAKES_WARN = takes_parameter(_mp_pool.Pool.__del__, "_warn")


def end_workers_after_an_abrupt_exit(workers: list) -> None:
    """Wait for ``workers`` to end; once one exits abruptly (a signal, a non-zero code), terminate the others.

    For workers told to end and given nothing more to do: what they lose is only their wait.
    """
    running = {process.sentinel: process for process in workers}
    while running:
        for sentinel in wait(list(running)):
            process = running.pop(sentinel)
            process.join()
            if process.exitcode != 0:
                for other in running.values():
                    other.terminate()


def drain_task_queue(inqueue: Any, task_handler: threading.Thread, lock_timeout: float = 1.0) -> None:
    """Drain a pool's task queue as ``Pool._help_stuff_finish`` does, without hanging.

    The standard version waits forever for the queue's read lock, which a
    worker killed while waiting for a task never releases.
    """
    rlock: Optional[Any] = getattr(inqueue, "_rlock", None)
    reader = getattr(inqueue, "_reader", None)
    if rlock is None or reader is None or not rlock.acquire(timeout=lock_timeout):
        return
    while task_handler.is_alive() and reader.poll():
        reader.recv()
        time.sleep(0)


# -- threading -----------------------------------------------------------------


def reinit_lock(lock: Any) -> None:
    """Make ``lock`` unlocked and usable again in a forked child (the standard library's own reset)."""
    reinit = getattr(lock, "_at_fork_reinit", None)
    if reinit is not None:
        reinit()


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


def start_fork_server_with(*modules: str) -> None:
    """Start the fork server now, with ``modules`` among those it imports first (see :func:`preload_in_fork_server`).

    The server preloads ``__main__`` from its ``__file__`` too, when it has a real one (see :func:`pseudo_main_hidden`).
    """
    for module in modules:
        preload_in_fork_server(module)
    with pseudo_main_hidden():
        _mp_forkserver.ensure_running()


def worker_process(context: Any, *args: Any, **kwargs: Any) -> Any:
    """A new worker process of ``context`` (not started): ``context.Process``, made safe for a piped ``__main__``."""
    process_class = _PROCESS_CLASSES.get(context.Process, context.Process)
    return process_class(*args, **kwargs)
