"""Feeding a pool's tasks lazily, so that a task that cannot be sent fails its call instead of hanging it.

``MemmappingPool`` packs the tasks of ``map`` and ``imap`` calls lazily, in
the standard pool's task-feeding thread, so that dumping later arrays
overlaps with running earlier tasks and a call over many distinct arrays
holds only what is in flight. An error raised there never reaches the
caller: the standard pool turns it into one failed chunk, and a ``map``
then waits forever for the chunks that were never sent.

So packing errors (an unpicklable argument, no room for a dump, an unusable
temp folder, the user's iterable raising) are caught here and the task
travels as an :class:`Unsent` placeholder, which the worker returns at once
and the result thread turns back into the original exception object (it
never crosses a process boundary, so it need not be picklable). After a
failure, a ``map`` call sends a placeholder for each remaining chunk, because
its result waits for every chunk; an ``imap`` call stops there, as the
standard pool does when the iterable raises.

Chunks: the standard pool sends ``chunksize`` items as one message. Here a
chunk is one task too: a :class:`MapChunk` packed with all its items in one
pass of memshare's pickler, so each array in it is still routed (an array
repeated across items or chunks is dumped once, by the session), and the
function is pickled once per chunk instead of once per item. The worker
returns the chunk's values as one list; the pool joins the lists.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Sized

from . import _forksafe
from ._protocol import Outcome, Task
from ._session import Session
from ._worker import run_task


@dataclass(frozen=True)
class Unsent:
    """Stands for a task that could not be packed; the worker sends it straight back."""

    key: int  # identifies the failure in the parent's TaskFeed


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
            return [self.func(*item) for item in items]
        return [self.func(item) for item in items]

    def arguments_of(self, items: List) -> Iterator[Any]:
        """The objects the chunk passes to ``func``: each item, or each element of each item for ``starmap``."""
        for item in items:
            if self.star:
                yield from item
            else:
                yield item


def run_or_return(task: Any) -> Any:
    """The function pool workers run: a task, or a placeholder returned as it is."""
    if isinstance(task, Unsent):
        return task
    return run_task(task)


class _FillingTasks(Sized):
    """The packed tasks of a ``map`` call: one per chunk, placeholders after a failure."""

    def __init__(self, feed: TaskFeed, func: Callable, items: List, star: bool, chunksize: int) -> None:
        self._feed, self._func, self._items, self._star = feed, func, items, star
        self._chunksize = chunksize

    def __len__(self) -> int:
        return -(-len(self._items) // self._chunksize)

    def __iter__(self) -> Iterator:
        chunks = len(self)
        for index in range(chunks):
            start = index * self._chunksize
            try:
                task = self._feed.pack_chunk(self._func, self._items[start : start + self._chunksize], self._star)
            except BaseException as exc:  # this thread has nobody to raise to
                placeholder = self._feed.failed(exc, count=chunks - index)
                for _ in range(index, chunks):
                    yield placeholder
                return
            yield task


class TaskFeed:
    """Packs a pool's tasks and restores their outcomes, failing calls cleanly."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._lock = _forksafe.lock()
        self._keys = itertools.count(1)
        # key -> [exception, placeholders not back yet]
        self._failures: Dict[int, list] = {}

    def pack(self, func: Callable, item: Any, star: bool) -> Task:
        """One item as a task of its own."""
        args = tuple(item) if star else (item,)
        return self.session.pack_task(func, args)

    def pack_chunk(self, func: Callable, items: List, star: bool) -> Task:
        """Several items as one task, whose value is the list of their values."""
        return self.session.pack_task(MapChunk(func, star), (list(items),))

    def failed(self, exc: BaseException, count: int) -> Unsent:
        """Record ``exc`` for ``count`` placeholders about to be sent; return the placeholder."""
        with self._lock:
            key = next(self._keys)
            self._failures[key] = [exc, count]
        return Unsent(key)

    def fill(self, func: Callable, items: List, star: bool, chunksize: int) -> Sized:
        """The tasks of a ``map`` over ``items``: exactly one per chunk of ``chunksize`` items, whatever fails."""
        return _FillingTasks(self, func, items, star, chunksize)

    def lazy(self, func: Callable, iterable: Iterable, star: bool, chunksize: int = 1) -> Iterator:
        """The tasks of an ``imap``: packed as consumed, ending with a placeholder at the first failure.

        With ``chunksize`` 1 each item is a task whose value is the item's
        value; above, each chunk is a task whose value is a list.
        """
        iterator = iter(iterable)
        while True:
            try:
                items = list(itertools.islice(iterator, chunksize))
            except BaseException as exc:  # the user's iterable raised: fail at this position
                yield self.failed(exc, count=1)
                return
            if not items:
                return
            try:
                task = self.pack(func, items[0], star) if chunksize == 1 else self.pack_chunk(func, items, star)
            except BaseException as exc:
                yield self.failed(exc, count=1)
                return
            yield task
            if len(items) < chunksize:
                return

    # -- on the pool's result thread ---------------------------------------------

    def restore(self, message: Any) -> Any:
        """Turn a worker's message back into what the standard pool expects.

        Runs on the pool's result thread, so it must never raise: any failure
        becomes the failure of the task it belongs to.
        """
        if message is None:
            return message
        try:
            job, index, (success, value) = message
        except (TypeError, ValueError):
            return message
        if not success:
            return message
        try:
            if isinstance(value, (Outcome, Unsent)):
                return (job, index, self._restore_one(value))
            if isinstance(value, list) and all(isinstance(item, (Outcome, Unsent)) for item in value):
                # Every outcome is finished, failed or not: that releases its files.
                restored = [self._restore_one(item) for item in value]
                failure = next((item for ok, item in restored if not ok), None)
                if failure is not None:
                    return job, index, (False, failure)
                return job, index, (True, [item for _, item in restored])
        except BaseException as exc:
            return job, index, (False, exc)
        return message

    def _restore_one(self, value: Any) -> tuple:
        if isinstance(value, Unsent):
            return False, self._take_failure(value.key)
        return self.session.finish(value)

    def _take_failure(self, key: int) -> BaseException:
        with self._lock:
            record = self._failures[key]
            record[1] -= 1
            if record[1] <= 0:
                del self._failures[key]
        return record[0]
