"""Writing an array's elements into a new shared file.

The elements are written with plain ``write()`` calls into a file whose space
was reserved first: on tmpfs this is about twice as fast as assigning through
a fresh ``np.memmap`` (no page faults on a writable mapping), and a full
tmpfs fails cleanly at reservation instead of with SIGBUS.

C-contiguous arrays are written as they are, Fortran-contiguous arrays in
Fortran order (both without a copy); any other layout is written in C order,
a slab at a time, so that no full-size temporary copy is ever made. Data
starts at offset 0 of the file, so it is page-aligned (hence 64-byte aligned)
in every process that maps it.
"""

from __future__ import annotations

import os
import time
from typing import Tuple

import numpy as np

from ._folders import FolderPair
from ._refs import ArrayRef

_SLAB_BYTES = 64 * 1024**2  # size of the pieces a non-contiguous array is copied in


def _write_all(fd: int, data: memoryview) -> None:
    # write() may write less than asked (at most ~2 GiB per call on Linux).
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def _bytes_of(contiguous: np.ndarray) -> memoryview:
    """The raw bytes of a C-contiguous array of any dtype (datetime, structured...)."""
    return memoryview(contiguous.reshape(-1).view(np.uint8))


def _write_elements(fd: int, array: np.ndarray, order: str) -> Tuple[int, ...]:
    """Write ``array``'s elements to ``fd`` in ``order``; return their strides in the file.

    ``order`` is ``"K"`` (Fortran order for a Fortran-contiguous array, else
    C order), ``"C"`` or ``"F"``. Contiguous data in the chosen order is
    written without a copy, anything else a slab at a time.
    """
    if order == "K":
        order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
    if order == "F":
        # Fortran order of an array is C order of its transpose, same memory.
        return _write_elements(fd, array.T, "C")[::-1]
    if array.flags.c_contiguous:
        _write_all(fd, _bytes_of(array))
    else:
        step = max(1, _SLAB_BYTES // max(array[0:1].nbytes, 1))
        for start in range(0, array.shape[0], step):
            _write_all(fd, _bytes_of(np.ascontiguousarray(array[start : start + step])))
    return contiguous_strides(array.shape, array.dtype.itemsize, "C")


def contiguous_strides(shape: Tuple[int, ...], itemsize: int, order: str) -> Tuple[int, ...]:
    """The strides of a contiguous array of ``shape`` in ``order`` (``"C"`` or ``"F"``)."""
    if order == "F":
        return contiguous_strides(shape[::-1], itemsize, "C")[::-1]
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def dump_array(folder: FolderPair, array: np.ndarray, kind: str, mode: str, order: str = "K") -> Tuple[ArrayRef, float]:
    """Write ``array`` into a new file of ``folder``; return its reference and the seconds taken.

    ``order`` chooses the layout in the file (see ``_write_elements``).
    On any failure the partial file is removed before the error propagates.
    """
    started = time.perf_counter()
    path, fd = folder.create_file(array.nbytes, kind)
    try:
        strides = _write_elements(fd, array, order)
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    ref = ArrayRef(
        path=path,
        device=info.st_dev,
        inode=info.st_ino,
        kind=kind,
        mode=mode,
        offset=0,
        shape=tuple(array.shape),
        strides=strides,
        dtype=array.dtype,
    )
    return ref, time.perf_counter() - started
