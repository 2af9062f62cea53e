"""The joblib backend's tasks, packed when loky sends them rather than when joblib dispatches them.

joblib's loky backend hands each batch to its executor as Python objects and
pickles it only in the executor's feeder thread, one message at a time, as it
writes it to a worker's pipe; the pickled bytes are dropped once sent. Packing
at dispatch instead would pickle every batch joblib dispatches ahead
(``pre_dispatch``, all of them with ``pre_dispatch="all"``), dump its large
objects and buffers, and keep the packed streams until the tasks are done. So
the backend submits a :class:`DeferredTask`: its ``__reduce__`` packs the batch
through the call's session at the moment loky's feeder pickles it, and the
packed stream lives only as long as loky's own message would.

Packing lazily is not enough on its own: memshare's packed batches never
block loky's pipe as joblib's pickled ones do, so batches that write new
dumps also wait for room among the running ones (``_heavy``).

The feeder thread has nobody to raise to: loky turns a pickling error into a
``PicklingError`` that names neither the argument nor memshare's own errors (no
room for a dump...). A batch that cannot be packed therefore travels as an
:class:`~memshare._transport._protocol.Unsent` placeholder, which the worker returns at once,
and :meth:`DeferredFeed.outcome` turns it back into the original exception
object in the parent.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Tuple

from .._parent._session import Session
from .._transport._protocol import Task, Unsent
from ._dispatch import Dispatch

#: Called after each batch is packed, with the bytes it dumped and the batch (for joblib's batch sizing).
OnPacked = Callable[[int, Any], None]


class DeferredTask:
    """A batch of one call, packed by its session only when pickled for a worker.

    Pickled at most once (loky's feeder pickles each call item once); the
    packed stream is not kept, only the task's token, which the backend needs
    to release the task's files when its future ends without an outcome.
    """

    __slots__ = ("_feed", "_batch", "token", "_abandoned")

    def __init__(self, feed: DeferredFeed, batch: Any) -> None:
        self._feed = feed
        self._batch = batch
        self.token: Optional[int] = None  # set once packed
        self._abandoned = False  # its future ended before or while it was packed

    def __reduce__(self) -> Tuple[Any, tuple]:
        packed = self._feed.pack(self)
        if isinstance(packed, Unsent):
            return Unsent, (packed.key,)
        return Task, (packed.token, packed.stream, packed.results)

    def take_batch(self) -> Any:
        """The batch, handed over once: after packing, this object no longer keeps its arguments alive."""
        batch, self._batch = self._batch, None
        return batch


class DeferredFeed(Dispatch):
    """Packs a session's deferred tasks and keeps the errors of those that could not be packed."""

    def __init__(self, session: Session, workers: int, on_packed: Optional[OnPacked] = None) -> None:
        super().__init__(session, workers, stopped=lambda: False)
        # A bound method is held weakly: a task that a broken executor keeps in its queue (loky 3.4's
        # does, after the call ended) holds this feed, and must not keep the backend alive through it,
        # nor the backend's Parallel, nor that call's iterable, whose tasks hold the caller's data.
        self._on_packed: Optional[Callable[[], Optional[OnPacked]]] = None
        if on_packed is not None:
            method = getattr(on_packed, "__self__", None) is not None
            self._on_packed = weakref.WeakMethod(on_packed) if method else lambda: on_packed

    def defer(self, batch: Any) -> DeferredTask:
        """A task standing for ``batch``, to be packed when it is pickled."""
        return DeferredTask(self, batch)

    def pack(self, deferred: DeferredTask) -> Any:
        """The :class:`Task` for ``deferred``, or an :class:`Unsent` placeholder if it cannot be packed.

        Runs in loky's feeder thread: never raises.
        """
        batch = deferred.take_batch()
        if batch is None:  # abandoned before it was packed (its arguments were let go of), or pickled twice
            reason = "its call ended before it was sent" if deferred._abandoned else "it was pickled twice"
            return self.failed(RuntimeError(f"memshare: a task was not packed: {reason}"))
        session = self.session
        written_before = self.wait_for_room()
        dumped_before = session.stats.bytes_dumped  # only this thread packs this session's tasks
        try:
            task = session.pack_task(batch)
        except BaseException as exc:  # this thread has nobody to raise to
            return self.failed(exc)
        with self._lock:  # against abandon(): a batch abandoned meanwhile must not stay heavy
            deferred.token = task.token
            abandoned = deferred._abandoned
            if not abandoned:
                self.packed(task.token, written_before)
        if abandoned:  # its future already failed (a broken executor): nobody will finish it
            session.task_done(task.token)
        on_packed = self._on_packed() if self._on_packed is not None else None
        if on_packed is not None:
            on_packed(session.stats.bytes_dumped - dumped_before, batch)
        return task

    def future_done(self, deferred: DeferredTask) -> None:
        """``deferred``'s future is done (its task ended, failed or was cancelled): it is no longer heavy."""
        if deferred.token is not None:
            self.ended(deferred.token)

    def abandon(self, deferred: DeferredTask) -> None:
        """Release what ``deferred`` holds, now or as soon as it is packed: its outcome will never be read.

        A batch not packed yet is let go of at once: a broken executor's feeder
        thread may hold the task in its queue for long after the call ended
        (loky 3.4's does), and the batch's arguments, the caller's data, must
        not live as long (Arrow buffers kept across calls would stay with them).
        """
        with self._lock:
            deferred._abandoned = True
            token = deferred.token
            if token is None:
                deferred.take_batch()
        if token is not None:
            self.ended(token)  # packed between future_done() and now, perhaps
            self.session.task_done(token)

    def outcome(self, value: Any) -> Tuple[bool, Any]:
        """What a worker returned, restored: ``(True, result)`` or ``(False, exception)``."""
        if isinstance(value, Unsent):
            return False, self.take_failure(value)
        return self.session.finish(value)
