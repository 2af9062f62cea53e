"""Feeding a pool's tasks lazily, so that a task that cannot be sent fails its call instead of hanging it.

``MemmappingPool`` packs the tasks of ``map`` and ``imap`` calls lazily, in
the standard pool's task-feeding thread, so that dumping later arrays
overlaps with running earlier tasks and a call over many distinct arrays
holds only what is in flight. An error raised there never reaches the
caller: the standard pool turns it into one failed chunk, and a ``map``
then waits forever for the chunks that were never sent.

So packing errors (an unpicklable argument, no room for a dump, an unusable
temp folder, the user's iterable raising) are caught here and the task
travels as an :class:`~memshare._transport._protocol.Unsent` placeholder,
which the worker returns at once and the result thread turns back into the
original exception object (``_dispatch``). After a
failure, a ``map`` call sends a placeholder for each remaining chunk, because
its result waits for every chunk; an ``imap`` call stops there, as the
standard pool does when the iterable raises.

Chunks: the standard pool sends ``chunksize`` items as one message. Here a
chunk is one task too: a :class:`~memshare._worker._entry.MapChunk` packed with all its items in one
pass of memshare's pickler, so each array in it is still routed (an array
repeated across items or chunks is dumped once, by the session), and the
function is pickled once per chunk instead of once per item. The worker
returns the chunk's values as one list; the pool joins the lists.

On the wire: a pool task travels as the tuple ``(token, stream)`` and its
outcome comes back as the tuple of an :class:`Outcome`'s fields. The
result spec, the same for every task of a pool, reaches each worker once,
when it starts (``_worker._entry.start_pool_worker``). The standard pool pickles each
message with the standard pickler, for which a dataclass instance costs
microseconds (copyreg's generic reduction, its fields by name) where a tuple
of numbers and bytes costs a fraction of one.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sized, Tuple, Union

from .._parent._session import Session
from .._payload._main_functions import MainFunctions
from .._payload._unpacking import unpack
from .._transport._protocol import Outcome, Task, Unsent
from .._worker._entry import MapChunk, PoolOutcome
from ._dispatch import Dispatch


def _wire(task: Task) -> Tuple[int, bytes]:
    return (task.token, task.stream)


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


class TaskFeed(Dispatch):
    """Packs a pool's tasks and restores their outcomes, failing calls cleanly."""

    def __init__(
        self,
        session: Session,
        main_functions: Optional[MainFunctions] = None,
        workers: int = 1,
        stopped: Callable[[], bool] = lambda: False,
    ) -> None:
        """``workers``: the pool's size; ``stopped``: True once the pool can run no more tasks (broken)."""
        # map and imap tasks that wrote new dumps wait for room in the pool's task thread, as the
        # standard pool's thread waits for a worker to read a large pickled task (see _heavy);
        # apply() packs in the caller's thread, which it does not block.
        super().__init__(session, workers, stopped=lambda: self._stopping or stopped())
        self._stopping = False
        # Which functions of __main__ the workers have: those go by name (see _main_functions).
        self._main = main_functions if main_functions is not None else MainFunctions("fork")

    def pack_call(self, func: Callable, args: tuple, kwargs: dict) -> Tuple[int, bytes]:
        """One call as a task (``apply``), raising what packing raised."""
        return _wire(self.session.pack_task(self._main.sent_as(func), args, kwargs))

    def pack(self, func: Callable, item: Any, star: bool) -> Tuple[int, bytes]:
        """One item of a call as a task of its own; ``func`` is what :meth:`sent_as` gave for the call."""
        args = tuple(item) if star else (item,)
        return self._pack_in_turn(func, args)

    def pack_chunk(self, func: Callable, items: List, star: bool) -> Tuple[int, bytes]:
        """Several items as one task, whose value is the list of their values; ``func`` as for :meth:`pack`."""
        return self._pack_in_turn(MapChunk(func, star), (list(items),))

    def _pack_in_turn(self, func: Callable, args: tuple) -> Tuple[int, bytes]:
        """Pack a task of the pool's task thread, once there is room for another heavy task (``_heavy``)."""
        written_before = self.wait_for_room()  # only this thread packs map and imap tasks
        task = self.session.pack_task(func, args)
        self.packed(task.token, written_before)
        return _wire(task)

    def stop(self) -> None:
        """The pool is terminating: packing waits no more for room."""
        self._stopping = True

    def sent_as(self, func: Callable) -> Callable:
        """What a call sends for ``func``: decided once per ``map`` or ``imap`` call, whose tasks are packed at
        moments the caller does not see, so that a change it makes meanwhile reaches no defined set of tasks."""
        return self._main.sent_as(func)

    def fill(self, func: Callable, items: List, star: bool, chunksize: int) -> Sized:
        """The tasks of a ``map`` over ``items``: exactly one per chunk of ``chunksize`` items, whatever fails."""
        return _FillingTasks(self, self.sent_as(func), items, star, chunksize)

    def lazy(self, func: Callable, iterable: Iterable, star: bool, chunksize: int = 1) -> Iterator:
        """The tasks of an ``imap``: packed as consumed, ending with a placeholder at the first failure.

        With ``chunksize`` 1 each item is a task whose value is the item's
        value; above, each chunk is a task whose value is a list.
        """
        iterator = iter(iterable)
        func = self.sent_as(func)
        while True:
            try:
                items = [next(iterator)] if chunksize == 1 else list(itertools.islice(iterator, chunksize))
            except StopIteration:
                return
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
            if type(value) is tuple or isinstance(value, Unsent):
                return (job, index, self._restore_one(value))
            if type(value) is list and all(type(item) is tuple or isinstance(item, Unsent) for item in value):
                # Every outcome is finished, failed or not: that releases its files.
                restored = [self._restore_one(item) for item in value]
                failure = next((item for ok, item in restored if not ok), None)
                if failure is not None:
                    return job, index, (False, failure)
                return job, index, (True, [item for _, item in restored])
        except BaseException as exc:
            return job, index, (False, exc)
        return message

    def _restore_one(self, value: Union[PoolOutcome, Unsent]) -> tuple:
        if isinstance(value, Unsent):
            return False, self.take_failure(value)
        token, ok, stream, slots = value
        self.ended(token)
        if ok and not slots:
            # No slot: no file to adopt, nothing to count or warn about (what finish does besides).
            self.session.task_done(token)
            try:
                return True, unpack(stream)
            except BaseException as exc:
                return False, exc
        return self.session.finish(Outcome(token=token, ok=ok, stream=stream, slots=slots))
