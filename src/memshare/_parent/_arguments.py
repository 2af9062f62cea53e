"""An argument's route carried out while its task is pickled: what the task then holds, counted and logged.

The pickler calls :class:`ArgumentRoutes` for each array and each
out-of-band buffer it meets in a task's arguments. Each is given its route
(``_routes``, pure), and the route is carried out with the session's lock
held: a reference, a dump (``_dumps``), or the array held once
(``_session_holds``), noted in the task's :class:`TaskRecord` so that it is
released when the task is done. Each array is counted and logged once per
session, however many tasks send it.
"""

from __future__ import annotations

import itertools
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, List, Optional, Tuple

from .._config import Settings
from .._numpy import np
from .._payload._broadcast import Broadcast, sent_by_reference
from .._payload._routes import (
    DUMP_BASE,
    OWN_DUMP,
    PICKLE,
    REFERENCE,
    Route,
    buffer_route,
    input_route,
    view_in_dump,
)
from .._payload._unpacking import Reduction, input_reduction, own_input_reduction
from .._stats import PICKLED, REFERENCED, CallStats, log_buffer_decision, log_decision
from .._transport._identity import IdentityTable, MemoryKey, memory_key
from .._transport._pages import copy_on_write_unwritten
from .._transport._refs import SHARED, ArrayRef
from . import _held_once
from ._dumps import DumpTable
from ._kept_buffers import store as kept_buffers
from ._session_holds import SessionHolds


@dataclass
class TaskRecord:
    """What one pending task holds: made while its arguments are pickled, dropped when it is done."""

    files: List[str] = field(default_factory=list)  # one entry per use of a dump file
    # Shared arrays the task references, kept alive until the task is done:
    # their file is deleted when the last view dies, and a worker may not
    # have mapped it yet.
    held: List[np.ndarray] = field(default_factory=list)
    #: Files of arrays held once that the task reads: each lives at least until the task is done.
    held_once: List[Tuple[_held_once.Held, _held_once.HeldFile]] = field(default_factory=list)
    #: memshare's own failure while carrying out a route (no room for a dump,
    #: say), as opposed to a failure to pickle the caller's arguments.
    error: Optional[BaseException] = None


class ArgumentRoutes:
    """The pickler's array and buffer policies for one session's task arguments."""

    def __init__(
        self,
        settings: Settings,
        stats: CallStats,
        lock: ContextManager,
        dumps: DumpTable,
        check_open: Callable[[], None],
    ) -> None:
        """``lock`` is the session's; ``check_open`` raises once the session has closed."""
        self._settings = settings
        self._stats = stats
        self._lock = lock
        self._dumps = dumps
        self._check_open = check_open
        self._holds = SessionHolds(stats)
        # Arrays already counted (and logged) as referenced or pickled, so that
        # the figures and the log name each array once however many tasks use it.
        self._seen: IdentityTable[None] = IdentityTable()
        self._sender = next(_SENDERS)  # broadcasts are counted once per sender (see sent_by_reference)

    def reduce_argument(self, record: TaskRecord, array: np.ndarray) -> Optional[Reduction]:
        """The pickler's array policy for task arguments: decide the route, carry it out into ``record``."""
        try:
            with self._lock:
                self._check_open()  # never a new file once the session has closed (its folder is gone)
                return self._carry_out(self.route_of(array), array, record)
        except BaseException as exc:
            record.error = exc
            raise

    def reduce_broadcast(self, record: TaskRecord, shared: Broadcast) -> Optional[Reduction]:
        """The pickler's broadcast policy: its token and file, the data kept alive by ``record``; None: as usual."""
        sent = sent_by_reference(shared, self._sender)
        if sent is None:
            return None
        # No session lock: nothing of the session's is touched (no file made, the record is this
        # thread's until packed, the figures have a lock of their own).
        record.held.append(sent.data)
        if sent.first:  # counted by the broadcast itself: no weak reference per broadcast
            self._stats.add_reference(sent.data.nbytes)
            log_decision(REFERENCED, sent.data, sent.ref.path)
        return sent.reduction

    def route_of(self, array: np.ndarray) -> Route:
        """The route of an argument array under this session's settings (pure: nothing is carried out)."""
        return input_route(
            array,
            self._settings.max_nbytes,
            self._dumps.paths,
            copy_on_write_unwritten,
            promote=self._settings.promote,
            worker_mode=self.worker_mode(),
        )

    def note_arrow(self, obj: Any) -> None:
        """An Arrow object met while packing: its large buffers may be kept for later calls while it lives."""
        kept_buffers().note_owner(obj, self._settings.max_nbytes)

    def reduce_buffer(self, record: TaskRecord, buffer: pickle.PickleBuffer) -> Optional[ArrayRef]:
        """The pickler's buffer policy for task arguments: the dump standing for ``buffer``, or None: in the stream.

        A dumped buffer is mapped read-only when it is read-only, else with
        the session's mode, as an array's dump (read-only by default).
        """
        try:
            view = memoryview(buffer)
            route = buffer_route(view.nbytes, view.contiguous, self._settings.max_nbytes)
            if route.kind == PICKLE and isinstance(view.obj, np.ndarray):
                return None  # a small array's own buffer: counted as an array already
            with self._lock:
                self._check_open()  # never a new file once the session has closed (its folder is gone)
                if route.kind == PICKLE:
                    if self._dumps.pickled_buffer(_buffer_key(view)):
                        self._stats.add(buffers_pickled=1, bytes_buffers_pickled=view.nbytes)
                        log_buffer_decision(PICKLED, view.nbytes, view.obj, "in the task payload")
                    return None
                mode = "r" if view.readonly else self.worker_mode()
                return self._dumps.dump_buffer(buffer, mode, view.obj, record.files)
        except BaseException as exc:
            record.error = exc
            raise

    def _carry_out(self, route: Route, array: np.ndarray, record: TaskRecord) -> Optional[Reduction]:
        """Do what ``route`` says for ``array``, noting in ``record`` what the task holds; None: pickle it."""
        if route.kind == PICKLE:
            if self._first_sight(array):
                self._stats.add(arrays_pickled=1)
                log_decision(PICKLED, array, "in the task payload")
            return None
        if route.kind == REFERENCE:
            self._note_reference(array, route.ref, record)
            return input_reduction(route.ref)
        # The session's own files from here: kept until the task's outcome is restored (see finish).
        if route.kind == OWN_DUMP:
            self._dumps.use(route.ref.path, record.files)
            return own_input_reduction(route.ref)
        if route.kind == DUMP_BASE:
            return own_input_reduction(view_in_dump(array, route.source, self._dump(route, record)))
        return own_input_reduction(self._dump(route, record))

    def _note_reference(self, array: np.ndarray, ref: ArrayRef, record: TaskRecord) -> None:
        """``array`` goes as a reference to its file ``ref``: a shared one is kept alive; each is counted once."""
        if ref.kind == SHARED:
            record.held.append(array)
        if self._first_sight(array):
            self._stats.add(arrays_referenced=1, bytes_referenced=array.nbytes)
            log_decision(REFERENCED, array, ref.path)

    def _first_sight(self, array: np.ndarray) -> bool:
        if array in self._seen:
            return False
        self._seen.add(array, None)
        return True

    def _dump(self, route: Route, record: TaskRecord) -> ArrayRef:
        """The reference to ``route.source`` held once, if the route asks and it can be; else to its dump.

        A held file is the parent's memory: it is sent read-only or
        copy-on-write only, and kept alive by the task (its file lives as
        long as the array).
        """
        array, generation = route.source, self._dumps.generation
        if route.hold_once:
            holding = self._holds.hold(array, generation, self.worker_mode(), self._settings.temp_folder)
            if holding is not None:
                record.held_once.append(holding)
                record.held.append(array)
                held, file = holding
                return held.reference(self.worker_mode(), file)
        elif route.not_held_once is not None:
            self._holds.refuse(array, generation, route.not_held_once)
        return self._dumps.dump(array, route.mode or self.worker_mode(), record.files)

    def worker_mode(self) -> str:
        return "r+" if self._settings.mmap_mode == "w+" else self._settings.mmap_mode

    def clear(self) -> None:
        """The session closed: forget every array seen and held."""
        self._seen.clear()
        self._holds.clear()


# Process-wide so that no two sessions share a number, as two ids may in turn.
_SENDERS = itertools.count(1)


def _buffer_key(view: memoryview) -> MemoryKey:
    """A buffer's memory (of a read-only buffer too); for a buffer that is not contiguous, its exporter's identity."""
    return memory_key(np.frombuffer(view, np.uint8)) if view.contiguous else (id(view.obj), view.nbytes)
