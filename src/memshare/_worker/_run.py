"""What runs in a worker: unpack a task, run it, pack its outcome; exit with the owner.

``run_task`` never raises: a failure travels back as an outcome (see
``_protocol``), so the parent can release the task's files and re-raise the
original exception with the worker's traceback.
"""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
import traceback
from typing import Any, Iterator, Optional

from .._errors import UnpicklableResultError
from .._lifetime._owners import process_start_time
from .._numpy import np
from .._payload._broadcast import prune_received
from .._payload._plain import plain_stream
from .._payload._reducers import Reducers, by_value, pack, pack_result
from .._payload._unpacking import Given, unpack
from .._transport._mapping import prune_mappings
from .._transport._protocol import Failure, Outcome, Task
from .._transport._refs import USER, kind_of_path
from ._result_policy import ResultPolicy

# Reducers for return values set up by the pool that started this worker
# (its ``backward_reducers``); one pool per worker process, so process-wide.
_result_reducers: Optional[Reducers] = None


def set_result_reducers(reducers: Optional[Reducers]) -> None:
    """Use ``reducers`` (type -> reducer) when pickling the return values of this process's tasks."""
    global _result_reducers
    _result_reducers = dict(reducers) if reducers else None


def run_task(task: Task) -> Outcome:
    """Run ``task`` in this process; always return an :class:`Outcome`."""
    spec, token = task.results, task.token
    prune_mappings()  # let go of files earlier calls deleted before mapping new ones
    prune_received()  # and of broadcasts the parent dropped
    given: Given = set()  # the parent's own files this task was sent: results viewing them need no copy
    try:
        value = _call(task.stream, given)
        ok = True
    except BaseException as exc:  # KeyboardInterrupt too: its type must reach the caller
        ok, value = False, Failure(exc, traceback.format_exc())
    del task  # drop the input mappings before packing the result
    plain = plain_stream(value) if ok else None
    if plain is not None:  # nothing that could travel outside the stream: no result policy
        return Outcome(token=token, ok=True, stream=plain)
    policy = ResultPolicy(spec, given)
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


def _call(stream: bytes, given: Given):
    # A function of its own, so that the function and its arguments are gone
    # when it returns: a result they still referenced could not be released.
    func, args, kwargs = unpack(stream, given=given)
    try:
        return func(*args, **kwargs)
    except ValueError as exc:
        try:
            if is_read_only_error(exc) and _maps_read_only(func, args, kwargs):
                add_note(exc, READ_ONLY_NOTE)
        except Exception:  # explaining must never replace the task's own error
            pass
        raise


#: The note added to a task's read-only error when memshare mapped one of its arguments read-only.
READ_ONLY_NOTE = (
    "memshare: this task was given arrays that memshare mapped read-only (mmap_mode='r', the default: the "
    "workers share one copy of the data), and writing into one fails. To write into it, pass mmap_mode='c' "
    "(copy-on-write: "
    "each task's writes stay private to it), or make the array with memshare.empty()/memshare.zeros() or "
    "memshare.share(X) and pass that (a shared array: workers' writes reach the parent), or write into "
    "X.copy() in the task."
)
# NumPy's wording since 1.7 and through 2.x is "<what> is read-only" (PyArray_FailUnlessWriteable: "assignment
# destination", "output array", "sort array", "underlying array"...); Cython's typed memoryviews (scikit-learn)
# say "buffer source array is read-only"; asking for write access to a read-only mapping says the last one.
_READ_ONLY_MESSAGE = re.compile(r"(\bis read-only$)|(^cannot set WRITEABLE flag to True of this array)")
# How far _maps_read_only looks into containers passed as arguments, and how many objects it looks at: joblib's
# batch holds its tasks as a list of (function, args, kwargs), so an argument array is four levels down.
_SEARCH_DEPTH, _SEARCH_ITEMS = 5, 10_000


#: Whether exceptions have ``add_note`` (Python 3.11+); a constant, so that tests can take the older way.
HAS_NOTES = hasattr(BaseException, "add_note")


def is_read_only_error(exc: BaseException) -> bool:
    """True when ``exc`` is NumPy's (or Cython's) error for writing into a read-only array."""
    if not isinstance(exc, ValueError) or not exc.args or not isinstance(exc.args[0], str):
        return False
    first_line = exc.args[0].strip().splitlines()[0] if exc.args[0].strip() else ""
    return bool(_READ_ONLY_MESSAGE.search(first_line))


def add_note(exc: BaseException, note: str) -> None:
    """Add ``note`` to ``exc``, keeping its type: ``add_note`` on Python 3.11+, else appended to its message.

    Before 3.11 there are no notes: the first argument (the message) gets the
    note on a line of its own, so ``str(exc)`` and the traceback show it and
    ``except ValueError`` still catches the exception.
    """
    if HAS_NOTES:
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",) + tuple(exc.args[1:])


def _maps_read_only(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether any argument is (a view of) an array memshare mapped read-only for this task.

    Only memshare's own files count (dumps, arrays held once, shared arrays):
    a user's ``np.memmap`` opened with mode ``'r'`` is read-only by the
    user's choice. The arguments are searched into lists, tuples and dicts,
    a few levels deep; so are the arguments bound into ``func``: a
    ``functools.partial``'s, and the tasks of a joblib batch (its public
    ``items``, a list of (function, args, kwargs)), which is how
    ``memshare.Parallel`` sends them. Called only after a read-only error,
    so the happy path pays nothing.
    """
    bound = [getattr(func, name, None) for name in ("args", "keywords", "items")]
    searched = (args, kwargs, [value for value in bound if isinstance(value, (list, tuple, dict))])
    for array in _arrays_in(searched, _SEARCH_DEPTH, [_SEARCH_ITEMS]):
        if array.flags.writeable:
            continue
        backing: Any = array
        while backing is not None and not (isinstance(backing, np.memmap) and backing.filename):
            backing = getattr(backing, "base", None)
        if backing is not None and getattr(backing, "mode", None) == "r" and kind_of_path(backing.filename) != USER:
            return True
    return False


def _arrays_in(value: Any, depth: int, budget: list) -> Iterator[np.ndarray]:
    """The arrays in ``value`` and its containers down to ``depth`` levels, at most ``budget[0]`` objects."""
    budget[0] -= 1
    if budget[0] < 0:
        return
    if isinstance(value, np.ndarray):
        yield value
    elif depth > 0 and isinstance(value, (list, tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _arrays_in(item, depth - 1, budget)


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
