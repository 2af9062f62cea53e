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
"""

from __future__ import annotations

import os
import stat
import threading
import time
from typing import Dict, Tuple

import numpy as np

from . import _forksafe, _memfd
from ._refs import USER, ArrayRef, file_identity, kind_of_path

PRUNE_INTERVAL = 0.05  # seconds between checks for deleted files while the cache is not empty
_OPEN_FLAGS = {"r": os.O_RDONLY, "c": os.O_RDONLY, "r+": os.O_RDWR}
_Key = Tuple[str, int, int, str]


def _check_ref(ref: ArrayRef) -> None:
    """Refuse references that do not point where memshare would write."""
    if ref.kind != USER and kind_of_path(ref.path) != ref.kind:
        raise PermissionError(f"memshare: refusing to map {ref.path!r}: not a memshare {ref.kind} file")
    if ref.mode not in _OPEN_FLAGS:
        raise ValueError(f"memshare: invalid mapping mode {ref.mode!r} in a reference")


def map_file(ref: ArrayRef) -> np.memmap:
    """Map the whole file of ``ref`` as a 1-D uint8 ``np.memmap``.

    A memfd's ``/proc/<pid>/fd/<n>`` path is a magic link, which
    ``O_NOFOLLOW`` would refuse: it is opened plainly, and what was opened is
    checked instead (its identity, and for memshare's own files the kind its
    link names).
    """
    _check_ref(ref)
    memfd = _memfd.is_memfd_path(ref.path)
    flags = _OPEN_FLAGS[ref.mode] | getattr(os, "O_CLOEXEC", 0) | (0 if memfd else getattr(os, "O_NOFOLLOW", 0))
    fd = os.open(ref.path, flags)
    with open(fd, "rb" if ref.mode != "r+" else "r+b") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not ref.is_file(info):
            raise FileNotFoundError(f"memshare: {ref.path!r} was replaced since it was shared")
        if memfd and ref.kind != USER and _memfd.kind_of_descriptor(fd) != ref.kind:
            raise PermissionError(f"memshare: refusing to map {ref.path!r}: not a memshare {ref.kind} memfd")
        base = np.memmap(handle, dtype=np.uint8, mode=ref.mode)
    base.filename = ref.path  # np.memmap leaves it unset for file objects
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
    """Mappings of shared files kept open in this process, thread-safe."""

    def __init__(self) -> None:
        self._lock = _forksafe.lock()
        self._bases: Dict[_Key, np.memmap] = {}
        self._pruner_started = False
        self._not_empty = threading.Event()

    def array(self, ref: ArrayRef) -> np.memmap:
        if ref.mode == "c":
            return view_of(map_file(ref), ref)
        key = (ref.path, ref.device, ref.inode, ref.mode)
        with self._lock:
            base = self._bases.get(key)
        if base is None or len(base) < _end_of(ref):
            # New, or a user file that grew since it was mapped (same inode).
            base = map_file(ref)
            with self._lock:
                self._bases[key] = base
                self._not_empty.set()
                self._start_pruner()
        return view_of(base, ref)

    def prune(self) -> None:
        """Drop mappings whose file was deleted or replaced."""
        with self._lock:
            keys = list(self._bases)
        stale = []
        for key in keys:
            path, device, inode, _ = key
            try:
                if file_identity(os.stat(path)) != (device, inode):
                    stale.append(key)
            except OSError:
                stale.append(key)
        with self._lock:
            for key in stale:
                self._bases.pop(key, None)
            if not self._bases:
                self._not_empty.clear()

    def _start_pruner(self) -> None:
        if self._pruner_started:
            return
        self._pruner_started = True
        thread = threading.Thread(target=self._prune_forever, name="memshare-mapping-pruner", daemon=True)
        thread.start()

    def _prune_forever(self) -> None:
        while True:
            self._not_empty.wait()
            time.sleep(PRUNE_INTERVAL)
            self.prune()


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


def array_from_ref(ref: ArrayRef, cached: bool = True) -> np.memmap:
    """The array behind ``ref``; ``cached=False`` maps privately for the caller."""
    if cached:
        return cache.array(ref)
    return view_of(map_file(ref), ref)
