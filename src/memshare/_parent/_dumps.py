"""The dump files of one session: one per array or buffer, deleted as soon as nothing needs it, new when stale.

A :class:`DumpTable` writes an array (keyed by its identity) or an argument's
out-of-band buffer (keyed by its memory) to a dump file at most once per
generation, counts the pending tasks that read each file, and deletes a file
when its array is collected, when idle files need the room, or when the
array changed since it was written (once no pending task reads it: a
changed array gets a new file). Not thread-safe on its own: the session
calls every method with its lock held.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Deque, Dict, KeysView, List, Optional, Set, Tuple

import numpy as np

from .._lifetime._folders import FolderPair, delete_file
from .._stats import DUMPED, REUSED, CallStats, log_buffer_decision, log_decision, log_object_decision
from .._transport._compare import same_bytes
from .._transport._dumping import dump_array
from .._transport._identity import IdentityTable
from .._transport._mapping import map_file, view_of
from .._transport._refs import DUMP, ArrayRef, data_address
from ._kept_buffers import KeptIn

# Of how many finished tasks the object and buffer dumps used by that task alone are kept for a later task.
_RECENT_SINGLE_USE = 2


@dataclass
class _Dump:
    """One array (or buffer) dumped in this session."""

    ref: Optional[ArrayRef]  # None while no file holds the array
    generation: int  # the generation in which the file was last known current
    pending: int = 0  # pending tasks that reference the file
    uses: int = 0  # tasks that referenced this array so far
    parent_view: Optional[np.ndarray] = field(default=None, repr=False)
    alive: bool = True  # False once the array was garbage-collected


@dataclass
class _ObjectDump:
    """One argument object pickled once in this generation: its dump, the object, what its payload needs."""

    entry: _Dump
    obj: Any  # kept: its id() names it for the call, and must not be reused by another object meanwhile
    needs: Any  # what the payload references (its own dumps...), released with it through ``release_needs``


@dataclass
class _BufferDump:
    """One out-of-band buffer dumped in this session: its dump, and the export that keeps its memory."""

    entry: _Dump
    export: pickle.PickleBuffer


class DumpTable:
    """The dumps of one session, by array, by buffer memory and by path."""

    def __init__(
        self,
        pair: FolderPair,
        stats: CallStats,
        lock: ContextManager,
        release_needs: Callable[[Any], None] = lambda needs: None,
        kept: Optional[KeptIn] = None,
    ) -> None:
        """``lock`` is the session's, re-entrant: taken here only by the callback of a collected array.

        ``release_needs`` lets go of what an object's payload references
        (the ``needs`` given to :meth:`dump_object`) once its dump is forgotten.
        ``kept``: where buffers of live Arrow objects are kept across calls
        (``_kept_buffers``); None writes every buffer into this session's folder.
        """
        self._pair = pair
        self._kept = kept
        self._kept_paths: Set[str] = set()  # files of ``kept`` this table uses: released, never deleted, here
        self._release_needs = release_needs
        # Argument objects pickled once, by the path of their dump (this generation's and earlier
        # ones' still read by pending tasks); this generation's by id() of the object.
        self._objects: Dict[str, _ObjectDump] = {}
        self._current_objects: Dict[int, str] = {}
        self._stats = stats
        self._lock = lock
        # An array is keyed by its identity, never by its content. The weak
        # reference's callback removes the key before the array's memory (and
        # so its id()) can be reused: a new array never aliases a dead one.
        self._by_array: IdentityTable[_Dump] = IdentityTable()
        self._by_path: Dict[str, _Dump] = {}  # current files only
        self._idle: OrderedDict[str, _Dump] = OrderedDict()
        self._generations = itertools.count(1)
        self.generation = 0
        # Out-of-band buffers of this generation, by (address, size) of their
        # memory: the dumped ones, and the ones counted as pickled in the stream.
        self._buffers: Dict[Tuple[int, int], _BufferDump] = {}
        self._buffer_keys: Dict[str, Tuple[int, int]] = {}  # dump path -> its buffer's key
        self._buffers_in_band: Set[Tuple[int, int]] = set()
        self._buffers_generation = 0
        # Object and buffer dumps whose only task so far is done, kept for a later task of the call that
        # may name them again (see release): the paths still kept, and the paths kept per finished task,
        # newest last (a path revived or deleted since is in the second but no longer in the first).
        self._recent: Set[str] = set()
        self._recent_tasks: Deque[List[str]] = deque()

    @property
    def paths(self) -> KeysView[str]:
        """The paths of the current dump files (a live, read-only view)."""
        return self._by_path.keys()

    def new_generation(self) -> None:
        """A new call starts: reused arrays are checked for changes, earlier calls' buffers go.

        Called without the lock: next() on a count is atomic under the GIL;
        the lock is taken only when there are buffers to let go of.
        """
        self.generation = next(self._generations)
        if self._buffers or self._current_objects:
            with self._lock:
                self._new_buffer_generation()
                self._forget_objects()

    # -- arrays --------------------------------------------------------------

    def dump(self, array: np.ndarray, mode: str, files: List[str]) -> ArrayRef:
        """The reference to ``array``'s dump mapped with ``mode``, written now unless current; noted in ``files``.

        An array reused in a later generation is compared with its file and
        written to a new one if it changed: a task sees its arguments as they
        were when it was packed. Tasks still reading the old file keep it; it
        goes with the last of them. An earlier call may have dumped it with
        another mode (a copy-on-write memmap made read-only since): the file
        is reused, mapped with the mode asked for now. Any mode is safe: the
        file is the session's copy.
        """
        entry = self._by_array.get(array)
        if entry is not None and entry.ref is not None and entry.generation != self.generation:
            if not _matches_file(entry, array):
                self._retire_file(entry)
            entry.generation = self.generation
        if entry is None:
            entry = _Dump(ref=None, generation=self.generation)
            self._by_array.add(array, entry, self._forget)
        if entry.ref is None:
            self._evict_idle(limit=self._pending_bytes())
            ref, seconds = dump_array(self._pair, array, DUMP, mode)
            entry.ref, entry.generation = ref, self.generation
            self._by_path[ref.path] = entry
            self._stats.add(arrays_dumped=1, bytes_dumped=array.nbytes, dump_seconds=seconds)
            if self._pair.is_fallback(ref.path):
                self._stats.add(fallback_files=1)
            log_decision(DUMPED, array, ref.path, seconds)
        self._use(entry, files)
        return _in_mode(entry.ref, mode)

    def ref_at(self, path: str) -> Optional[ArrayRef]:
        """The reference of the dump file at ``path`` while this table holds it, else None."""
        entry = self._by_path.get(path)
        return None if entry is None else entry.ref

    def use(self, path: str, files: List[str]) -> None:
        """One more task reads the current dump at ``path``; noted in ``files``."""
        self._use(self._by_path[path], files)

    # -- out-of-band buffers -------------------------------------------------

    def pickled_buffer(self, key: Tuple[int, int]) -> bool:
        """True the first time in this generation that the buffer at ``key`` (address, size) stays in the stream."""
        self._new_buffer_generation()
        if key in self._buffers_in_band:
            return False
        self._buffers_in_band.add(key)
        return True

    def dump_buffer(self, buffer: pickle.PickleBuffer, mode: str, exporter: object, files: List[str]) -> ArrayRef:
        """The reference to ``buffer``'s dump mapped with ``mode``, written now unless this generation wrote it.

        A buffer is keyed by its memory: each exporter wraps the same memory
        in a new object every time it is pickled, so there is no object to
        key by or to watch weakly. The entry holds the ``PickleBuffer`` (an
        export of that memory), so the memory cannot be freed, and its
        address reused by other data, while the key names it. That pins the
        memory for the call: the next generation forgets every buffer no
        pending task reads, and closing the table forgets the rest.
        """
        self._new_buffer_generation()
        raw = np.frombuffer(buffer.raw(), np.uint8)  # no copy: the bytes to write
        key = (data_address(raw), raw.nbytes)
        held = self._buffers.get(key)
        if held is not None and held.entry.ref is not None and held.entry.generation != self.generation:
            # Kept from an earlier call because a task still reads it: the memory may have changed since.
            if _matches_file(held.entry, raw):
                held.entry.generation = self.generation
            else:
                self._retire_buffer(key)
                held = None
        if held is None:
            held = self._buffers[key] = _BufferDump(_Dump(ref=None, generation=self.generation), buffer)
        entry = held.entry
        if entry.ref is None:  # new, or its idle file was deleted for room since
            ref = self._kept_file(key, raw, mode, exporter)
            if ref is None:
                self._evict_idle(limit=self._pending_bytes())
                ref, seconds = dump_array(self._pair, raw, DUMP, mode)
                self._count_dumped(raw, exporter, ref, seconds, self._pair.is_fallback(ref.path))
            entry.ref, entry.generation = ref, self.generation
            self._by_path[ref.path] = entry
            self._buffer_keys[ref.path] = key
        self._use(entry, files)
        return _in_mode(entry.ref, mode)

    def _kept_file(self, key: Tuple[int, int], raw: np.ndarray, mode: str, exporter: object) -> Optional[ArrayRef]:
        """The buffer's file kept across calls: an earlier call's if it holds the same bytes, else a new one;
        None when the buffer is not kept (no live Arrow object owns it, or workers may write to it)."""
        if self._kept is None or mode not in ("r", "c"):
            return None
        ref = self._kept.reuse(key, raw)
        if ref is not None and ref.path in self._by_path:
            # The file of a buffer retired as changed, found equal again (written back meanwhile): a path
            # names one entry, so this call takes a file of its own.
            self._kept.release(ref.path)
            return None
        if ref is not None:
            self._stats.add(buffers_reused=1, bytes_buffers_reused=raw.nbytes)
            log_buffer_decision(REUSED, raw.nbytes, exporter, f"{ref.path}, written by an earlier call")
        else:
            written = self._kept.keep(key, raw)
            if written is None:
                return None
            ref, seconds, fallback = written
            self._count_dumped(raw, exporter, ref, seconds, fallback)
        self._kept_paths.add(ref.path)
        return ref

    def _count_dumped(self, raw: np.ndarray, exporter: object, ref: ArrayRef, seconds: float, fallback: bool) -> None:
        self._stats.add(buffers_dumped=1, bytes_buffers_dumped=raw.nbytes, dump_seconds=seconds)
        if fallback:
            self._stats.add(fallback_files=1)
        log_buffer_decision(DUMPED, raw.nbytes, exporter, ref.path, seconds)

    # -- argument objects ------------------------------------------------------

    def object_dump(self, obj: Any, files: List[str]) -> Optional[ArrayRef]:
        """The dump of ``obj``'s payload made in this generation, now used by one more task; None if there is none."""
        held = self._current_object(obj)
        if held is None:
            return None
        self._use(held.entry, files)
        return held.entry.ref

    def dump_object(self, obj: Any, payload: bytes, needs: Any, files: List[str]) -> ArrayRef:
        """Write ``obj``'s payload (pickled on its own) to a dump, read-only, for the tasks of this generation.

        The object is pickled once per generation: a later call pickles it
        again, since it may have changed in between (nothing says when a
        Python object changes). The entry keeps the object, so that its
        ``id()`` names nothing else while the dump is current, and ``needs``
        (what its payload references), released with the dump. Should
        another thread have dumped the same object meanwhile, its dump serves
        and this payload's ``needs`` are released.
        """
        held = self._current_object(obj)
        if held is not None:
            self._release_needs(needs)
        else:
            raw = np.frombuffer(payload, np.uint8)
            self._evict_idle(limit=self._pending_bytes())
            ref, seconds = dump_array(self._pair, raw, DUMP, "r")
            held = _ObjectDump(_Dump(ref=ref, generation=self.generation), obj, needs)
            self._objects[ref.path] = held
            self._current_objects[id(obj)] = ref.path
            self._by_path[ref.path] = held.entry
            self._stats.add(objects_dumped=1, bytes_objects_dumped=raw.nbytes, dump_seconds=seconds)
            if self._pair.is_fallback(ref.path):
                self._stats.add(fallback_files=1)
            log_object_decision(DUMPED, raw.nbytes, obj, ref.path, seconds)
        self._use(held.entry, files)
        return held.entry.ref

    def _current_object(self, obj: Any) -> Optional[_ObjectDump]:
        path = self._current_objects.get(id(obj))
        held = self._objects.get(path) if path is not None else None
        return held if held is not None and held.obj is obj else None

    def _forget_objects(self) -> None:
        """A new generation: no object dumped before is named again; dumps no pending task reads go now."""
        for path in list(self._current_objects.values()):
            held = self._objects.get(path)
            if held is None:
                continue  # forgotten meanwhile: an object named by one forgotten just before
            if held.entry.pending == 0:
                self._forget_object(path)
            else:
                held.entry.alive = False  # deleted when its last task is done (see release)
        self._current_objects.clear()

    def _forget_object(self, path: str) -> None:
        held = self._objects.pop(path)
        if self._current_objects.get(id(held.obj)) == path:
            del self._current_objects[id(held.obj)]
        self._delete_file(held.entry)
        self._release_needs(held.needs)

    def _new_buffer_generation(self) -> None:
        """At the first buffer of a new generation: forget the buffers of earlier ones that no task reads.

        Their memory is the caller's and may change or go between calls, so
        a later call dumps it again; forgetting releases the export that
        pinned it, and deletes the file.
        """
        if self._buffers_generation == self.generation:
            return
        self._buffers_generation = self.generation
        self._buffers_in_band.clear()
        for key, held in list(self._buffers.items()):
            if held.entry.pending == 0:
                self._forget_buffer(key)

    def _retire_buffer(self, key: Tuple[int, int]) -> None:
        """The buffer at ``key`` changed since its file was written: tasks reading the file keep it; later ones
        get a new one. Its export is released: the file, not the memory, is what those tasks read."""
        if self._buffers[key].entry.pending == 0:
            self._forget_buffer(key)
            return
        held = self._buffers.pop(key)
        self._buffer_keys.pop(held.entry.ref.path, None)
        self._recent.discard(held.entry.ref.path)
        held.entry.alive = False  # deleted with its last task (see _release)

    def _forget_buffer(self, key: Tuple[int, int]) -> None:
        """Delete the dump of the buffer at ``key`` and release its export."""
        held = self._buffers.pop(key)
        if held.entry.ref is not None:
            self._buffer_keys.pop(held.entry.ref.path, None)
        self._delete_file(held.entry)

    # -- lifetimes -----------------------------------------------------------

    def _use(self, entry: _Dump, files: List[str]) -> None:
        self._idle.pop(entry.ref.path, None)
        self._recent.discard(entry.ref.path)
        entry.uses += 1
        entry.pending += 1
        files.append(entry.ref.path)

    def release(self, files: List[str]) -> None:
        """A task that read ``files`` is done: each file no pending task reads goes, stays or turns idle.

        * its array was garbage-collected: deleted at once;
        * its array was used by two or more tasks (shared): kept until the
          session closes, so an array used by every task is written once;
        * otherwise idle: deleted, oldest first, when a new dump would make
          idle files outweigh the files pending tasks use; revived for free
          if used again. A call over many distinct arrays so keeps about
          twice what is in flight, not everything it ever dumped.

        Object and buffer dumps follow their own rules (below, in ``_release``).
        """
        kept: List[str] = []
        self._release(files, kept)
        if kept:
            self._keep_recent(kept)

    def _release(self, files: List[str], kept: List[str]) -> None:
        """Count one pending task fewer for each file; note in ``kept`` the single-use ones to keep as recent."""
        for path in files:
            entry = self._by_path.get(path)
            if entry is None:
                continue
            entry.pending -= 1
            if entry.pending > 0:
                continue
            if path in self._objects:
                # As a buffer: one used by a single task so far is kept among the recent
                # ones; one that a new generation passed over goes with its last task.
                if not entry.alive:
                    self._forget_object(path)
                elif entry.uses < 2:
                    kept.append(path)
                continue
            key = self._buffer_keys.get(path)
            if key is not None:
                # A buffer used by several tasks stays for the call. One used by a single
                # task so far is not kept for the call: pinning its memory would hold,
                # for a buffer made anew for each task, one copy per task. It is kept
                # among the few most recent, though, since tasks are packed as they are
                # sent: the first task over a buffer every task reads may be done before
                # the second one is packed, which would otherwise write it again.
                if entry.uses < 2:
                    kept.append(path)
            elif not entry.alive:
                self._delete_file(entry)  # collected, or superseded by a newer file of its array or buffer
            elif entry.uses < 2:
                self._idle[path] = entry

    def _keep_recent(self, paths: List[str]) -> None:
        """Keep the single-use object and buffer dumps one task just finished with, for reuse; forget those of
        the oldest task beyond a few."""
        self._recent.update(paths)
        self._recent_tasks.append(paths)
        while len(self._recent_tasks) > _RECENT_SINGLE_USE:
            for oldest in self._recent_tasks.popleft():
                if oldest not in self._recent:
                    continue  # revived or deleted since
                self._recent.discard(oldest)
                if oldest in self._objects:
                    self._forget_object(oldest)
                elif oldest in self._buffer_keys:
                    self._forget_buffer(self._buffer_keys[oldest])

    def _pending_bytes(self) -> int:
        return sum(e.ref.nbytes for e in self._by_path.values() if e.pending > 0)

    def _evict_idle(self, limit: int) -> None:
        """Delete idle files, oldest first, until they weigh at most ``limit``."""
        idle_bytes = sum(e.ref.nbytes for e in self._idle.values())
        while self._idle and idle_bytes > limit:
            _, entry = self._idle.popitem(last=False)
            idle_bytes -= entry.ref.nbytes
            self._delete_file(entry)  # the entry stays: a later use is then "shared"

    def _retire_file(self, entry: _Dump) -> None:
        """``entry``'s array changed since its file was written: the file goes now, or with its last pending task.

        The array's entry then has no file, so the caller writes a new one.
        """
        if entry.pending == 0:
            self._delete_file(entry)
            return
        old = dataclasses.replace(entry, alive=False)  # the file, with its pending count, apart from the array
        self._by_path[old.ref.path] = old
        self._idle.pop(old.ref.path, None)
        entry.ref, entry.pending, entry.parent_view = None, 0, None

    def _forget(self, entry: _Dump) -> None:
        """The array of ``entry`` was garbage-collected: its file goes once no task needs it.

        A weak reference callback: it may run in any thread, in the middle of
        packing a task in this one (hence the re-entrant lock).
        """
        with self._lock:
            entry.alive = False
            if entry.pending == 0:
                self._delete_file(entry)

    def _delete_file(self, entry: _Dump) -> None:
        if entry.ref is None:
            return
        self._by_path.pop(entry.ref.path, None)
        self._idle.pop(entry.ref.path, None)
        self._recent.discard(entry.ref.path)
        entry.parent_view = None
        self._let_go(entry.ref.path)
        entry.ref = None

    def _let_go(self, path: str) -> None:
        """Delete the file at ``path``; a kept one is only released (see ``_kept_buffers``)."""
        if path in self._kept_paths:
            self._kept_paths.discard(path)
            self._kept.release(path)
        else:
            delete_file(path)

    def close(self) -> None:
        """Delete every file and forget every array and buffer (releasing the buffers' exports)."""
        for entry in list(self._by_path.values()):
            entry.parent_view = None
            self._let_go(entry.ref.path)  # a memfd is closed here; named files also go with the folder
            entry.ref = None
        self._by_array.clear()
        self._by_path.clear()
        self._idle.clear()
        self._recent.clear()
        self._recent_tasks.clear()
        for held in self._objects.values():
            self._release_needs(held.needs)
        self._objects.clear()
        self._current_objects.clear()
        self._buffers.clear()  # their files went above; this releases their exports
        self._buffer_keys.clear()
        self._buffers_in_band.clear()


def _in_mode(ref: ArrayRef, mode: str) -> ArrayRef:
    return ref if ref.mode == mode else dataclasses.replace(ref, mode=mode)


# -- staleness ---------------------------------------------------------------


def _matches_file(entry: _Dump, array: np.ndarray) -> bool:
    """True when the file still holds exactly ``array``'s bytes (see ``_compare``).

    The parent's view of the file is kept with the entry until the file is deleted.
    """
    if entry.parent_view is None:
        entry.parent_view = view_of(map_file(entry.ref), entry.ref)
    return same_bytes(array, entry.parent_view)
