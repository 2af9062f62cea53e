"""What runs in a worker: unpack a task, run it, pack its outcome; exit with the owner.

``run_task`` never raises: a failure travels back as an outcome (see
``_protocol``), so the parent can release the task's files and re-raise the
original exception with the worker's traceback.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import traceback
from typing import Optional

from ._errors import UnpicklableResultError
from ._mapping import prune_mappings
from ._owners import process_start_time
from ._protocol import Failure, Outcome, Task
from ._reducers import Reducers, ResultPolicy, by_value, pack, pack_result, unpack

# Reducers for return values set up by the pool that started this worker
# (its ``backward_reducers``); one pool per worker process, so process-wide.
_result_reducers: Optional[Reducers] = None


def set_result_reducers(reducers: Optional[Reducers]) -> None:
    """Use ``reducers`` (type -> reducer) when pickling the return values of this process's tasks."""
    global _result_reducers
    _result_reducers = dict(reducers) if reducers else None


def run_task(task: Task) -> Outcome:
    """Run ``task`` in this process; always return an :class:`Outcome`."""
    policy, token = ResultPolicy(task.results), task.token
    prune_mappings()  # let go of files earlier calls deleted before mapping new ones
    try:
        value = _call(task.stream)
        ok = True
    except BaseException as exc:  # KeyboardInterrupt too: its type must reach the caller
        ok, value = False, Failure(exc, traceback.format_exc())
    del task  # drop the input mappings before packing the result
    what = type(value if ok else value.exception).__name__
    try:
        stream = pack_result(value, policy, _result_reducers)
        # The pickled value only holds slot numbers now. With the value
        # dropped, memshare's pending list is often the only owner of each
        # large array, which lets write_pending free them as they are written.
        del value
        policy.write_pending()
        policy.send_memfds()  # queued at the parent before the outcome can arrive
    except BaseException as exc:
        policy.discard_written()
        failure = Failure(_packing_error(exc, ok, what), traceback.format_exc())
        ok, stream = False, pack(failure, by_value)  # no slots this time: nothing would write them
    return Outcome(token=token, ok=ok, stream=stream, slots=tuple(policy.slots))


def _call(stream: bytes):
    # A function of its own, so that the function and its arguments are gone
    # when it returns: a result they still referenced could not be released.
    func, args, kwargs = unpack(stream)
    return func(*args, **kwargs)


def _packing_error(exc: BaseException, ok: bool, what: str) -> BaseException:
    """The error to send when the task's outcome could not be sent back."""
    if isinstance(exc, OSError):  # no room for a result file, say: that is what the caller should see
        try:
            pickle.dumps(exc)
            return exc
        except Exception:
            pass
    return UnpicklableResultError(
        f"memshare: the task's {'return value' if ok else 'exception'} ({what}) "
        f"cannot be pickled to send it back: {exc!r}"
    )


def watch_parent(parent: int, parent_start: Optional[int], interval: float = 0.5) -> None:
    """Exit this worker when the process that owns it (pid ``parent``) dies.

    Pool workers block reading a pipe whose write end their siblings also
    hold, and busy workers finish their task first, so neither would notice
    an orphaning promptly on their own. The owner is identified by pid and
    start time, passed in rather than read here: a parent killed while the
    worker starts must still count, and under forkserver the owner is not
    the worker's parent process at all.
    """

    def owner_gone() -> bool:
        return process_start_time(parent) != parent_start

    if owner_gone():
        os._exit(1)

    def _watch() -> None:
        while True:
            time.sleep(interval)
            if owner_gone():
                os._exit(1)

    threading.Thread(target=_watch, name="memshare-parent-watch", daemon=True).start()
