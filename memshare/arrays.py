"""Arrays that live in shared memory from the start.

Automatic dumping copies an array into shared memory once per call, and the
original stays in the parent. An array made by :func:`empty`, :func:`zeros`,
:func:`full` or :func:`share` has its memory in a shared file from the start:
passing it, or any view of it, to ``MemmappingPool`` or the ``"memshare"``
backend costs no dump and no copy, whatever its size and in any number of
calls, and workers receive it writable, so they can fill disjoint slices of
a shared output.

Lifetime: the file is deleted when the last array viewing it is garbage
collected (a finalizer on the mapping), and with the rest of the process's
folders at exit or, after a crash, by the watchdog. The arrays are plain
``np.ndarray`` objects and pickle by value anywhere else (to disk, to Dask).
"""

from __future__ import annotations

import numbers
import os
import threading
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from ._dumping import contiguous_strides, dump_array
from ._folders import TempFolder, default_base
from ._mapping import map_file
from ._refs import SHARED, ArrayRef, find_backing

ShapeLike = Union[int, Sequence[int]]


class _SharedStore:
    """The process's folder for shared arrays, and the live mappings in it.

    One per process: shared arrays belong to the process that made them,
    not to any pool or call, and a result that views one must find the
    parent's own mapping again (:func:`lookup_shared`).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # One folder per location, so that a changed MEMSHARE_TEMP_FOLDER
        # takes effect for arrays made afterwards.
        self.folders: Dict[str, TempFolder] = {}
        self.bases: Dict[str, Tuple[int, weakref.ref]] = {}  # path -> (inode, mapping)

    def new_array(self, shape: Tuple[int, ...], dtype: np.dtype, order: str, source: Optional[np.ndarray]):
        """A new shared array; filled from ``source`` when given, else zeroed."""
        base, _ = default_base()
        with self.lock:
            if base not in self.folders:
                self.folders[base] = TempFolder(base)
            pair = self.folders[base].pair
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if source is not None and nbytes:
            ref, _ = dump_array(pair, source, SHARED, "r+", order)  # no copy when already in order
        else:
            # A fresh reserved tmpfs file is already zeroed: nothing to write.
            # Mapping needs at least one byte, even for an empty array.
            path, fd = pair.create_file(max(nbytes, 1), SHARED)
            info = os.fstat(fd)
            os.close(fd)
            ref = ArrayRef(path, info.st_dev, info.st_ino, SHARED, "r+", 0, (max(nbytes, 1),), (1,), np.dtype(np.uint8))
        base = map_file(ref)
        # Deleting the name when the mapping dies frees the memory as soon as
        # the last view is gone (workers drop theirs when they see it gone).
        weakref.finalize(base, _unlink, ref.path, self, ref.inode)
        with self.lock:
            self.bases[ref.path] = (ref.inode, weakref.ref(base))
        strides = contiguous_strides(shape, dtype.itemsize, order)
        return np.ndarray(shape, dtype, buffer=base, offset=0, strides=strides)

    def lookup(self, ref: ArrayRef) -> Optional[np.ndarray]:
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


def _unlink(path: str, store: _SharedStore, inode: int) -> None:
    with store.lock:
        if store.bases.get(path, (None,))[0] == inode:
            del store.bases[path]
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_store = _SharedStore()


def _check_shape(shape: ShapeLike) -> Tuple[int, ...]:
    if isinstance(shape, numbers.Integral):
        shape = (int(shape),)
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"shape={shape!r} must be an int or a sequence of ints")
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape={shape!r} must be an int or a sequence of ints") from None
    for extent in dims:
        if isinstance(extent, bool) or not isinstance(extent, numbers.Integral) or extent < 0:
            raise ValueError(f"shape={shape!r} must contain non-negative integers only")
    return tuple(int(e) for e in dims)


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype={dtype!r} is not a NumPy dtype: {exc}") from None
    if dtype.hasobject:
        raise TypeError(
            f"dtype={dtype} holds Python objects, which cannot live in shared memory; "
            "use a numeric, boolean, string or structured dtype without objects"
        )
    return dtype


def _check_order(order: str) -> str:
    if order not in ("C", "F"):
        raise ValueError(f"order={order!r} must be 'C' (row-major) or 'F' (column-major)")
    return order


def empty(shape: ShapeLike, dtype: Any = float, order: str = "C") -> np.ndarray:
    """A new array in shared memory. Its memory starts zeroed (it is a fresh tmpfs file)."""
    return _store.new_array(_check_shape(shape), _check_dtype(dtype), _check_order(order), None)


def zeros(shape: ShapeLike, dtype: Any = float, order: str = "C") -> np.ndarray:
    """A new array of zeros in shared memory."""
    return empty(shape, dtype, order)


def full(shape: ShapeLike, fill_value: Any, dtype: Any = None, order: str = "C") -> np.ndarray:
    """A new array in shared memory filled with ``fill_value``."""
    if dtype is None:
        dtype = np.array(fill_value).dtype
    array = empty(shape, dtype, order)
    array[...] = fill_value
    return array


def share(array: Any, order: str = "K") -> np.ndarray:
    """A copy of ``array`` in shared memory (written once, with ``write()``)."""
    source = np.asarray(array)
    _check_dtype(source.dtype)
    if order == "K":
        order = "F" if source.flags.f_contiguous and not source.flags.c_contiguous else "C"
    order = _check_order(order)
    # dump_array writes the source in that order, slab by slab when it is not
    # already contiguous that way: no full-size temporary copy.
    return _store.new_array(tuple(source.shape), source.dtype, order, source)


def is_shared(array: Any) -> bool:
    """True when ``array``'s memory can travel to workers by reference.

    That is: arrays made by this module, ``np.memmap`` arrays (not
    copy-on-write ones), arrays over a file ``mmap``, and views of any of these.
    """
    return isinstance(array, np.ndarray) and array.size > 0 and find_backing(array) is not None


def lookup_shared(ref: ArrayRef) -> Optional[np.ndarray]:
    """The parent's own memory for a reference to one of its shared arrays."""
    if ref.kind != SHARED:
        return None
    return _store.lookup(ref)
