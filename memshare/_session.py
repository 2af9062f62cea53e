"""The parent side of one pool or one joblib call: dumps, their lifetimes, results.

A :class:`Session` owns a :class:`TempFolder` and the files dumped into it.

Deduplication
    An array is dumped once per session, keyed by its identity, never by its
    content. The entry holds a weak reference whose callback removes the key
    before the array's memory (and so its ``id()``) can be reused, so a new
    array never aliases a dead one.

Staleness
    An array mutated in place after it was dumped must not be served stale.
    When an array is reused in a later *generation* (a new joblib call, a
    new pool method call) and no task that uses it is still pending, its
    bytes are compared with the file (about 0.15 s/GiB, several times cheaper
    than writing it again) and it is dumped again if they differ. While
    tasks are pending, a mutation would race with them anyway, so submitting
    the same array many times in a row costs nothing.

Early deletion
    Every task records the files it references. When no pending task
    references a file any more:

    * if its array was garbage-collected, the file is deleted at once;
    * if the array was used by two or more tasks, it is *shared*: the file
      stays until the session closes, so an array used by every task is
      written once;
    * otherwise the file becomes *idle*. Idle files are deleted, oldest
      first, whenever a new dump would make them outweigh the files pending
      tasks still use; an idle file that is used again is revived for free.

    So a call over many distinct arrays keeps about twice what is in flight,
    not everything it ever dumped.

Out-of-band buffers
    A large buffer that an argument offers to pickle out of band (pyarrow's,
    behind Arrow tables and Arrow-backed pandas columns) is dumped like an
    array and follows the same rules above, keyed by its memory (address
    and size) instead of an array's identity. Each exporter wraps the same
    memory in a new object every time it is pickled, so there is no object
    to key by or to watch weakly: the entry holds the ``PickleBuffer`` (an
    export of that memory), so the memory cannot be freed, and its address
    reused by other data, while the key names it. That pins the memory for
    the call: the next generation forgets every buffer no pending task
    reads (its file deleted, its export released), and closing the session
    forgets the rest. A buffer is so written once per call, however many
    tasks reference it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import pickle
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from . import _forksafe, _promotion
from ._config import Settings
from ._dumping import dump_array, row_slabs
from ._errors import UnpicklableArgumentError
from ._folders import TempFolder, delete_file, warn_fallback, warn_result_pickled
from ._handoff import Inbox
from ._held_memory import PAGE, changed_pages
from ._identity import IdentityTable
from ._mapping import map_file, view_of
from ._protocol import Outcome, Task, restore
from ._reducers import Reducers, Reduction, ResultSpec, input_reduction, pack
from ._refs import DUMP, SHARED, ArrayRef, data_address, root_array
from ._routes import PICKLE, REFERENCE, VIEW_OF_DUMP, Route, buffer_route, input_route, view_in_dump
from ._stats import (
    DUMPED,
    HELD_ONCE,
    NOT_HELD_ONCE,
    PICKLED,
    REFERENCED,
    CallStats,
    log_buffer_decision,
    log_decision,
    logger,
    record_finished,
)

_COMPARE_BYTES = 2 * 1024**2  # slab size: cache-friendly, no large temporaries
_PARALLEL_COMPARE_BYTES = 64 * 1024**2  # compare on two threads from this size on


@dataclass
class _Dump:
    """One array dumped in this session."""

    ref: Optional[ArrayRef]  # None while no file holds the array
    generation: int  # the generation in which the file was last known current
    pending: int = 0  # pending tasks that reference the file
    uses: int = 0  # tasks that referenced this array so far
    parent_view: Optional[np.ndarray] = field(default=None, repr=False)
    alive: bool = True  # False once the array was garbage-collected


@dataclass
class _BufferDump:
    """One out-of-band buffer dumped in this session: its dump, and the export that keeps its memory."""

    entry: _Dump
    export: pickle.PickleBuffer


@dataclass
class _TaskRecord:
    """What one pending task holds: made while its arguments are pickled, dropped when it is done."""

    files: List[str] = field(default_factory=list)  # one entry per use of a dump file
    # Shared arrays the task references, kept alive until the task is done:
    # their file is deleted when the last view dies, and a worker may not
    # have mapped it yet.
    held: List[np.ndarray] = field(default_factory=list)
    #: Arrays held once that the task reads: their files are not rewritten in place while it is pending.
    held_once: List[_promotion.Held] = field(default_factory=list)
    #: memshare's own failure while carrying out a route (no room for a dump,
    #: say), as opposed to a failure to pickle the caller's arguments.
    error: Optional[BaseException] = None


class Session:
    """Dumps, references and results of one pool or call. Thread-safe."""

    def __init__(self, settings: Settings, reducers: Optional[Reducers] = None) -> None:
        """``reducers`` (type -> reducer) are used when pickling task arguments."""
        self.settings = settings
        self._reducers = dict(reducers) if reducers else None
        self.folder = TempFolder(settings.temp_folder)
        self.stats = CallStats()
        # Re-entrant because a dumped array may be garbage-collected while
        # this thread packs a task, and its weak reference callback (_forget)
        # then takes the lock in the same thread.
        self._lock = _forksafe.rlock()
        self._by_array: IdentityTable[_Dump] = IdentityTable()
        self._by_path: Dict[str, _Dump] = {}  # the dump table: current files only
        self._tasks: Dict[int, _TaskRecord] = {}  # pending tasks
        self._idle: OrderedDict[str, _Dump] = OrderedDict()
        self._tokens = itertools.count(1)
        # next() on a count is atomic under the GIL: a new call needs no lock.
        self._generations = itertools.count(1)
        self._generation = 0
        # Arrays already counted (and logged) as referenced or pickled, so that
        # the figures and the log name each array once however many tasks use it.
        self._seen: IdentityTable[None] = IdentityTable()
        # Arrays held once already brought up to date in a generation, and
        # arrays found unfit (or refused in place) in one: each is looked at
        # once per call, not once per task.
        self._refreshed: IdentityTable[int] = IdentityTable()
        self._not_held_once: IdentityTable[int] = IdentityTable()
        # Out-of-band buffers of this generation, by (address, size) of their
        # memory: the dumped ones, and the ones counted as pickled in the stream.
        self._buffers: Dict[Tuple[int, int], _BufferDump] = {}
        self._buffer_keys: Dict[str, Tuple[int, int]] = {}  # dump path -> its buffer's key
        self._buffers_in_band: Set[Tuple[int, int]] = set()
        self._buffers_generation = 0
        self._closed = False
        self._inbox = self._open_inbox()
        self._results = ResultSpec(
            self.folder.pair if self._inbox else dataclasses.replace(self.folder.pair, in_memory=False),
            settings.max_nbytes,
            self._inbox.address if self._inbox else None,
            os.getpid(),
        )

    def _open_inbox(self) -> Optional[Inbox]:
        """Where workers pass result memfds (see ``_handoff``); None: results are named files."""
        if not self.folder.pair.in_memory:
            return None
        try:
            return Inbox(self.folder.pair.primary)  # the session's private folder: no other user can connect
        except OSError as exc:
            logger.info("memshare: results are named files, no socket to receive memfds on: %s", exc)
            return None

    # -- calls ---------------------------------------------------------------

    def new_generation(self) -> None:
        """Mark the start of a new call: reused arrays get checked for changes, earlier calls' buffers go."""
        self._generation = next(self._generations)
        if self._buffers:  # the lock only when there are buffers to let go of (see _new_buffer_generation)
            with self._lock:
                self._new_buffer_generation()

    # -- tasks ---------------------------------------------------------------

    def pack_task(self, func: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Task:
        """Pack a call of ``func`` for a worker, dumping large arrays as needed.

        Any failure to pickle the function or an argument (whatever the
        exception its ``__reduce__`` raised) is raised in the caller's thread
        as :class:`UnpicklableArgumentError`, the original as its cause, as
        joblib raises a ``PicklingError``. memshare's own failures while
        dumping (``SharedMemoryFullError``...) and ``KeyboardInterrupt`` are
        raised as themselves.
        """
        # The lock is taken for each array the pickler meets (_reduce_argument)
        # and to register the task, not across the pickling of everything
        # else: the result thread finishing other tasks need not wait for it.
        self._check_open()
        record = _TaskRecord()
        reduce_array = functools.partial(self._reduce_argument, record)
        reduce_buffer = None  # no threshold: every buffer stays in the stream
        if self.settings.max_nbytes is not None:
            reduce_buffer = functools.partial(self._reduce_buffer, record)
        try:
            stream = pack(
                (func, args, kwargs or {}), reduce_array, reducers=self._reducers, reduce_buffer=reduce_buffer
            )
        except Exception as exc:
            self._abandon(record)
            if exc is record.error:
                raise
            raise UnpicklableArgumentError(
                f"memshare: cannot send a call of {_name_of(func)} to a worker process: "
                f"{type(exc).__name__}: {exc}. Pass only "
                "picklable arguments (locks, open files, generators, sockets and database connections are "
                "not), create such objects inside the task, or use backend='threading'."
            ) from exc
        except BaseException:
            self._abandon(record)
            raise
        with self._lock:
            if self._closed:  # closed while this task was packed: its files went with the folder
                self._release_record(record)
                self._check_open()
            token = next(self._tokens)
            self._tasks[token] = record
            self.stats.add(tasks=1, bytes_pickled=len(stream))
        return Task(token, stream, self._results)

    def _abandon(self, record: _TaskRecord) -> None:
        """Release what a task that will never be sent holds."""
        with self._lock:
            self._release_record(record)

    def finish(self, outcome: Outcome) -> Tuple[bool, Any]:
        """Release a finished task's files and restore its result or exception.

        The worker leaves warnings about its results to the parent (its own
        would go to its stderr, out of the caller's ``warnings`` filters):
        results that went to the disk fallback, or by value, warn here, once
        per call like inputs, and are counted.
        """
        self.task_done(outcome.token)
        files, by_value = outcome.result_files(), outcome.by_value()
        pair = self.folder.pair
        on_disk = [ref.nbytes for ref in files if pair.is_fallback(ref.path)]
        self.stats.add(
            results_by_reference=len(files),
            bytes_results_by_reference=sum(ref.nbytes for ref in files),
            fallback_files=len(on_disk),
            results_pickled_no_room=len(by_value),
        )
        if on_disk:
            warn_fallback(pair.primary, pair.fallback, max(on_disk), stacklevel=2)
        if by_value:
            warn_result_pickled(pair, max(array.nbytes for array in by_value))
        if self._inbox is None:
            return restore(outcome, folder=self.folder.pair)
        return self._restore_with_memfds(outcome, self._inbox)

    def _restore_with_memfds(self, outcome: Outcome, inbox: Inbox) -> Tuple[bool, Any]:
        """Restore ``outcome``, taking the result memfds its worker passed; close any left unclaimed.

        Two slots may name one memfd (two views of a worker's shared array):
        each gets its own descriptor of the one received.
        """
        claimed: Dict[Tuple[int, int], int] = {}

        def receive(identity: Tuple[int, int]) -> Optional[int]:
            if identity not in claimed:
                fd = inbox.take(identity)
                if fd is None:
                    return None
                claimed[identity] = fd
            return os.dup(claimed[identity])

        try:
            return restore(outcome, receive, folder=self.folder.pair)
        finally:
            for fd in claimed.values():
                os.close(fd)
            # One descriptor came per memfd this outcome names (others of the same memfd
            # belong to other outcomes): close those it did not claim.
            inbox.discard({(ref.device, ref.inode) for ref in outcome.result_files()} - claimed.keys())

    def task_done(self, token: int) -> None:
        """The task ``token`` will not read its inputs any more (done or abandoned)."""
        with self._lock:
            record = self._tasks.pop(token, None)
            if record is not None:
                self._release_record(record)

    # -- carrying out routes (called while pickling, each with the lock held) ---

    def _reduce_argument(self, record: _TaskRecord, array: np.ndarray) -> Optional[Reduction]:
        """The pickler's array policy for task arguments: decide the route, carry it out into ``record``."""
        try:
            with self._lock:
                self._check_open()  # never a new file once the session has closed (its folder is gone)
                route = input_route(array, self.settings.max_nbytes, self._by_path.keys(), copy_on_write_unwritten)
                return self._carry_out(route, array, record)
        except BaseException as exc:
            record.error = exc
            raise

    def _reduce_buffer(self, record: _TaskRecord, buffer: pickle.PickleBuffer) -> Optional[ArrayRef]:
        """The pickler's buffer policy for task arguments: the dump standing for ``buffer``, or None: in the stream."""
        try:
            view = memoryview(buffer)
            route = buffer_route(view.nbytes, view.contiguous, self.settings.max_nbytes)
            if route.kind == PICKLE and isinstance(view.obj, np.ndarray):
                return None  # a small array's own buffer: counted as an array already
            with self._lock:
                self._check_open()  # never a new file once the session has closed (its folder is gone)
                self._new_buffer_generation()
                if route.kind == PICKLE:
                    key = (_buffer_address(view), view.nbytes)
                    if key not in self._buffers_in_band:
                        self._buffers_in_band.add(key)
                        self.stats.add(buffers_pickled=1, bytes_buffers_pickled=view.nbytes)
                        log_buffer_decision(PICKLED, view.nbytes, view.obj, "in the task payload")
                    return None
                return self._dump_buffer(buffer, view, record)
        except BaseException as exc:
            record.error = exc
            raise

    def _dump_buffer(self, buffer: pickle.PickleBuffer, view: memoryview, record: _TaskRecord) -> ArrayRef:
        """The reference to ``buffer``'s dump, written now unless this generation wrote it already.

        Workers map it read-only when the buffer is read-only, else with the
        session's mode, as an array's dump (read-only by default).
        """
        raw = np.frombuffer(buffer.raw(), np.uint8)  # no copy: the bytes to write
        key = (data_address(raw), raw.nbytes)
        wanted = "r" if view.readonly else self._worker_mode()
        held = self._buffers.get(key)
        if held is None:
            held = self._buffers[key] = _BufferDump(_Dump(ref=None, generation=self._generation), buffer)
        entry = held.entry
        if entry.ref is None:  # new, or its idle file was deleted for room since
            self._evict_idle(limit=self._pending_bytes())
            ref, seconds = dump_array(self.folder.pair, raw, DUMP, wanted)
            entry.ref = ref
            self._by_path[ref.path] = entry
            self._buffer_keys[ref.path] = key
            self.stats.add(buffers_dumped=1, bytes_buffers_dumped=raw.nbytes, dump_seconds=seconds)
            if self.folder.pair.is_fallback(ref.path):
                self.stats.add(fallback_files=1)
            log_buffer_decision(DUMPED, raw.nbytes, view.obj, ref.path, seconds)
        self._use(entry, record)
        return entry.ref if entry.ref.mode == wanted else dataclasses.replace(entry.ref, mode=wanted)

    def _new_buffer_generation(self) -> None:
        """At the first buffer of a new generation: forget the buffers of earlier ones that no task reads.

        Their memory is the caller's and may change or go between calls, so
        a later call dumps it again; forgetting releases the export that
        pinned it, and deletes the file.
        """
        if self._buffers_generation == self._generation:
            return
        self._buffers_generation = self._generation
        self._buffers_in_band.clear()
        for key, held in list(self._buffers.items()):
            if held.entry.pending == 0:
                self._forget_buffer(key)

    def _forget_buffer(self, key: Tuple[int, int]) -> None:
        """Delete the dump of the buffer at ``key`` and release its export."""
        held = self._buffers.pop(key)
        if held.entry.ref is not None:
            self._buffer_keys.pop(held.entry.ref.path, None)
        self._delete_file(held.entry)

    def _carry_out(self, route: Route, array: np.ndarray, record: _TaskRecord) -> Optional[Reduction]:
        """Do what ``route`` says for ``array``, noting in ``record`` what the task holds; None: pickle it."""
        if route.kind == PICKLE:
            if self._first_sight(array):
                self.stats.add(arrays_pickled=1)
                log_decision(PICKLED, array, "in the task payload")
            return None
        if route.kind == REFERENCE:
            if route.ref.kind == SHARED:
                record.held.append(array)
            if self._first_sight(array):
                self.stats.add(arrays_referenced=1, bytes_referenced=array.nbytes)
                log_decision(REFERENCED, array, route.ref.path)
            return input_reduction(route.ref)
        if route.kind == VIEW_OF_DUMP and route.source is None:
            # A view of one of this session's dumps, met again (sent from a nested call).
            self._use(self._by_path[route.ref.path], record)
            return input_reduction(route.ref)
        if route.kind == VIEW_OF_DUMP:
            base_ref = self._dump(route.source, None, record)
            return input_reduction(view_in_dump(array, route.source, base_ref))
        return input_reduction(self._dump(route.source, route.mode, record))

    def _first_sight(self, array: np.ndarray) -> bool:
        if array in self._seen:
            return False
        self._seen.add(array, None)
        return True

    def _dump(self, array: np.ndarray, mode: Optional[str], record: _TaskRecord) -> ArrayRef:
        """The reference to ``array``'s dump (or its held file), workers mapping it with ``mode`` or the session's.

        An earlier call of the session may have dumped the array when its
        mode was another one (a copy-on-write memmap made read-only since):
        the file is reused, the mode is always the one asked for now. Any mode
        is safe for a dump: the file is the session's copy, never the
        parent's array.
        """
        if mode is None and self.settings.promote:
            ref = self._hold_once(array, record)
            if ref is not None:
                return ref
        wanted = mode or self._worker_mode()
        entry = self._by_array.get(array)
        if entry is not None and entry.ref is not None and entry.generation != self._generation:
            if entry.pending == 0 and not self._matches_file(entry, array):
                self._delete_file(entry)
            entry.generation = self._generation
        if entry is None:
            entry = _Dump(ref=None, generation=self._generation)
            self._by_array.add(array, entry, self._forget)
        if entry.ref is None:
            self._evict_idle(limit=self._pending_bytes())
            ref, seconds = dump_array(self.folder.pair, array, DUMP, wanted)
            entry.ref, entry.generation = ref, self._generation
            self._by_path[ref.path] = entry
            self.stats.add(arrays_dumped=1, bytes_dumped=array.nbytes, dump_seconds=seconds)
            if self.folder.pair.is_fallback(ref.path):
                self.stats.add(fallback_files=1)
            log_decision(DUMPED, array, ref.path, seconds)
        self._use(entry, record)
        return entry.ref if entry.ref.mode == wanted else dataclasses.replace(entry.ref, mode=wanted)

    def _hold_once(self, array: np.ndarray, record: _TaskRecord) -> Optional[ArrayRef]:
        """The reference to ``array``'s own file when it is (or now becomes) held once; None: dump it.

        An array is promoted the first time it is dumped, brought up to date
        once per generation after that, and dumped as before when it cannot
        be held once (the reason is logged once per call) or cannot be
        brought up to date in place.

        The mode rule comes first, for every array: a held file is the
        parent's memory, so a session whose workers map writable (``r+``,
        ``w+``) dumps the array even when an earlier call of the process
        holds it already; the held file is neither sent nor refreshed.
        An array held once is otherwise sent whatever this session's
        ``temp_folder``: it needs no new file, so nothing is written
        anywhere (``promote=False`` does dump it: that session turned
        holding once off).
        """
        generation = self._generation
        if self._not_held_once.get(array) == generation:
            return None
        worker_mode = self._worker_mode()
        mode_reason = _promotion.mode_unfit_reason(worker_mode)
        if mode_reason is not None:
            self._not_held_once.add(array, generation)
            log_decision(NOT_HELD_ONCE, array, f"dumped instead: {mode_reason}")
            return None
        held = _promotion.lookup(array)
        if held is None:
            reason = _promotion.unfit_reason(array, worker_mode, self.settings.temp_folder)
            if reason is None:
                try:
                    held, seconds = _promotion.promote(array)
                except OSError as exc:
                    reason = f"{exc.strerror or exc}"
            if held is None:
                self._not_held_once.add(array, generation)
                log_decision(NOT_HELD_ONCE, array, f"dumped instead: {reason}")
                return None
            self.stats.add(arrays_held_once=1, bytes_held_once=array.nbytes, dump_seconds=seconds)
            log_decision(HELD_ONCE, array, held.ref.path, seconds)
            self._refreshed.add(array, generation)
        elif self._refreshed.get(array) != generation:
            rewritten = held.refresh(array)
            if rewritten is None:
                if not held.describes(array):
                    _promotion.forget(array)  # its memory moved (ndarray.resize): a plain array again
                self._not_held_once.add(array, generation)
                log_decision(
                    NOT_HELD_ONCE,
                    array,
                    "dumped instead: its file cannot be brought up to date in place "
                    "(a task still reads it, or a forked child still shares its pages)",
                )
                return None
            self.stats.add(bytes_refreshed=rewritten)
            self._refreshed.add(array, generation)
        held.acquire()
        record.held_once.append(held)
        record.held.append(array)  # its file lives as long as the array
        return held.reference(worker_mode)

    def _worker_mode(self) -> str:
        return "r+" if self.settings.mmap_mode == "w+" else self.settings.mmap_mode

    def _use(self, entry: _Dump, record: _TaskRecord) -> None:
        self._idle.pop(entry.ref.path, None)
        entry.uses += 1
        entry.pending += 1
        record.files.append(entry.ref.path)

    # -- lifetimes -------------------------------------------------------------

    def _matches_file(self, entry: _Dump, array: np.ndarray) -> bool:
        """True when the file still holds exactly ``array``'s bytes.

        Bitwise, so -0.0 against 0.0 or a changed NaN payload count as
        changes. Memory-bandwidth bound: large arrays are compared in two
        halves on two threads (numpy releases the GIL while comparing).
        """
        if entry.parent_view is None:
            entry.parent_view = view_of(map_file(entry.ref), entry.ref)
        stored = entry.parent_view
        if stored.shape != array.shape or stored.dtype != array.dtype:
            return False
        if array.ndim == 0:
            return stored.tobytes() == array.tobytes()
        rows = array.shape[0]
        if array.nbytes < _PARALLEL_COMPARE_BYTES or rows < 2 or (os.cpu_count() or 1) < 2:
            return _same_rows(array, stored, 0, rows)
        middle = rows // 2
        with ThreadPoolExecutor(2, thread_name_prefix="memshare-compare") as pool:
            halves = [
                pool.submit(_same_rows, array, stored, 0, middle),
                pool.submit(_same_rows, array, stored, middle, rows),
            ]
            return all(half.result() for half in halves)

    def _release_record(self, record: _TaskRecord) -> None:
        self._release(record.files)
        for held in record.held_once:
            held.release()
        record.held_once.clear()

    def _release(self, paths: List[str]) -> None:
        for path in paths:
            entry = self._by_path.get(path)
            if entry is None:
                continue
            entry.pending -= 1
            if entry.pending > 0:
                continue
            key = self._buffer_keys.get(path)
            if key is not None:
                # A buffer used by one task so far is forgotten at once: pinning its
                # memory for the rest of the call would hold, for a buffer made anew for
                # each task, one copy per task. A buffer used by several tasks stays.
                if entry.uses < 2:
                    self._forget_buffer(key)
            elif not entry.alive:
                self._delete_file(entry)  # its entry already left _by_array (_forget)
            elif entry.uses < 2:
                self._idle[path] = entry

    def _pending_bytes(self) -> int:
        return sum(e.ref.nbytes for e in self._by_path.values() if e.pending > 0)

    def _evict_idle(self, limit: int) -> None:
        """Delete idle files, oldest first, until they weigh at most ``limit``."""
        idle_bytes = sum(e.ref.nbytes for e in self._idle.values())
        while self._idle and idle_bytes > limit:
            _, entry = self._idle.popitem(last=False)
            idle_bytes -= entry.ref.nbytes
            self._delete_file(entry)  # the entry stays: a later use is then "shared"

    def _forget(self, entry: _Dump) -> None:
        """The array of ``entry`` was garbage-collected: its file goes once no task needs it."""
        with self._lock:
            entry.alive = False
            if entry.pending == 0:
                self._delete_file(entry)

    def _delete_file(self, entry: _Dump) -> None:
        if entry.ref is None:
            return
        self._by_path.pop(entry.ref.path, None)
        self._idle.pop(entry.ref.path, None)
        entry.parent_view = None
        delete_file(entry.ref.path)
        entry.ref = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("memshare: this pool or call has already finished")

    def close(self) -> None:
        """Delete every file of the session; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for entry in list(self._by_path.values()):
                entry.parent_view = None
                delete_file(entry.ref.path)  # a memfd is closed here; named files also go with the folder
                entry.ref = None
            self._by_array.clear()
            self._by_path.clear()
            self._idle.clear()
            self._seen.clear()
            self._refreshed.clear()
            self._not_held_once.clear()
            self._buffers.clear()  # their files went above; this releases their exports
            self._buffer_keys.clear()
            self._buffers_in_band.clear()
            for record in self._tasks.values():
                self._release_record(record)
            self._tasks.clear()
        if self._inbox is not None:
            self._inbox.close()  # descriptors of outcomes never restored go with it
        self.folder.remove()
        record_finished(self.stats)


def copy_on_write_unwritten(array: np.ndarray) -> bool:
    """True when no page of the copy-on-write memmap behind ``array`` is private to this process.

    Asked of ``/proc/self/pagemap`` for the whole mapping of the memmap
    (not just the view's pages: simpler, and a written page anywhere is
    rare). A page is private once written, and only then can it differ
    from the file. False when the page flags cannot be read. A write made
    after this answer races with the tasks, as any write to an argument
    while tasks read it does.
    """
    root = root_array(array)
    start = data_address(root)
    first_page = start // PAGE * PAGE
    end = -(-(start + root.nbytes) // PAGE) * PAGE
    try:
        return changed_pages(first_page, end).size == 0
    except OSError:
        return False


def _buffer_address(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (of a read-only buffer too); else an identity."""
    return data_address(np.frombuffer(view, np.uint8)) if view.contiguous else id(view.obj)


def _name_of(func: Any) -> str:
    items = getattr(func, "items", None)  # a joblib batch: name the function it calls
    if isinstance(items, list) and items and isinstance(items[0], tuple):
        func = items[0][0]
    inner = getattr(func, "func", None)  # a pool's map chunk, or a functools.partial: the function it calls
    if callable(inner):
        func = inner
    return getattr(func, "__qualname__", None) or type(func).__name__


def _same_rows(array: np.ndarray, stored: np.ndarray, start: int, stop: int) -> bool:
    """Bitwise equality of ``array[start:stop]`` and ``stored[start:stop]``, a slab at a time."""
    for rows in row_slabs(array, start, stop, _COMPARE_BYTES):
        ours = _raw(np.ascontiguousarray(array[rows]))
        theirs = _raw(np.ascontiguousarray(stored[rows]))
        if not np.array_equal(ours, theirs):
            return False
    return True


def _raw(contiguous: np.ndarray) -> np.ndarray:
    raw = contiguous.reshape(-1).view(np.uint8)
    return raw.view(np.uint64) if raw.size % 8 == 0 else raw
