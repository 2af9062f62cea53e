"""Freeing a result's memory in the worker while it is written out.

A worker that returns a large array writes it into a result file and then
drops it. Written naively, the worker holds the result twice at the end of
the write: its own array and the file. With every worker finishing a task
at about the same time, that is ``workers x result`` of extra memory at peak
(a quarter more than the results themselves, for 8 results and 2 workers).

When nothing but memshare can still reach the array, its pages can be given
back to the kernel as soon as they are in the file, so that the worker never
holds much more than one copy. ``MADV_DONTNEED`` on private anonymous memory
does exactly that: the pages are freed, and read back as zeros if touched
again. That destroys the array's contents, so it is only done when:

* the array owns its memory (no base: nothing else views the same pages),
  and is contiguous, so the bytes written are exactly its memory in order;
* memshare's own reference is the only one (``sys.getrefcount``, calibrated
  below for this interpreter) and no weak reference exists, so no Python
  object can observe the array afterwards;
* the platform is Linux, where the semantics above hold, and the
  interpreter is CPython, whose reference counts are exact.

Only whole pages strictly inside the array's buffer are released: a
partial first or last page may hold the allocator's bookkeeping or another
allocation's data.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import weakref
from typing import List

from .._numpy import np

_PAGE = mmap.PAGESIZE


def _load_madvise():
    """libc's ``madvise``, or None where releasing pages is not supported."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    if sys.implementation.name != "cpython":
        return None  # the reference count test below needs CPython's reference counting
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


# A handle on a C function, loaded once: it never changes after import.
_MADVISE = _load_madvise()


def _refcount_of_item(box: List[object]) -> int:
    return sys.getrefcount(box[0])


# How many references sys.getrefcount reports for an object held only by a
# one-item list, read through _refcount_of_item. Measured rather than assumed,
# because CPython versions differ in how they count temporary references.
_SOLE_REFCOUNT = _refcount_of_item([object()]) if _MADVISE is not None else -1


def can_release(box: List[np.ndarray]) -> bool:
    """True when the only array in ``box`` may be destroyed as it is written.

    ``box`` must be a one-item list holding the sole reference memshare has:
    if the array is reachable from anywhere else (the caller's locals, a
    container, a view's base, a closure, a weak reference), it is left alone.
    """
    array = box[0]
    if _MADVISE is None or type(array) is not np.ndarray:
        return False
    if array.base is not None or not array.flags.owndata or not array.flags.writeable:
        return False
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        return False
    del array  # the check below must see memshare's one reference only
    return weakref.getweakrefcount(box[0]) == 0 and _refcount_of_item(box) == _SOLE_REFCOUNT


def release_pages(address: int, length: int) -> None:
    """Give back the whole pages of ``[address, address + length)`` to the kernel.

    Best effort: memory that cannot be released (locked pages, huge-page
    file systems) stays as it is, which costs memory but not correctness.
    """
    if _MADVISE is None:
        return
    start = -(-address // _PAGE) * _PAGE
    end = (address + length) // _PAGE * _PAGE
    if end > start:
        _MADVISE(start, end - start, mmap.MADV_DONTNEED)


__all__ = ["can_release", "release_pages"]
