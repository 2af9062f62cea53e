"""Large buffers of live Arrow objects, kept in shared memory from one call to the next.

Arrow data does not change: while the Arrow object holding a buffer (an
array, chunked array, record batch or table, such as the chunked array
behind a pandas ``string[pyarrow]`` column) is alive, the buffer's memory
holds the same bytes at the same address. The first call that passes such
an object writes each large buffer once into this process's store; later
calls, of any pool or ``Parallel``, find the file by the buffer's address
and size and send it again instead of writing the buffer anew. A repeated
call over the same DataFrame so writes nothing and holds no new memory.

Why it is safe:

* A buffer is found by (address, size) only while an Arrow object that
  holds it is alive (:meth:`KeptBuffers.note_owner` watches each one
  through a weak reference). Its memory cannot be freed meanwhile, so no
  other data can take that address; when the last owner is collected the
  key is forgotten at once.
* Arrow memory can still change under a live owner that wraps writable
  memory without a copy (``pa.array(numpy_array)``, ``pa.py_buffer``). So
  each call compares the buffer with its file before it sends the file
  again (bitwise, about 0.15 s/GiB, against 0.4 s/GiB to write it), and
  writes a new file when they differ.
* A file is deleted once it is neither current (owner collected, or bytes
  changed) nor used by any session (a session uses a file from the task
  that first names it in a call until that call's buffers are let go of).
  At exit the process's folders go, and a memfd goes with the process.

Only buffers mapped read-only or copy-on-write by the workers are kept: a
writable mapping could change the file.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .. import _forksafe
from .._config import over_max_nbytes
from .._lifetime._file_lifetime import FileLifetime
from .._lifetime._folders import delete_file
from .._lifetime._location import Location
from .._lifetime._temp_folder import TempFolder
from .._numpy import np
from .._transport._compare import same_bytes
from .._transport._dumping import dump_array
from .._transport._identity import IdentityTable, MemoryKey
from .._transport._mapping import map_file, view_of
from .._transport._refs import DUMP, ArrayRef


@dataclass
class _Kept:
    """One kept file: the buffer's bytes as of when it was written."""

    ref: ArrayRef
    location: Location
    # Its readers are the sessions holding it for a call; it stops being current once its key is forgotten
    # or its bytes were found changed.
    lifetime: FileLifetime = field(init=False, repr=False)  # made with the record: its delete names it
    parent_view: Optional[np.ndarray] = field(default=None, repr=False)  # for comparing, made on first need


class KeptBuffers:
    """The process's kept buffer files, by buffer memory, and the live Arrow objects that own that memory."""

    def __init__(self) -> None:
        # Re-entrant: an owner collected while this thread holds the lock (a
        # garbage collection set off inside) runs its callback here too.
        self._lock = _forksafe.rlock()
        self._owners: IdentityTable[List[MemoryKey]] = IdentityTable()  # live Arrow object -> the keys it holds
        self._owned: Dict[MemoryKey, int] = {}  # key -> how many live owners hold it
        self._kept: Dict[MemoryKey, _Kept] = {}  # key -> its current file
        self._by_path: Dict[str, _Kept] = {}  # every file not deleted yet, current or not
        self._folders: Dict[Location, TempFolder] = {}
        self._writing: Dict[Location, int] = {}  # files being written per location

    def after_fork_in_child(self) -> None:
        """A forked child owns none of its parent's files: forget them without deleting anything."""
        self._lock = _forksafe.rlock()
        self._owners = IdentityTable()
        self._owned = {}
        self._kept = {}
        self._by_path = {}
        self._folders = {}
        self._writing = {}

    # -- owners ----------------------------------------------------------------

    def note_owner(self, obj: Any, max_nbytes: Optional[int]) -> None:
        """``obj`` (an Arrow object being pickled) holds its buffers above ``max_nbytes`` while it lives."""
        with self._lock:
            if obj in self._owners:
                return
            keys = sorted({key for key in _buffer_keys(obj) if over_max_nbytes(key[1], max_nbytes)})
            if not keys:
                return
            for key in keys:
                self._owned[key] = self._owned.get(key, 0) + 1
            self._owners.add(obj, keys, on_collected=self._owner_collected)

    def _owner_collected(self, keys: List[MemoryKey]) -> None:
        """A weak reference callback (any thread): keys no live owner holds are forgotten."""
        with self._lock:
            for key in keys:
                left = self._owned.get(key, 1) - 1
                if left > 0:
                    self._owned[key] = left
                    continue
                self._owned.pop(key, None)
                kept = self._kept.pop(key, None)
                if kept is not None:
                    self._retire(kept)

    # -- files -----------------------------------------------------------------

    def reuse(self, key: MemoryKey, raw: np.ndarray, location: Location) -> Optional[ArrayRef]:
        """The kept file of the buffer at ``key`` (bytes ``raw``) if it still holds those bytes, now used once
        more; None if there is none, or it was stale (then no longer current)."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is None or kept.location != location or key not in self._owned:
                return None
            kept.lifetime.acquire()  # not deleted while compared
        try:
            if kept.parent_view is None:
                kept.parent_view = view_of(map_file(kept.ref), kept.ref)
            same = same_bytes(raw, kept.parent_view)
        except BaseException:
            with self._lock:
                self._release(kept)
            raise
        if same:
            return kept.ref
        with self._lock:
            if self._kept.get(key) is kept:
                del self._kept[key]
            kept.lifetime.retire()  # a reader still holds it: it goes with the release below
            self._release(kept)
        return None

    def keep(self, key: MemoryKey, raw: np.ndarray, location: Location) -> Optional[Tuple[ArrayRef, float, bool]]:
        """Write ``raw`` (the buffer at ``key``) to a new kept file, used once; None when no live owner holds it.

        Returns the file's reference, the seconds taken and whether it went
        to the disk fallback.
        """
        with self._lock:
            if key not in self._owned:
                return None
            folder = self._folders.get(location)
            if folder is None:
                folder = self._folders[location] = TempFolder(location=location)
            self._writing[location] = self._writing.get(location, 0) + 1  # the folder stays meanwhile
        # Written without the lock: other sessions need not wait, and an owner collected meanwhile
        # (its callback takes the lock) is seen below.
        written = None
        try:
            written = dump_array(folder.pair, raw, DUMP, "r")
        finally:
            with self._lock:
                if written is not None:
                    self._add(key, self._new_kept(written[0], location))
                self._writing[location] -= 1
                if not self._writing[location]:
                    del self._writing[location]
                    self._remove_folder_if_unused(location)  # only if the write failed and nothing else is there
        ref, seconds = written
        return ref, seconds, folder.pair.is_fallback(ref.path)

    def _new_kept(self, ref: ArrayRef, location: Location) -> _Kept:
        """The record of a file just written, used once (by the session that wrote it)."""
        kept = _Kept(ref, location)
        kept.lifetime = FileLifetime(ref.path, functools.partial(self._delete, kept), readers=1)
        return kept

    def _add(self, key: MemoryKey, kept: _Kept) -> None:
        """A new file for ``key``: current unless its last owner went while it was written."""
        self._by_path[kept.ref.path] = kept
        if key not in self._owned:
            kept.lifetime.retire()  # deleted once released
            return
        earlier = self._kept.get(key)
        self._kept[key] = kept
        if earlier is not None:  # another session wrote it meanwhile: the newer file serves
            self._retire(earlier)

    def release(self, path: str) -> None:
        """A session no longer uses the kept file at ``path``."""
        with self._lock:
            kept = self._by_path.get(path)
            if kept is not None:
                self._release(kept)

    def _release(self, kept: _Kept) -> None:
        kept.lifetime.release()

    def _retire(self, kept: _Kept) -> None:
        kept.lifetime.retire()

    def _delete(self, kept: _Kept) -> None:
        if self._by_path.pop(kept.ref.path, None) is None:
            return
        kept.parent_view = None
        delete_file(kept.ref.path)
        self._remove_folder_if_unused(kept.location)

    def _remove_folder_if_unused(self, location: Location) -> None:
        """Nothing kept or being written at ``location`` any more: its folder goes too (made again when needed)."""
        if self._writing.get(location) or any(kept.location == location for kept in self._by_path.values()):
            return
        folder = self._folders.pop(location, None)
        if folder is not None:
            folder.remove()

    def paths(self) -> List[str]:
        """The files kept now (current or still used)."""
        with self._lock:
            return list(self._by_path)


@dataclass(frozen=True)
class KeptIn:
    """One session's way to the store: its buffers are kept in its own location (temp folder)."""

    store: KeptBuffers
    location: Location

    def reuse(self, key: MemoryKey, raw: np.ndarray) -> Optional[ArrayRef]:
        return self.store.reuse(key, raw, self.location)

    def keep(self, key: MemoryKey, raw: np.ndarray) -> Optional[Tuple[ArrayRef, float, bool]]:
        return self.store.keep(key, raw, self.location)

    def release(self, path: str) -> None:
        self.store.release(path)


def _buffer_keys(obj: Any) -> Iterator[MemoryKey]:
    """(address, size) of each buffer of an Arrow object: every chunk's, its children's and dictionaries'."""
    pa = sys.modules.get("pyarrow")
    if pa is None:
        return
    if isinstance(obj, (pa.Table, pa.RecordBatch)):
        arrays: List[Any] = [array for column in obj.columns for array in _chunks(pa, column)]
    else:
        arrays = _chunks(pa, obj)
    while arrays:
        array = arrays.pop()
        for buffer in array.buffers():
            if buffer is not None and buffer.size:
                yield buffer.address, buffer.size
        dictionary = getattr(array, "dictionary", None)
        if dictionary is not None:
            arrays.append(dictionary)


def _chunks(pa: Any, obj: Any) -> List[Any]:
    return list(obj.chunks) if isinstance(obj, pa.ChunkedArray) else [obj]


# One store per process (a reason for module state): files outlive the
# sessions that wrote them, and every session of the process may reuse them.
# A forked child starts with an empty one.
_store = KeptBuffers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_store.after_fork_in_child)


def store() -> KeptBuffers:
    """The process's kept buffer files."""
    return _store


__all__ = ["KeptBuffers", "KeptIn", "store"]
