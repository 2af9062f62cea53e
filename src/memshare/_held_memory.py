"""The Linux memory facts and calls behind arrays held once: malloc chunks, page flags, remapping.

Everything here works on raw addresses of this process, so every function
checks what it can before touching memory, and the caller (``_held_once``)
only passes ranges inside an array it holds a reference to. The two steps
that must not be split by a thread switch (write a range into the file, then
map the file over it) are one call of the C helper ``memshare._remap``, which
keeps the GIL throughout.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import platform
import sys
from typing import List, Optional, Tuple

import numpy as np

from ._compat import gil_enabled

try:
    from . import _remap
except ImportError:  # built without a C compiler, or not on Linux
    _remap = None

PAGE = mmap.PAGESIZE

# glibc's malloc: a chunk served by mmap() starts at a page boundary with a
# two-word header (prev_size, size); the size word has the IS_MMAPPED bit.
_WORD = ctypes.sizeof(ctypes.c_size_t)
_CHUNK_HEADER = 2 * _WORD
_IS_MMAPPED = 0x2
_SIZE_FLAGS = 0x7

# /proc/self/pagemap: one 64-bit entry per virtual page.
_PM_PRESENT = np.uint64(1 << 63)
_PM_SWAPPED = np.uint64(1 << 62)
_PM_FILE = np.uint64(1 << 61)  # a page of a file, or shared anonymous memory


def _glibc_malloc_in_use() -> bool:
    """True when this process's malloc is glibc's: its mmapped chunks have the layout checked below."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        process = ctypes.CDLL(None)
    except OSError:
        return False
    # An allocator preloaded in place of glibc's (jemalloc, tcmalloc) answers
    # the process's malloc, with another chunk layout.
    address = ctypes.cast
    return address(process.malloc, ctypes.c_void_p).value == address(libc.malloc, ctypes.c_void_p).value


# Found once: a process's C library and allocator do not change.
_GLIBC_MALLOC = _glibc_malloc_in_use()


def unsupported_reason() -> Optional[str]:
    """Why this process cannot hold arrays once at all, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "needs Linux"
    if _remap is None:
        return "memshare was installed without its C helper (memshare._remap: no C compiler at install time)"
    if not _GLIBC_MALLOC:
        return "needs glibc's malloc (another allocator is in use)"
    if not gil_enabled():
        return "needs the GIL, which keeps other threads' writes out of each copy-then-remap step"
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.read(8)
    except OSError as exc:
        return f"/proc/self/pagemap cannot be read ({exc.strerror})"
    return None


def copy_then_remap(fd: int, file_offset: int, address: int, length: int) -> None:
    """Write memory ``[address, address + length)`` into ``fd`` at ``file_offset``, then map it back privately.

    Whole pages: ``address``, ``file_offset`` and ``length`` multiples of the page size, or the C helper
    raises ValueError before touching memory or the file.
    """
    _remap.copy_then_remap(fd, file_offset, address, length)


def rewrite_then_drop(fd: int, file_offset: int, address: int, length: int) -> None:
    """Write pages written since into the file again, then drop their private copies.

    Whole pages, as for :func:`copy_then_remap` (ValueError before anything is touched otherwise).
    """
    _remap.rewrite_then_drop(fd, file_offset, address, length)


def write_range(fd: int, file_offset: int, address: int, length: int) -> None:
    """Write memory ``[address, address + length)`` into ``fd`` at ``file_offset`` (no remapping)."""
    data = (ctypes.c_char * length).from_address(address)
    done = 0
    while done < length:
        done += os.pwrite(fd, memoryview(data)[done:], file_offset + done)


def same_bytes(fd: int, file_offset: int, address: int, length: int) -> bool:
    """True when memory ``[address, address + length)`` equals the file's bytes at ``file_offset``."""
    return os.pread(fd, length, file_offset) == ctypes.string_at(address, length)


def changed_pages(first_page: int, end: int) -> np.ndarray:
    """Indexes (from ``first_page``) of the pages in ``[first_page, end)`` written since they were mapped.

    A page of a private file mapping is a file page until a write copies it:
    present and no longer a file page, or swapped out (only private copies
    are swapped, file pages are dropped), means written.
    """
    count = (end - first_page) // PAGE
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        raw = os.pread(pagemap.fileno(), count * 8, first_page // PAGE * 8)
    if len(raw) != count * 8:
        raise OSError(errno.EIO, "short read of /proc/self/pagemap")
    entries = np.frombuffer(raw, dtype=np.uint64)
    written = ((entries & _PM_PRESENT) != 0) & ((entries & _PM_FILE) == 0)
    written |= (entries & _PM_SWAPPED) != 0
    return np.flatnonzero(written)


def runs(indexes: np.ndarray) -> List[Tuple[int, int]]:
    """Consecutive runs of sorted integers, as (first, count) pairs."""
    if indexes.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(indexes) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [indexes.size]))
    return [(int(indexes[a]), int(b - a)) for a, b in zip(starts, stops)]


def mmapped_chunk(address: int, nbytes: int) -> Optional[str]:
    """None when ``address`` is the data of a glibc malloc chunk of its own mapping; else why not.

    The chunk must start on the page before ``address`` (data follows the
    two-word header), be large enough for ``nbytes``, carry the IS_MMAPPED
    bit, and span only private anonymous memory in ``/proc/self/maps``. Then
    ``free()`` unmaps exactly that range, and nothing but this array lives in
    it. The maps are read before the header, so no unmapped memory is read.
    """
    chunk = address - _CHUNK_HEADER
    if chunk % PAGE:
        return "not a malloc chunk of its own mapping (data is not right after a page-aligned header)"
    covered = _anonymous_extent(chunk)
    if covered is None:
        return "its memory is not a private anonymous mapping"
    size_word = ctypes.c_size_t.from_address(chunk + _WORD).value
    size = size_word & ~_SIZE_FLAGS
    if not size_word & _IS_MMAPPED or size % PAGE or size < nbytes + _CHUNK_HEADER:
        return "not a malloc chunk of its own mapping (glibc served it from the heap)"
    if covered < chunk + size:
        return "its malloc chunk is not wholly private anonymous memory"
    return None


def _anonymous_extent(start: int) -> Optional[int]:
    """The end of the run of private anonymous mappings from ``start`` (a mapping's first byte); None if none."""
    with open("/proc/self/maps", "rb") as maps:
        lines = maps.read().splitlines()
    end = None
    for line in lines:
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split(b"-"))
        anonymous = len(fields) < 6 and fields[3] == b"00:00" and fields[4] == b"0" and fields[1] == b"rw-p"
        if end is None and low <= start < high:
            if not anonymous:
                return None
            end = high
        elif end is not None and low == end and anonymous:
            end = high  # split from its neighbour (by NumPy's madvise for huge pages, say)
        elif end is not None and low >= end:
            break
    return end


def mapped_privately_elsewhere(device: int, inode: int) -> bool:
    """True when another process maps the file ``(device, inode)`` privately: a forked copy of an array held once.

    A child forked while the parent held an array once shares the file's
    pages for every page neither has written since; rewriting the file in
    place would change the child's view. Workers map the file shared, so a
    private mapping elsewhere means such a child (or a copy-on-write task
    still running, which is as unsafe). Processes of other users cannot be
    read and cannot be this process's children either; a child that has
    since called exec() or exited maps nothing.
    """
    wanted = (f"{os.major(device):02x}:{os.minor(device):02x}".encode(), str(inode).encode())
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # cannot tell: assume the worst
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/maps", "rb") as maps:
                lines = maps.read().splitlines()
        except OSError:
            continue  # gone, or another user's
        for line in lines:
            fields = line.split(None, 5)
            if len(fields) >= 5 and (fields[3], fields[4]) == wanted and fields[1].endswith(b"p"):
                return True
    return False


def map_count_room(needed: int) -> bool:
    """True when this process can create ``needed`` more mappings (vm.max_map_count)."""
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as limit:
            maximum = int(limit.read())
        with open("/proc/self/maps", "rb") as maps:
            used = maps.read().count(b"\n")
    except (OSError, ValueError):
        return False
    return used + needed + 1024 < maximum
