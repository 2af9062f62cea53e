"""Watching a pool's workers: one that dies abruptly fails the pool's pending results instead of hanging them.

A :class:`WorkerWatch` keeps its own state and, of the pool it watches, only
the pool's live list of workers and its live table of pending results, never
the pool itself: a pool nobody closes can still be collected, and its
finalizer then stops the watch. Once a worker died abruptly, ``broken`` holds
the error that every pending result got, the pool refuses new tasks, and
the watch ends the pool's workers at once (as ``concurrent.futures`` ends a
broken executor's): its results are nobody's any more, and a worker that
waits for a task behind the dead one's lock would never end by itself.
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping, Optional, Tuple

from .. import _errors, _forksafe
from .._compat import fail_pool_result
from .._errors import describe_exit

_LOOK_AGAIN = 0.05  # seconds: wait for a recorded worker to start, or an ended one to be reaped


class WorkerWatch:
    """Records every worker a pool starts and, in a thread of its own, waits for them to end.

    It sleeps in ``multiprocessing.connection.wait`` on the workers' sentinels
    (ready when a process ends) and on a pipe written when a worker is added
    or the watch stops, as loky's executor does.
    """

    def __init__(self, start_method: str, make_process: Callable[..., Any]) -> None:
        self.broken: Optional[BaseException] = None
        self._start_method = start_method
        self._make_process = make_process
        # Every worker ever started, recorded by new_process(). The pool's own
        # thread drops exited workers from its list at once (and starts
        # replacements), so a worker that starts and dies between two looks at
        # that list would go unnoticed and its task would hang forever.
        self._started: list = []
        # Re-entrant: the pool's finalizer stops the watch in whatever thread
        # collects the pool, which may be one holding it.
        self._lock = _forksafe.rlock()
        self._stopping = False
        self._closed = False  # the pool takes no more tasks: the watch ends once its results are in
        self._watched: Tuple[int, ...] = ()
        # Written to wake the thread when a worker is added or the watch stops;
        # closed under _lock, by the thread as it ends, or by close() if the
        # thread never started.
        self._wake_r: Optional[int]
        self._wake_w: Optional[int]
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: Optional[threading.Thread] = None

    def new_process(self, ctx: Any, *args: Any, **kwds: Any) -> Any:
        """The pool's ``Process``: a new worker process (not started yet), recorded before the pool starts it."""
        process = self._make_process(ctx, *args, **kwds)
        with self._lock:
            self._started.append(process)
        self._wake()
        return process

    def start(self, workers: list, pending: Mapping, end_pool: Callable[[], Any]) -> None:
        """Start watching.

        ``workers`` and ``pending`` are the pool's live list of workers and
        table of results; ``end_pool`` ends its threads and workers, without
        holding the pool, and does nothing once it has run.
        """
        self._thread = threading.Thread(
            target=self._run, args=(workers, pending, end_pool), name="memshare-pool-monitor", daemon=True
        )
        self._thread.start()

    @property
    def results_abandoned(self) -> bool:
        """True once nothing will read the pool's results: a worker died abruptly, or the pool is ending."""
        return self.broken is not None or self._stopping

    def pool_closed(self) -> None:
        """The pool takes no more tasks: keep watching until its pending results are all in."""
        self._closed = True
        self._wake()

    def stop(self) -> None:
        """Stop watching: from now on a worker's exit is the pool's shutdown, not a failure."""
        self._stopping = True
        self._wake()

    def close(self) -> None:
        """Stop, and wait for the thread to end (or close the pipe if it never started)."""
        self.stop()
        thread = self._thread
        if thread is None:
            self._forget_workers()
            self._close_wake_pipe()
        elif thread is not threading.current_thread():
            # No memshare thread outlives the pool: a later fork (another pool
            # with the fork context) then copies no lock a thread of ours holds.
            thread.join(timeout=5)

    def watched_pids(self) -> Tuple[int, ...]:
        """The pids of the workers whose end the thread is waiting for (for tests)."""
        return self._watched

    def _run(self, workers: list, pending: Mapping, end_pool: Callable[[], Any]) -> None:
        ended: set = set()
        try:
            while not self._stopping and not (self._closed and not pending):
                ended |= self._wait_for_a_change(ended)
                if self._stopping:
                    break
                ended = self._check_exits(ended, workers, pending)
                if self.broken is not None:
                    self._stopping = True  # the exits of the workers ended now are no failure
                    end_pool()
        finally:
            self._watched = ()
            self._forget_workers()
            self._close_wake_pipe()

    def _wait_for_a_change(self, ended: set) -> set:
        """Wait until a worker ends, is added, or the watch stops; return the workers seen ending."""
        with self._lock:
            started = list(self._started)
            wake_r = self._wake_r
        waitables, look_again_soon = {wake_r: None}, False
        for process in started:
            if process in ended:
                look_again_soon = True  # its sentinel stays ready: do not spin on it
                continue
            try:
                waitables[process.sentinel] = process
            except ValueError:  # recorded by new_process() but not started yet
                look_again_soon = True
        self._watched = tuple(process.pid for process in waitables.values() if process is not None)
        ready = wait(list(waitables), timeout=_LOOK_AGAIN if look_again_soon else None)
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except OSError:
                pass
        return {waitables[key] for key in ready if waitables[key] is not None}

    def _check_exits(self, ended: set, workers: list, pending: Mapping) -> set:
        """Handle the exit of each ended worker; return those whose exit code cannot be read yet."""
        waiting = set()
        for process in ended:
            if process in workers:
                # The pool's own thread reaps its workers, and reading the exit
                # status at the same time could lose it (under forkserver it is
                # read once from the sentinel): wait until it has. It then
                # starts a replacement, whose new_process() call wakes us.
                waiting.add(process)
                continue
            code = process.exitcode
            if code is None:  # ended between start() and joining the pool's list
                waiting.add(process)
                continue
            with self._lock:
                if process in self._started:
                    self._started.remove(process)
            if code == 0 or self._stopping:
                continue  # a normal exit (maxtasksperchild, shutdown)
            # An idle worker blocks in the task queue's read lock; killed
            # there, it takes the lock with it and no other worker can ever
            # receive a task. So the pool is broken, as concurrent.futures
            # says of its own: fail everything now rather than hang.
            # The error class is made (and joblib imported) now, not with the pool: see _errors.
            self.broken = _errors.WorkerDiedError(self._explain(process.pid, code))
            for result in list(pending.values()):
                fail_pool_result(result, self.broken)
        return waiting

    def _explain(self, pid: int, code: int) -> str:
        hint = ""
        if code == 1 and self._start_method != "fork":
            hint = (
                f" If it failed as it started (its error is above), note that under the "
                f"{self._start_method} start method a script must create the pool under "
                "`if __name__ == '__main__':`, or pass context='fork'."
            )
        return (
            f"memshare: worker process {pid} {describe_exit(code)}. Its pool cannot run "
            f"tasks any more: terminate it and create a new one.{hint}"
        )

    def _forget_workers(self) -> None:
        # Once nothing watches them, the pool alone keeps its workers' process objects: each holds the
        # descriptors of its sentinel until it is released, which happens with the pool (by reference
        # counting, as the standard pool's) only if the watch, which may outlive it in a reference
        # cycle of the pool's parts, keeps none.
        with self._lock:
            self._started.clear()

    def _wake(self) -> None:
        with self._lock:
            if self._wake_w is None:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # full: the thread has wake-ups pending anyway

    def _close_wake_pipe(self) -> None:
        with self._lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), None, None
        for fd in fds:
            if fd is not None:
                os.close(fd)
