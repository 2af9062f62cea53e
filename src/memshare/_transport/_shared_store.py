"""The process's shared arrays: their folder, their live mappings, and finding them again.

One store per process: shared arrays belong to the process that made them,
not to any pool or call. A result that views one of them must come back as
the parent's own memory (:func:`lookup_shared`), and a worker that returns
one it allocated hands its file over instead of copying it. Below both the
public constructors (``arrays``), the result policy (``_result_policy``) and
``_adopt``.

Lifetime: each file has a ``FileLifetime``, retired when the last array
viewing it is garbage collected (a finalizer on the mapping), so the file
goes then; else with the rest of the process's folders at exit or, after a
crash, by the watchdog.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Dict, Optional, Tuple

from .. import _forksafe
from .._lifetime._file_lifetime import FileLifetime
from .._lifetime._folders import delete_file
from .._lifetime._location import Location, choose_location
from .._lifetime._temp_folder import TempFolder
from .._numpy import np
from ._dumping import contiguous_strides, dump_array, file_reference
from ._mapping import map_file
from ._refs import SHARED, ArrayRef


class _SharedStore:
    """The process's folders for shared arrays, and the live mappings in them."""

    def __init__(self) -> None:
        self.lock = _forksafe.lock()
        # One folder per location, so that a changed MEMSHARE_TEMP_FOLDER
        # takes effect for arrays made afterwards.
        self.folders: Dict[Location, TempFolder] = {}
        self.bases: Dict[str, Tuple[int, weakref.ref]] = {}  # path -> (inode, mapping)

    def new_array(
        self, shape: Tuple[int, ...], dtype: np.dtype, order: str, source: Optional[np.ndarray]
    ) -> np.ndarray:
        """A new shared array; filled from ``source`` when given, else zeroed."""
        location = choose_location()
        with self.lock:
            if location not in self.folders:
                self.folders[location] = TempFolder(location=location)
            pair = self.folders[location].pair
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if source is not None and nbytes:
            ref, _ = dump_array(pair, source, SHARED, "r+", order)  # no copy when already in order
        else:
            # A fresh reserved tmpfs file is already zeroed: nothing to write.
            # Mapping needs at least one byte, even for an empty array.
            path, fd = pair.create_file(max(nbytes, 1), SHARED)
            try:
                ref = file_reference(path, fd, SHARED, "r+", (max(nbytes, 1),), np.dtype(np.uint8), "C")
            finally:
                os.close(fd)
        base = map_file(ref)
        # The file is current while the mapping lives: deleting it (a memfd: closing it) when the
        # mapping dies frees the memory as soon as the last view is gone (workers drop theirs when
        # they see it gone). A task that references the array keeps the array, hence the mapping.
        lifetime = FileLifetime(ref.path, functools.partial(self._forget, ref.path, ref.inode))
        weakref.finalize(base, lifetime.retire)
        with self.lock:
            self.bases[ref.path] = (ref.inode, weakref.ref(base))
        strides = contiguous_strides(shape, dtype.itemsize, order)
        return np.ndarray(shape, dtype, buffer=base, offset=0, strides=strides)

    def lookup(self, ref: ArrayRef) -> Optional[np.ndarray]:
        """The array ``ref`` describes, over this process's own mapping; None if there is none."""
        with self.lock:
            entry = self.bases.get(ref.path)
        if entry is None or entry[0] != ref.inode:
            return None
        base = entry[1]()
        if base is None:
            return None
        array = np.ndarray(ref.shape, ref.dtype, buffer=base, offset=ref.offset, strides=ref.strides)
        if ref.mode == "r":
            array.flags.writeable = False
        return array

    def _forget(self, path: str, inode: int) -> None:
        """The file's lifetime ended (its mapping was collected): delete the file and its entry."""
        with self.lock:
            if self.bases.get(path, (None,))[0] == inode:
                del self.bases[path]
        delete_file(path)


_store = _SharedStore()


def new_shared_array(
    shape: Tuple[int, ...], dtype: np.dtype, order: str, source: Optional[np.ndarray] = None
) -> np.ndarray:
    """A new array of this process in shared memory; a copy of ``source`` when given, else zeroed."""
    return _store.new_array(shape, dtype, order, source)


def views_shared_array(array: np.ndarray) -> bool:
    """True when ``array`` is, or views, one of this process's shared arrays (its chain of bases meets one)."""
    with _store.lock:
        live = {id(base) for base in (entry[1]() for entry in _store.bases.values()) if base is not None}
    value: object = array
    while live and value is not None:
        if id(value) in live:
            return True
        value = getattr(value, "base", None)
    return False


def lookup_shared(ref: ArrayRef) -> Optional[np.ndarray]:
    """The parent's own memory for a reference to one of its shared arrays."""
    if ref.kind != SHARED:
        return None
    return _store.lookup(ref)
