"""Back-pressure on packing: tasks that wrote new dumps wait while every worker has one and one more is queued.

The pickling transports memshare replaces pickle a task into a pipe whose
writer blocks until a worker reads it: beyond what the workers took, they hold
one pickled task at a time. memshare's packed tasks are small (their large
arrays, buffers and objects went to dumps), so nothing blocks the thread that
packs them, and it would go on packing, and dumping, every task its transport
queues. So a task whose packing wrote new dumps counts as *heavy* until it
ends, and packing the next task waits while there are as many heavy tasks as
workers plus one: a running one per worker and one queued, the dumps of one
task more than a pickling transport holds. Tasks that write nothing new (a
shared array dumped once, tiny tasks) never wait. The wait gives up after
:data:`HEAVY_WAIT` seconds (a worker stuck in a long task, a transport that
cannot report a task's end) rather than hold up the packing thread for good.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Set

from .. import _forksafe
from .._stats import CallStats

#: How long packing waits at most for a heavy task to end before packing the next one anyway, in seconds.
HEAVY_WAIT = 30.0


def bytes_written(stats: CallStats) -> int:
    """Bytes of new dumps written so far: arrays, buffers and objects (arrays held once are not new memory)."""
    return stats.bytes_dumped + stats.bytes_buffers_dumped + stats.bytes_objects_dumped


class HeavyTasks:
    """The heavy tasks of one session that have not ended, and the wait for room among them.

    ``workers``: how many tasks run at once. ``stopped``: True once waiting
    is pointless (the session closed), asked at least every half second.
    Thread-safe.
    """

    def __init__(self, workers: int, stopped: Callable[[], bool], wait: float = HEAVY_WAIT) -> None:
        self._limit = max(1, workers) + 1
        self._stopped = stopped
        self._wait = wait
        self._lock = _forksafe.lock()
        self._room = threading.Condition(self._lock)
        self._pending: Set[int] = set()  # tokens

    def wait_for_room(self) -> None:
        """Return once fewer heavy tasks than the limit are pending, or after :data:`HEAVY_WAIT` seconds."""
        if len(self._pending) < self._limit:  # the common case, without the lock: only ended() shrinks the set
            return
        deadline = time.monotonic() + self._wait
        with self._lock:
            while len(self._pending) >= self._limit and not self._stopped():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._room.wait(min(left, 0.5))  # in slices: a session closed meanwhile ends the wait

    def packed(self, token: int, written_before: int, written_after: int) -> None:
        """Task ``token`` is packed; it is heavy if packing it wrote new dumps."""
        if written_after > written_before:
            with self._lock:
                self._pending.add(token)

    def ended(self, token: int) -> None:
        """Task ``token`` ended (done, failed, cancelled or abandoned): it no longer counts."""
        if token not in self._pending:  # most tasks: a heavy one was added before it was sent, so seen here
            return
        with self._lock:
            if token in self._pending:
                self._pending.discard(token)
                self._room.notify_all()
