"""What both front ends' feeds share: placeholders for tasks that could not be packed, and back-pressure.

The pool (``_feed.TaskFeed``) and the joblib backend (``_deferred.DeferredFeed``)
both pack tasks in a thread that has nobody to raise to: the pool's
task-feeding thread, loky's feeder thread. A task that cannot be packed
travels as an :class:`~memshare._transport._protocol.Unsent` placeholder, which the worker returns at once
and the feed turns back into the original exception object (it never crosses
a process boundary, so it need not be picklable). Both feeds also hold back
packing while enough tasks that wrote new dumps are pending (``_heavy``).
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List

from .. import _forksafe
from .._parent._session import Session
from .._transport._protocol import Unsent
from ._heavy import HeavyTasks, bytes_written


class Dispatch:
    """The failures behind a session's placeholders, and the wait for room among its heavy tasks.

    ``workers``: how many tasks run at once. ``stopped``: True once waiting
    for room is pointless (the pool broke, the session closed). Thread-safe.
    """

    def __init__(self, session: Session, workers: int, stopped: Callable[[], bool]) -> None:
        self.session = session
        self._heavy = HeavyTasks(workers, stopped=lambda: stopped() or session.closed)
        self._lock = _forksafe.lock()
        self._keys = itertools.count(1)
        self._failures: Dict[int, List] = {}  # key -> [exception, placeholders not back yet]

    def failed(self, exc: BaseException, count: int = 1) -> Unsent:
        """Record ``exc`` for ``count`` placeholders about to be sent; return the placeholder."""
        with self._lock:
            key = next(self._keys)
            self._failures[key] = [exc, count]
        return Unsent(key)

    def take_failure(self, placeholder: Unsent) -> BaseException:
        """The exception a placeholder stands for, forgotten once its last placeholder is back."""
        with self._lock:
            record = self._failures[placeholder.key]
            record[1] -= 1
            if record[1] <= 0:
                del self._failures[placeholder.key]
        return record[0]

    def wait_for_room(self) -> int:
        """Wait until another heavy task may be packed; return the bytes written so far, for :meth:`packed`.

        Only the feed's packing thread packs after waiting, so the count read
        here and the one read in :meth:`packed` bracket one task's packing.
        """
        self._heavy.wait_for_room()
        return bytes_written(self.session.stats)

    def packed(self, token: int, written_before: int) -> None:
        """Task ``token`` is packed: heavy, until it ends, if packing it wrote new dumps."""
        self._heavy.packed(token, written_before, bytes_written(self.session.stats))

    def ended(self, token: int) -> None:
        """Task ``token`` ended (done, failed, cancelled or abandoned): it is no longer heavy."""
        self._heavy.ended(token)
