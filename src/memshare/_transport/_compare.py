"""Bitwise comparison of data in memory with the shared file that should hold the same bytes.

Used before a file written in an earlier call is sent again: an array's
dump in a managed context (``_dumps``), a kept Arrow buffer (``_kept_buffers``),
the partial first and last pages of an array held once (``_held_once``).
Comparing runs at about 0.15 s/GiB on two threads (0.14-0.19 s measured for
1 GiB of float64 on a 2-core machine; 0.17 s on one thread), less than half
the cost of writing the data again (about 0.4 s).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from .._numpy import np
from ._dumping import row_slabs

_COMPARE_BYTES = 2 * 1024**2  # slab size: cache-friendly, no large temporaries
_PARALLEL_COMPARE_BYTES = 64 * 1024**2  # compare on two threads from this size on


def same_bytes(array: np.ndarray, stored: np.ndarray) -> bool:
    """True when ``array`` and ``stored`` hold the same bytes: same shape and dtype, bitwise equal elements.

    Bitwise, so -0.0 against 0.0 or a changed NaN payload count as changes.
    Memory-bandwidth bound: large arrays are compared in two halves on two
    threads (numpy releases the GIL while comparing).
    """
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
