"""The functions worker processes are started with and run: the front ends hand these over, by name.

A loky worker of the joblib backend starts with :func:`start_backend_worker`
and runs :func:`run_or_return` per batch; a ``MemmappingPool`` worker starts
with :func:`start_pool_worker` and runs :func:`run_pool_task` per task, a
``map`` chunk's function being a :class:`MapChunk`. They live here, apart
from the front ends that send them, so that a worker imports what runs in
it and none of the parent's side (sessions, dumps, feeds).
"""

from __future__ import annotations

import itertools
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, Union

from .._compat import set_loky_leak_limit
from .._payload._main_values import PLAIN_TYPES
from .._transport._protocol import ResultSpec, Task, Unsent
from ._run import run_task, set_result_reducers, watch_parent

#: The variable newer loky releases read for their leak limit; memshare
#: honours it in its workers, with no limit by default.
LEAK_LIMIT_VARIABLE = "LOKY_MAX_MEMORY_LEAK_SIZE"

#: A pool task on the wire: (token, stream) of a :class:`Task`, or the placeholder of one not packed.
PoolTask = Union[Tuple[int, bytes], Unsent]
#: A pool task's outcome on the wire: (token, ok, stream, slots) of an :class:`Outcome`.
PoolOutcome = Tuple[int, bool, bytes, tuple]

# The result spec of the pool this worker serves: one pool per worker process, so process-wide.
_pool_results: Optional[ResultSpec] = None


def start_backend_worker(
    parent: int,
    parent_start: Optional[int],
    user_initializer: Optional[Callable[..., Any]] = None,
    user_initargs: Tuple = (),
) -> None:
    """Initializer of memshare's loky workers, then the user's one if given."""
    lift_leak_limit()
    watch_parent(parent, parent_start)
    if user_initializer is not None:
        user_initializer(*user_initargs)


def lift_leak_limit() -> None:
    """Keep loky from recycling this worker for the shared pages it maps.

    After each task a loky worker compares its RSS with the RSS after its
    first task and exits when it grew by more than ``_MAX_MEMORY_LEAK_SIZE``
    (300 MB), taking that for a leak. RSS counts the shared-memory pages the
    worker maps, and memshare keeps those mappings open across tasks on
    purpose, so the check would restart workers over and over, with a warning
    each time. The loky releases joblib 1.3 to 1.6 bundle (3.4.0 to 3.6.0)
    hard-code the limit in that module global and read it at each check, so
    setting it here, in the worker, before its first task, is enough.
    ``LOKY_MAX_MEMORY_LEAK_SIZE`` (bytes) still sets a limit if the user wants one.
    """
    limit = os.environ.get(LEAK_LIMIT_VARIABLE)
    try:
        value = int(float(limit)) if limit else 2**62
    except ValueError:
        value = 2**62
    set_loky_leak_limit(value)


def run_or_return(task: Any) -> Any:
    """The function the joblib backend's workers run: a task, or a placeholder returned as it is."""
    if isinstance(task, Unsent):
        return task
    return run_task(task)


@dataclass(frozen=True)
class MapChunk:
    """The function a chunk of a ``map`` runs in the worker: ``func`` over each item, in order.

    As in the standard pool, the first item that raises fails the whole chunk
    (and so its ``map`` call) with that exception.
    """

    func: Callable
    star: bool  # items are argument tuples (``starmap``)

    def __call__(self, items: List) -> List:
        if self.star:
            return list(itertools.starmap(self.func, items))
        return list(map(self.func, items))

    def arguments_of(self, items: List) -> List[Any]:
        """The objects the chunk passes to ``func`` that may hold an array or a large object: each item, or
        each element of each item for ``starmap``, but numbers, strings and None (looked at per item)."""
        arguments = itertools.chain.from_iterable(items) if self.star else items
        if PLAIN_TYPES.issuperset(map(type, arguments)):  # the common case, in one pass at C speed
            return []
        arguments = itertools.chain.from_iterable(items) if self.star else items
        return [argument for argument in arguments if type(argument) not in PLAIN_TYPES]


def start_pool_worker(owner: tuple, setup: bytes, initargs: tuple) -> None:
    """Initializer of a pool's workers: watch the parent, take the pool's result settings, run the user's."""
    watch_parent(*owner)
    # The initializer and the result reducers travel cloudpickled, so that
    # functions of __main__ and lambdas work under every start method; initargs
    # do not, so that multiprocessing locks and queues can still be inherited.
    initializer, backward_reducers, results = pickle.loads(setup)
    set_result_reducers(backward_reducers)
    set_pool_results(results)
    if initializer is not None:
        initializer(*initargs)


def set_pool_results(spec: ResultSpec) -> None:
    """In a pool's worker, as it starts: where and how its tasks' results go (the pool session's spec)."""
    global _pool_results
    _pool_results = spec


def run_pool_task(message: PoolTask) -> Union[PoolOutcome, Unsent]:
    """The function pool workers run: a task (as the tuple of its fields), or a placeholder returned as it is."""
    if type(message) is not tuple:
        return message  # an Unsent placeholder
    if _pool_results is None:
        raise RuntimeError("memshare: this process runs pool tasks but was not started by a MemmappingPool")
    token, stream = message
    outcome = run_task(Task(token, stream, _pool_results))
    return (outcome.token, outcome.ok, outcome.stream, outcome.slots)
