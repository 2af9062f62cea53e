"""The dump files of one session: one per array, buffer or object, deleted as soon as nothing needs it, new when stale.

A :class:`DumpTable` writes an array (keyed by its identity), an argument's
out-of-band buffer (keyed by its memory) or a large argument object's
payload (keyed by the object, for one call) to a dump file at most once per
generation, and writes a new file when the array or buffer changed since.
Who reads each file, and how long one nobody reads stays, is
``_dump_files``'s: a file goes when its owner is collected, changed or
forgotten and no pending task reads it, or earlier by its idle or recent
rule. Not thread-safe on its own: the session calls every method with its
lock held.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, KeysView, List, Optional, Set

from .._lifetime._folders import FolderPair, delete_file
from .._numpy import np
from .._stats import DUMPED, REUSED, CallStats, log_buffer_decision, log_decision, log_object_decision
from .._transport._compare import same_bytes
from .._transport._dumping import dump_array
from .._transport._identity import IdentityTable, MemoryKey, memory_key
from .._transport._mapping import map_file, view_of
from .._transport._refs import DUMP, ArrayRef
from ._dump_files import IDLE, RECENT, DumpFile, DumpFiles, Uses
from ._kept_buffers import KeptIn

#: A buffer's memory: (address, size in bytes).


@dataclass
class _ArrayDump:
    """One array dumped in this session: its current file, if any (an idle one may have been deleted for room)."""

    generation: int  # the generation in which the file was last known current
    uses: Uses = field(default_factory=Uses)  # over all its files: one used again after its idle file went is shared
    file: Optional[DumpFile] = None


@dataclass
class _BufferDump:
    """One out-of-band buffer dumped in this session: its file, and the export that keeps its memory."""

    export: pickle.PickleBuffer
    generation: int
    file: Optional[DumpFile] = None


@dataclass
class _ObjectDump:
    """One argument object pickled once in this generation: the object, what its payload needs, its file."""

    obj: Any  # kept: its id() names it for the call, and must not be reused by another object meanwhile
    needs: Any  # what the payload references (its own dumps...), released with it through ``release_needs``
    file: Optional[DumpFile] = None


class DumpTable:
    """The dumps of one session, by array and by buffer memory; its argument objects' in ``objects``."""

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
        (the ``needs`` given to :meth:`dump_object`) once its dump is deleted.
        ``kept``: where buffers of live Arrow objects are kept across calls
        (``_kept_buffers``); None writes every buffer into this session's folder.
        """
        self._pair = pair
        self._stats = stats
        self._lock = lock
        self._kept = kept
        self._kept_paths: Set[str] = set()  # files of ``kept`` this table uses: released, never deleted, here
        self._files = DumpFiles(self._let_go)
        # An array is keyed by its identity, never by its content. The weak
        # reference's callback removes the key before the array's memory (and
        # so its id()) can be reused: a new array never aliases a dead one.
        self._by_array: IdentityTable[_ArrayDump] = IdentityTable()
        # Out-of-band buffers by (address, size) of their memory: the dumped ones (of this generation,
        # and of earlier ones still read), and this generation's counted as pickled in the stream.
        self._buffers: Dict[MemoryKey, _BufferDump] = {}
        self._buffers_in_band: Set[MemoryKey] = set()
        self._buffers_generation = 0
        self.objects = ObjectDumps(pair, stats, self._files, release_needs)
        self._generations = itertools.count(1)
        self.generation = 0

    @property
    def paths(self) -> KeysView[str]:
        """The paths of the dump files (a live, read-only view)."""
        return self._files.paths

    def new_generation(self) -> None:
        """A new call starts: reused arrays are checked for changes, earlier calls' buffers and objects go.

        Called without the lock: next() on a count is atomic under the GIL;
        the lock is taken only when there are buffers or objects to let go of.
        """
        self.generation = next(self._generations)
        if self._buffers or self.objects:
            with self._lock:
                self._new_buffer_generation()
                self.objects.forget()

    def ref_at(self, path: str) -> Optional[ArrayRef]:
        """The reference of the dump file at ``path`` while this table holds it, else None."""
        file = self._files.get(path)
        return None if file is None else file.ref

    def use(self, path: str, files: List[str]) -> None:
        """One more task reads the dump at ``path``; noted in ``files``."""
        file = self._files.get(path)
        if file is None:
            raise KeyError(path)
        self._files.use(file, files)

    def release(self, files: List[str]) -> None:
        """A task that read ``files`` is done (see ``_dump_files`` for what then goes)."""
        self._files.release(files)

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
        if entry is not None and entry.file is not None and entry.generation != self.generation:
            if not _matches_file(entry.file, array):
                self._files.retire(entry.file)
                entry.file = None
            entry.generation = self.generation
        if entry is None:
            entry = _ArrayDump(generation=self.generation)
            self._by_array.add(array, entry, self._forget_array)
        if entry.file is None:
            self._files.make_room()
            ref, seconds = dump_array(self._pair, array, DUMP, mode)
            entry.file = self._files.add(ref, entry.uses, IDLE, functools.partial(_array_file_gone, entry))
            entry.generation = self.generation
            self._stats.add(arrays_dumped=1, bytes_dumped=array.nbytes, dump_seconds=seconds)
            if self._pair.is_fallback(ref.path):
                self._stats.add(fallback_files=1)
            log_decision(DUMPED, array, ref.path, seconds)
        self._files.use(entry.file, files)
        return _in_mode(entry.file.ref, mode)

    def _forget_array(self, entry: _ArrayDump) -> None:
        """The array of ``entry`` was garbage-collected: its file goes once no task reads it.

        A weak reference callback: it may run in any thread, in the middle of
        packing a task in this one (hence the re-entrant lock).
        """
        with self._lock:
            if entry.file is not None:
                self._files.retire(entry.file)

    # -- out-of-band buffers -------------------------------------------------

    def pickled_buffer(self, key: MemoryKey) -> bool:
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
        key = memory_key(raw)
        held = self._buffers.get(key)
        if held is not None and held.generation != self.generation:
            # Kept from an earlier call because a task still reads it: the memory may have changed since.
            if _matches_file(held.file, raw):
                held.generation = self.generation
            else:
                # Tasks reading the file keep it; later ones get a new one. Its export is released:
                # the file, not the memory, is what those tasks read.
                del self._buffers[key]
                self._files.retire(held.file)
                held = None
        if held is None:
            ref = self._kept_file(key, raw, mode, exporter)
            if ref is None:
                self._files.make_room()
                ref, seconds = dump_array(self._pair, raw, DUMP, mode)
                self._count_dumped(raw, exporter, ref, seconds, self._pair.is_fallback(ref.path))
            held = self._buffers[key] = _BufferDump(buffer, self.generation)
            held.file = self._files.add(ref, Uses(), RECENT, functools.partial(self._buffer_file_gone, key, held))
        self._files.use(held.file, files)
        return _in_mode(held.file.ref, mode)

    def _buffer_file_gone(self, key: MemoryKey, held: _BufferDump, file: DumpFile) -> None:
        if self._buffers.get(key) is held:
            del self._buffers[key]  # releases its export

    def _kept_file(self, key: MemoryKey, raw: np.ndarray, mode: str, exporter: object) -> Optional[ArrayRef]:
        """The buffer's file kept across calls: an earlier call's if it holds the same bytes, else a new one;
        None when the buffer is not kept (no live Arrow object owns it, or workers may write to it)."""
        if self._kept is None or mode not in ("r", "c"):
            return None
        ref = self._kept.reuse(key, raw)
        if ref is not None and self._files.get(ref.path) is not None:
            # The file of a buffer retired as changed, found equal again (written back meanwhile): a path
            # names one file, so this call takes a file of its own.
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
        for held in list(self._buffers.values()):
            if held.file.lifetime.readers == 0:
                self._files.retire(held.file)

    # -- deletion --------------------------------------------------------------

    def _let_go(self, path: str) -> None:
        """Delete the file at ``path``; a kept one is only released (see ``_kept_buffers``)."""
        if path in self._kept_paths:
            self._kept_paths.discard(path)
            self._kept.release(path)
        else:
            delete_file(path)  # a memfd is closed here; named files also go with the folder

    def close(self) -> None:
        """Delete every file and forget every array, buffer and object (releasing the buffers' exports)."""
        self._files.close()
        self._by_array.clear()
        self._buffers.clear()
        self._buffers_in_band.clear()
        self.objects.forget()  # their files went above


class ObjectDumps:
    """The large argument objects of one session's current call, each pickled once into a dump."""

    def __init__(self, pair: FolderPair, stats: CallStats, files: DumpFiles, release_needs: Callable[[Any], None]):
        self._pair = pair
        self._stats = stats
        self._files = files
        self._release_needs = release_needs
        self._current: Dict[int, _ObjectDump] = {}  # this generation's, by id() of the object

    def __bool__(self) -> bool:
        return bool(self._current)

    def object_dump(self, obj: Any, files: List[str]) -> Optional[ArrayRef]:
        """The dump of ``obj``'s payload made in this generation, now used by one more task; None if there is none."""
        held = self._current.get(id(obj))
        if held is None or held.obj is not obj:
            return None
        self._files.use(held.file, files)
        return held.file.ref

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
        held = self._current.get(id(obj))
        if held is not None and held.obj is obj:
            self._release_needs(needs)
        else:
            raw = np.frombuffer(payload, np.uint8)
            self._files.make_room()
            ref, seconds = dump_array(self._pair, raw, DUMP, "r")
            held = self._current[id(obj)] = _ObjectDump(obj, needs)
            held.file = self._files.add(ref, Uses(), RECENT, functools.partial(self._file_gone, held))
            self._stats.add(objects_dumped=1, bytes_objects_dumped=raw.nbytes, dump_seconds=seconds)
            if self._pair.is_fallback(ref.path):
                self._stats.add(fallback_files=1)
            log_object_decision(DUMPED, raw.nbytes, obj, ref.path, seconds)
        self._files.use(held.file, files)
        return held.file.ref

    def _file_gone(self, held: _ObjectDump, file: DumpFile) -> None:
        if self._current.get(id(held.obj)) is held:
            del self._current[id(held.obj)]
        self._release_needs(held.needs)

    def forget(self) -> None:
        """A new generation: no object dumped before is named again; a dump goes now, or with its last task."""
        current, self._current = list(self._current.values()), {}
        for held in current:
            self._files.retire(held.file)


def _array_file_gone(entry: _ArrayDump, file: DumpFile) -> None:
    if entry.file is file:
        entry.file = None  # the array's next use writes a new file


def _in_mode(ref: ArrayRef, mode: str) -> ArrayRef:
    return ref if ref.mode == mode else dataclasses.replace(ref, mode=mode)


def _matches_file(file: DumpFile, array: np.ndarray) -> bool:
    """True when the file still holds exactly ``array``'s bytes (see ``_compare``).

    The parent's view of the file is kept with it until the file is deleted.
    """
    if file.parent_view is None:
        file.parent_view = view_of(map_file(file.ref), file.ref)
    return same_bytes(array, file.parent_view)
