"""Turning an :class:`ArrayRef` back into an array, in any process.

A worker keeps each file's mapping open across tasks (:class:`MappingCache`):
mapping anew for every task would pay the page faults of the whole input
again each time. The cache must not outlive the file, or an idle worker
would pin the memory of a deleted file: a daemon thread checks the cached
paths every ``PRUNE_INTERVAL`` seconds and drops the mappings whose file is
gone or was replaced (and every new task prunes first). An idle worker
would otherwise keep a finished call's deleted dump in memory while the next
call writes its own: back-to-back calls would hold the data twice. The
thread sleeps while the cache is empty. Copy-on-write mappings (``'c'``) are never cached: a
task's private writes must not leak into the next task.

:func:`map_descriptor` maps a file without keeping its descriptor: a mapping
needs none once it exists (the kernel keeps the file alive while it is
mapped), but ``mmap.mmap`` keeps a duplicate until it is closed, so a process
holding thousands of arrays would hold thousands of descriptors and meet its
``RLIMIT_NOFILE``. The parent maps adopted results that way, and every
process maps references that way (:func:`map_file`): open, map, close. The
array rebuilt from a reference is still an ``np.memmap`` reporting the
``filename``, ``offset`` and ``mode`` numpy gives (see :func:`map_file`).

The cache is bounded by count (``CACHE_LIMIT``), least recently used first
out: every mapping is an entry of the process's ``vm.max_map_count``, and a
worker sent tens of thousands of arrays over many tasks must not meet that
limit because of mappings it no longer needs. Dropping a cached mapping only
forgets it: arrays still alive keep their mapping (they own it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import stat
import sys
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional, Tuple

from .. import _forksafe
from .._compat import set_memmap_owner
from .._lifetime import _memfd, _procfs
from .._numpy import np
from ._backing import MappedFile, note_mapped_file
from ._refs import USER, ArrayRef, is_file, kind_of_path

PRUNE_INTERVAL = 0.05  # seconds between checks for deleted files while the cache is not empty
#: The pruner sleeps at least this many times what its last check took: stat-ing thousands of
#: cached paths must not cost a worker more than a small share of one core.
PRUNE_COST_FACTOR = 20
_OPEN_FLAGS = {"r": os.O_RDONLY, "c": os.O_RDONLY, "r+": os.O_RDWR}
_Key = Tuple[str, int, int, str]

#: True where ``mmap.mmap`` can leave the descriptor alone (``trackfd=False``, Python 3.13+); before
#: that, :func:`map_descriptor` calls the C library's mmap through ctypes. A constant (tests force each way).
TRACKFD = sys.version_info >= (3, 13)


def _c_mmap() -> Optional[Tuple[Callable[..., Any], Callable[..., Any]]]:
    """The C library's (mmap, munmap) with their signatures set; None where there is no such library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    # mmap64 takes a 64-bit offset on every ABI (plain mmap's off_t is 32 bits on some 32-bit ones).
    c_mmap = getattr(libc, "mmap64", None) or getattr(libc, "mmap", None)
    c_munmap = getattr(libc, "munmap", None)
    if c_mmap is None or c_munmap is None:
        return None
    c_mmap.restype = ctypes.c_void_p
    c_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    c_munmap.restype = ctypes.c_int
    c_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return c_mmap, c_munmap


# Looked up once: a process's C library does not change (read-only after import).
_C_MMAP = _c_mmap()
_MAP_FAILED = ctypes.c_void_p(-1).value
#: mode -> (mmap flags, protection) of :func:`map_descriptor`.
_MAP_MODES = {
    "r": (mmap.MAP_SHARED, mmap.PROT_READ),
    "r+": (mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
    "c": (mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE),
}


def _map_count_limit() -> int:
    """The kernel's limit of mappings per process (``vm.max_map_count``); its default where unknown."""
    limit = _procfs.max_map_count()
    return 65530 if limit is None else limit


#: Most mappings a process's cache keeps: an eighth of ``vm.max_map_count`` (read once; the
#: rest is left to the live arrays, the allocator and the user's program), at most 8192.
CACHE_LIMIT = max(64, min(8192, _map_count_limit() // 8))


class _Mapping:
    """A mapping made through ctypes, as an array interface; unmapped when the last array over it dies.

    It is the base of the arrays over it (NumPy keeps the object that
    exposes ``__array_interface__`` as the array's base), so it lives exactly
    as long as they do. ``__del__`` runs when the last reference goes: no
    array can still reach the memory then. It is not a ``weakref.finalize``,
    which would unmap at interpreter exit memory that objects still alive
    then may read.
    """

    # Weakly referable: the parent counts what an adopted result keeps alive until it is unmapped.
    __slots__ = ("address", "length", "__array_interface__", "_munmap", "__weakref__")

    #: Tells ``_backing.find_backing`` that arrays over this object map a file (as over an ``mmap.mmap``).
    maps_file = True

    def __init__(self, address: int, length: int, writable: bool, munmap: Callable[..., Any]) -> None:
        self.address = address
        self.length = length
        self._munmap = munmap  # kept here: module globals may be gone when __del__ runs at exit
        self.__array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (address, not writable),
            "version": 3,
        }

    def __del__(self) -> None:
        self._munmap(self.address, self.length)


@functools.cache
def _mapped_bytes_type() -> type:
    """``MappedBytes``: made once, on first use, since a worker that maps no file need not import numpy."""

    class MappedBytes(np.ndarray):
        """The bytes of a ctypes mapping under the ``np.memmap`` that :func:`map_file` returns.

        A type of its own only so that numpy never collapses the base of a view
        of that memmap past it (see :func:`map_file`); nothing else differs.
        """

    return MappedBytes


def map_descriptor(fd: int, length: int, mode: str = "r+") -> np.ndarray:
    """Map the first ``length`` bytes of the file open at ``fd`` as a 1-D uint8 array that keeps no descriptor.

    ``mode`` is ``'r'`` (shared, read-only), ``'r+'`` (shared, read-write)
    or ``'c'`` (private copy-on-write, writable). The caller may close ``fd``
    as soon as this returns: the mapping needs no descriptor. The memory is
    unmapped when the last array over it (this one or any view) is freed;
    the array is a plain ``np.ndarray`` whose base owns the mapping.

    On Python 3.13+ this is ``mmap.mmap(..., trackfd=False)``; before, the C
    library's ``mmap`` through ctypes, owned by a small object whose
    ``__del__`` unmaps. Where neither exists, ``mmap.mmap`` keeps a
    duplicate descriptor. ``length`` 0 maps nothing (an empty
    array: mmap refuses empty mappings). ``length`` must not exceed the
    file's size: a page wholly past its end faults (SIGBUS) when touched.
    """
    if mode not in _MAP_MODES:
        raise ValueError(f"memshare: invalid mapping mode {mode!r} (expected 'r', 'r+' or 'c')")
    if length < 0:
        raise ValueError(f"memshare: invalid mapping length {length} (negative)")
    if length == 0:
        os.fstat(fd)  # still refuse a bad descriptor
        return np.empty(0, np.uint8) if mode != "r" else _read_only(np.empty(0, np.uint8))
    flags, prot = _MAP_MODES[mode]
    if TRACKFD or _C_MMAP is None:
        extra = {"trackfd": False} if TRACKFD else {}
        raw = mmap.mmap(fd, length, flags=flags, prot=prot, **extra)
        return np.frombuffer(raw, np.uint8)  # read-only exactly when the mmap is
    c_mmap, c_munmap = _C_MMAP
    address = c_mmap(None, length, prot, flags, fd, 0)
    if address is None or address == _MAP_FAILED:
        error = ctypes.get_errno()
        raise OSError(error, f"memshare: cannot map {length} bytes of a file: {os.strerror(error)}")
    # From here the _Mapping owns the memory: if anything below fails, its __del__ unmaps.
    return np.asarray(_Mapping(address, length, mode != "r", c_munmap))


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _check_ref(ref: ArrayRef) -> None:
    """Refuse references that do not point where memshare would write."""
    if ref.kind != USER and kind_of_path(ref.path) != ref.kind:
        raise PermissionError(f"memshare: refusing to map {ref.path!r}: not a memshare {ref.kind} file")
    if ref.mode not in _OPEN_FLAGS:
        raise ValueError(f"memshare: invalid mapping mode {ref.mode!r} in a reference")


def map_file(ref: ArrayRef) -> np.memmap:
    """Map the whole file of ``ref`` as a 1-D uint8 ``np.memmap`` that keeps no descriptor.

    memshare's own files are opened with ``O_NOFOLLOW``: a link planted at
    their name is refused. A memfd's ``/proc/<pid>/fd/<n>`` path is a magic
    link, which ``O_NOFOLLOW`` would refuse: it is opened plainly, and what
    was opened is checked instead (its identity, and for memshare's own files
    the kind its link names). The user's own files (an ``np.memmap`` opened
    through a symbolic link keeps the link's name) are opened following
    links, as the user did: what was opened must still be the file the
    sender identified by (device, inode), wherever the link points now.

    The file is mapped with :func:`map_descriptor` and its descriptor closed
    before this returns. The result is an ``np.memmap`` view of that mapping
    with the attributes numpy's own ``np.memmap.__new__`` sets (``filename``
    the reference's path, ``offset`` 0, ``mode`` the mapping's); numpy's
    ``__array_finalize__`` passes them to every slice, as for a memmap numpy
    opened. On Python 3.13+ the memmap's base is the ``mmap.mmap`` (so
    ``flush()`` reaches it, as in numpy); before, a plain array over the
    ctypes mapping, where ``flush()`` does nothing (shared pages are visible
    to every process as they are written; only the write-back to disk of a
    user's file is left to the kernel's schedule).
    """
    _check_ref(ref)
    memfd = _memfd.is_memfd_path(ref.path)
    follow = memfd or (ref.kind == USER and kind_of_path(ref.path) == USER)
    flags = _OPEN_FLAGS[ref.mode] | getattr(os, "O_CLOEXEC", 0) | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
    fd = os.open(ref.path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not ref.is_file(info):
            raise FileNotFoundError(f"memshare: {ref.path!r} was replaced since it was shared")
        if memfd and ref.kind != USER and _memfd.kind_of_descriptor(fd) != ref.kind:
            raise PermissionError(f"memshare: refusing to map {ref.path!r}: not a memshare {ref.kind} memfd")
        if info.st_size == 0:
            raise ValueError(f"memshare: cannot map {ref.path!r}: the file is empty")
        raw = map_descriptor(fd, info.st_size, ref.mode)
    finally:
        os.close(fd)  # the mapping keeps the file alive; no descriptor is needed any more
    owner = raw.base
    if isinstance(owner, mmap.mmap):
        # As numpy builds a memmap: an ndarray subclass straight over the mmap.
        base = np.ndarray.__new__(np.memmap, raw.shape, np.uint8, buffer=owner)
    else:
        # numpy collapses a new view's base past every level of the view's own type: a plain
        # ndarray made over ``base`` (as ``_shared_store`` does) would skip a memmap whose base
        # is a plain ndarray, and a memmap view one whose base is a memmap, losing the file
        # (or its offset). A level of a third type in between stops both.
        base = raw.view(_mapped_bytes_type()).view(np.memmap)
    del raw
    # What np.memmap.__new__ sets; __array_finalize__ (which ran above and found no
    # memmap to copy from) left them None, and copies them to every slice from now on.
    base.filename = ref.path
    base.offset = 0
    base.mode = ref.mode
    set_memmap_owner(base, owner)
    if ref.kind != USER or not memfd:
        # What was opened and checked above: find_backing names it with no stat or readlink. (A
        # user's memfd is left out: its kind would take a readlink of the path, which may name
        # another file by now.)
        kind = ref.kind if ref.kind != USER else kind_of_path(ref.path)
        note_mapped_file(base, MappedFile(ref.path, info.st_dev, info.st_ino, kind))
    return base


def view_of(base: np.memmap, ref: ArrayRef) -> np.memmap:
    """The array ``ref`` describes, as a view of ``base`` (no copy)."""
    view = np.ndarray.__new__(np.memmap, ref.shape, ref.dtype, buffer=base, offset=ref.offset, strides=ref.strides)
    # Constructing from a buffer does not link the view to its memmap; this
    # public hook copies filename/mode and keeps slices of the view memmaps.
    view.__array_finalize__(base)
    # The offset and mode of the user's memmap the array views, as numpy
    # reports them for any slice of it (base is the whole file, from 0).
    if ref.memmap_offset is not None:
        view.offset = ref.memmap_offset
    if ref.memmap_mode is not None:
        view.mode = ref.memmap_mode
    return view


def _end_of(ref: ArrayRef) -> int:
    """One past the last byte of the file that ``ref``'s elements occupy."""
    if not ref.shape or min(ref.shape) > 0:
        reach = sum((n - 1) * s for n, s in zip(ref.shape, ref.strides) if s > 0)
        return ref.offset + reach + ref.dtype.itemsize
    return ref.offset


class MappingCache:
    """Mappings of shared files kept in this process, thread-safe, at most ``limit`` of them (LRU)."""

    def __init__(self, limit: Optional[int] = None) -> None:
        self._lock = _forksafe.lock()
        self._bases: OrderedDict[_Key, np.memmap] = OrderedDict()
        # Every mapping this cache made that something still holds (an array over it, a broadcast's
        # copy), weakly: a reference to the same file and mode is a view of it, not a new mapping,
        # though the file may have left the LRU list above (or been forgotten there: a broadcast's).
        # Holding nothing, it pins no deleted file and needs no pruning: the (device, inode) of a
        # live mapping belong to its file alone, deleted or not.
        self._alive: weakref.WeakValueDictionary[_Key, np.memmap] = weakref.WeakValueDictionary()
        self._limit = CACHE_LIMIT if limit is None else limit
        self._pruner_started = False
        self._not_empty = threading.Event()

    def __len__(self) -> int:
        with self._lock:
            return len(self._bases)

    def array(self, ref: ArrayRef) -> np.memmap:
        if ref.mode == "c":
            return view_of(map_file(ref), ref)
        key = (ref.path, ref.device, ref.inode, ref.mode)
        with self._lock:
            base = self._bases.get(key)
            if base is not None:
                self._bases.move_to_end(key)
            else:
                base = self._alive.get(key)
                if base is not None and len(base) >= _end_of(ref):
                    # Held elsewhere (a broadcast's copy): a view, and not cached again, which its
                    # holder did not want (see forget).
                    return view_of(base, ref)
        if base is None or len(base) < _end_of(ref):
            # New, or a user file that grew since it was mapped (same inode).
            base = map_file(ref)
            with self._lock:
                self._bases[key] = base
                self._alive[key] = base
                self._bases.move_to_end(key)
                while len(self._bases) > self._limit:
                    # Forgotten, not unmapped: an array still alive over it keeps it.
                    self._bases.popitem(last=False)
                self._not_empty.set()
                self._start_pruner()
        return view_of(base, ref)

    def prune(self) -> None:
        """Drop mappings whose file was deleted or replaced (the path, stat-ed: no descriptor is kept)."""
        if not self._bases:  # a worker of small tasks maps nothing: no lock, no list, before each task
            return
        with self._lock:
            keys = list(self._bases)
        stale = [key for key in keys if not is_file(key[0], (key[1], key[2]))]
        with self._lock:
            for key in stale:
                self._bases.pop(key, None)
            if not self._bases:
                self._not_empty.clear()

    def forget(self, path: str, device: int, inode: int) -> None:
        """Drop the cached mappings of the file at ``path`` (its arrays keep theirs): their holder outlives tasks."""
        with self._lock:
            for mode in ("r", "r+"):
                self._bases.pop((path, device, inode, mode), None)
            if not self._bases and self._not_empty.is_set():
                self._not_empty.clear()

    def _start_pruner(self) -> None:
        if self._pruner_started:
            return
        self._pruner_started = True
        thread = threading.Thread(target=self._prune_forever, name="memshare-mapping-pruner", daemon=True)
        thread.start()

    def _prune_forever(self) -> None:
        took = 0.0
        while True:
            self._not_empty.wait()
            time.sleep(max(PRUNE_INTERVAL, PRUNE_COST_FACTOR * took))
            started = time.perf_counter()
            self.prune()
            took = time.perf_counter() - started


# One cache per process: mappings are a per-process resource, and every task
# run in this process should reuse them. Replaced in forked children, whose
# pruner thread did not survive the fork.
cache = MappingCache()


def _reset_after_fork() -> None:
    global cache
    cache = MappingCache()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def prune_mappings() -> None:
    """Drop this process's mappings of files that were deleted since."""
    cache.prune()


def forget_mapping(path: str, device: int, inode: int) -> None:
    """Stop caching this process's mappings of a file that something else keeps mapped (a broadcast's copy)."""
    cache.forget(path, device, inode)


def array_from_ref(ref: ArrayRef, cached: bool = True) -> np.memmap:
    """The array behind ``ref``; ``cached=False`` maps privately for the caller."""
    if cached:
        return cache.array(ref)
    return view_of(map_file(ref), ref)
