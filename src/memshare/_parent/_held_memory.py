"""The Linux memory facts and calls behind arrays held once: malloc chunks, page flags, remapping.

Everything here works on raw addresses of this process, so every function
checks what it can before touching memory, and the caller (``_held_once``)
only passes ranges inside an array it holds a reference to. The two steps
that must not lose a write made between them (write a range into the file,
then map the file over it) are one call of the C helper ``memshare._parent._remap``,
which keeps the range read-only meanwhile: a thread writing into it waits,
then writes into the new mapping.
"""

from __future__ import annotations

import ctypes
import sys
from typing import List, Optional, Tuple

from .._compat import gil_enabled
from .._lifetime import _procfs
from .._numpy import np
from .._transport import _pages
from . import _malloc

try:
    from . import _remap
except ImportError:  # built without a C compiler, or not on Linux
    _remap = None

PAGE = _pages.PAGE


def malloc_in_use() -> _malloc.Malloc:
    """This process's malloc: glibc's or another, and how memshare knows (see ``_malloc``)."""
    return _MALLOC


# Found once: a process's C library and allocator do not change.
_MALLOC = _malloc.find()
_GLIBC_MALLOC = _MALLOC.glibc


def unsupported_reason() -> Optional[str]:
    """Why this process cannot hold arrays once at all, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "needs Linux"
    if _remap is None:
        return "memshare was installed without its C helper (memshare._parent._remap: no C compiler at install time)"
    if not _GLIBC_MALLOC:
        return f"needs glibc's malloc; this process's is {_MALLOC.describe()}"
    if not gil_enabled():
        return "needs the GIL: holding arrays once is not tested on free-threaded builds"
    try:
        _procfs.pagemap(0, 1)
    except OSError as exc:
        return f"/proc/self/pagemap cannot be read ({exc.strerror})"
    return None


def copy_then_remap(fd: int, file_offset: int, address: int, length: int) -> None:
    """Write memory ``[address, address + length)`` into ``fd`` at ``file_offset``, then map it back privately.

    Whole pages: ``address``, ``file_offset`` and ``length`` multiples of the page size, or the C helper
    raises ValueError before touching memory or the file. No write of another thread is lost: the
    range is read-only meanwhile, and a writer waits for the new mapping (see ``_remap.c``).
    """
    _remap.copy_then_remap(fd, file_offset, address, length)


def memory_at(address: int, length: int) -> np.ndarray:
    """The bytes of memory ``[address, address + length)``, as a byte array over them (no copy)."""
    return np.frombuffer((ctypes.c_char * length).from_address(address), dtype=np.uint8)


def runs(indexes: np.ndarray) -> List[Tuple[int, int]]:
    """Consecutive runs of sorted integers, as (first, count) pairs."""
    if indexes.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(indexes) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [indexes.size]))
    return [(int(indexes[a]), int(b - a)) for a, b in zip(starts, stops)]


def mmapped_chunk(address: int, nbytes: int, aligned: bool = False) -> Optional[str]:
    """None when ``address`` is the data of a glibc malloc chunk of its own mapping; else why not.

    glibc's two-word header (prev_size, size) must start on the page before
    ``address``. The chunk must carry the IS_MMAPPED bit and start its
    mapping (prev_size, its offset in the mapping, is 0: neither an aligned
    allocation nor huge pages), and its mapping, which ends on a page
    boundary in one of the layouts ``_malloc.mapping_end`` knows, must hold
    the array and be private anonymous memory in ``/proc/self/maps``. Then
    ``free()`` unmaps that whole range, and nothing but this array lives in
    it. The maps are read before the header, so no unmapped memory is read.

    ``aligned`` also takes a chunk that ``posix_memalign`` carved out of its
    mapping (torch's CPU allocator aligns to 64 bytes): its header is then
    ``prev_size`` bytes past the page-aligned start of the mapping, which
    ``free()`` unmaps from that start, and the mapping's size is
    ``prev_size`` more than the chunk's.
    """
    chunk = address - _malloc.CHUNK_HEADER
    if chunk % PAGE and not aligned:
        return "not a malloc chunk of its own mapping (data is not right after a page-aligned header)"
    covered = _anonymous_extent(chunk - chunk % PAGE)
    if covered is None:
        # A heap chunk's header lands on a page boundary once in 256 or so.
        return _FROM_HEAP if _in_heap(chunk) else "its memory is not a private anonymous mapping"
    prev_size, size_word = (ctypes.c_size_t * 2).from_address(chunk)
    if not size_word & _malloc.IS_MMAPPED:
        return _FROM_HEAP
    start = chunk
    if aligned and prev_size and (chunk - prev_size) % PAGE == 0 and prev_size < _MAX_ALIGNMENT:
        start, size_word = chunk - prev_size, size_word + prev_size
        covered = _anonymous_extent(start) if start < chunk - chunk % PAGE else covered
        if covered is None:
            return "its memory is not a private anonymous mapping"
    elif chunk % PAGE:
        return "not a malloc chunk of its own mapping (data is not right after a page-aligned header)"
    end, _layout = _malloc.mapping_end(start, size_word)
    if (prev_size and start == chunk) or end is None:
        return f"a malloc chunk of a layout memshare does not know (header {prev_size:#x}, {size_word:#x})"
    if end < address + nbytes:
        return "its malloc chunk is smaller than the array"
    if covered < end:
        return "its malloc chunk is not wholly private anonymous memory"
    return None


_FROM_HEAP = "not a malloc chunk of its own mapping (glibc served it from the heap)"

#: The largest alignment of an aligned chunk taken (a huge page): a larger prev_size is not an alignment's.
_MAX_ALIGNMENT = 2 * 1024**2


def _anonymous_extent(start: int) -> Optional[int]:
    """The end of the run of private anonymous mappings from the one holding ``start``; None if it is not one.

    The kernel merges neighbouring anonymous mappings, so a chunk's mapping
    may be part of a larger one. glibc may name its mappings (the tunable
    ``glibc.mem.decorate_maps``: ``[anon:glibc: malloc]``); they are still
    private anonymous memory.
    """
    end = None
    for low, high, permissions, _, device, inode, path in _procfs.mappings():
        named = path is None or path.startswith(b"[anon:")
        anonymous = named and device == b"00:00" and inode == b"0" and permissions == b"rw-p"
        if end is None and low <= start < high:
            if not anonymous:
                return None
            end = high
        elif end is not None and low == end and anonymous:
            end = high  # split from its neighbour (by NumPy's madvise for huge pages, say)
        elif end is not None and low >= end:
            break
    return end


def _in_heap(address: int) -> bool:
    """True when ``address`` lies in the process's ``[heap]`` (the main malloc arena's memory)."""
    return any(low <= address < high and path == b"[heap]" for low, high, *_, path in _procfs.mappings())


def map_count_room(needed: int) -> bool:
    """True when this process can create ``needed`` more mappings (vm.max_map_count)."""
    maximum, used = _procfs.max_map_count(), _procfs.mapping_count()
    if maximum is None or used is None:
        return False
    return used + needed + 1024 < maximum
