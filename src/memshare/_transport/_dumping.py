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

Results use the same pieces (:func:`iter_pieces`) but are written by
``_result_files``, which reserves room as it goes and may free each piece of
the array once it is in the file.
"""

from __future__ import annotations

import os
import time
from typing import Iterator, Optional, Tuple

from .._lifetime._folders import FolderPair, delete_file
from .._numpy import np
from ._refs import ArrayRef, data_address

_SLAB_BYTES = 64 * 1024**2  # size of the pieces a non-contiguous array is copied in
#: Pieces of contiguous data end on addresses aligned to this size, so that memory
#: released after each piece (results) holds whole transparent huge pages (2 MiB).
CHUNK_BYTES = 32 * 1024**2


def write_range(fd: int, view: memoryview, offset: Optional[int] = None) -> None:
    """Write all of the bytes ``view`` into ``fd``: at ``offset``, or at its current offset when None."""
    # write() may write less than asked (at most ~2 GiB per call on Linux).
    done = 0
    while done < len(view):
        if offset is None:
            done += os.write(fd, view[done:])
        else:
            done += os.pwrite(fd, view[done:], offset + done)


def _bytes_of(contiguous: np.ndarray) -> memoryview:
    """The raw bytes of a C-contiguous array of any dtype (datetime, structured...)."""
    return memoryview(contiguous.reshape(-1).view(np.uint8))


def file_order(array: np.ndarray, order: str = "K") -> str:
    """The layout ``array`` takes in its file: ``"C"`` or ``"F"``.

    ``order`` is ``"K"`` (Fortran order for a Fortran-contiguous array, else
    C order), ``"C"`` or ``"F"``.
    """
    if order == "K":
        return "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
    return order


def iter_pieces(array: np.ndarray, order: str) -> Iterator[Tuple[memoryview, Optional[int]]]:
    """``array``'s elements in ``order`` (``"C"`` or ``"F"``), as consecutive byte pieces.

    Each piece comes with the address of the array memory it is, or None
    when it is a temporary copy. Data contiguous in ``order`` is cut, without
    a copy, into pieces ending on ``CHUNK_BYTES``-aligned addresses; anything
    else is copied a slab at a time, so no full-size copy is ever made.
    """
    if order == "F":
        # Fortran order of an array is C order of its transpose, same memory.
        yield from iter_pieces(array.T, "C")
    elif array.flags.c_contiguous:
        data = _bytes_of(array)
        address = data_address(array)
        done = 0
        while done < len(data):
            end = min(len(data), (address + done) // CHUNK_BYTES * CHUNK_BYTES + CHUNK_BYTES - address)
            yield data[done:end], address + done
            done = end
    else:
        for rows in row_slabs(array, 0, array.shape[0], _SLAB_BYTES):
            yield _bytes_of(np.ascontiguousarray(array[rows])), None


def row_slabs(array: np.ndarray, start: int, stop: int, slab_bytes: int) -> Iterator[slice]:
    """Consecutive slices of rows ``start:stop`` of ``array``, each about ``slab_bytes`` (at least one row).

    Copying or comparing a large array slab by slab never needs a full-size
    temporary, and slabs that fit in the cache are faster to work on.
    """
    step = max(1, slab_bytes // max(array[0:1].nbytes, 1))
    for first in range(start, stop, step):
        yield slice(first, min(first + step, stop))


def contiguous_strides(shape: Tuple[int, ...], itemsize: int, order: str) -> Tuple[int, ...]:
    """The strides of a contiguous array of ``shape`` in ``order`` (``"C"`` or ``"F"``)."""
    if order == "F":
        return contiguous_strides(shape[::-1], itemsize, "C")[::-1]
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def file_reference(
    path: str, fd: int, kind: str, mode: str, shape: Tuple[int, ...], dtype: np.dtype, order: str
) -> ArrayRef:
    """The reference to an array of ``shape`` and ``dtype`` laid out in ``order`` at offset 0 of the file ``fd``."""
    return ArrayRef.in_file(
        path,
        os.fstat(fd),
        kind=kind,
        mode=mode,
        offset=0,
        shape=tuple(shape),
        strides=contiguous_strides(tuple(shape), dtype.itemsize, order),
        dtype=dtype,
    )


def dump_array(folder: FolderPair, array: np.ndarray, kind: str, mode: str, order: str = "K") -> Tuple[ArrayRef, float]:
    """Write ``array`` into a new file of ``folder``; return its reference and the seconds taken.

    ``order`` chooses the layout in the file (see :func:`file_order`).
    On any failure the partial file is removed before the error propagates.
    """
    started = time.perf_counter()
    order = file_order(array, order)
    path, fd = folder.create_file(array.nbytes, kind)
    try:
        ref = file_reference(path, fd, kind, mode, array.shape, array.dtype, order)
        for piece, _ in iter_pieces(array, order):
            write_range(fd, piece)
    except BaseException:
        os.close(fd)
        delete_file(path)
        raise
    os.close(fd)
    return ref, time.perf_counter() - started
