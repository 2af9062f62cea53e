"""Arrays held once: a large ordinary array, once sent, keeps its data in its shared file.

The first time the parent sends an eligible array to workers, memshare
writes it into a file of shared memory, as any dump, and then stops keeping
its own copy: the whole pages inside the array's buffer become a private
(copy-on-write) mapping of that file, at the same addresses. The array
object does not change: same address, values and flags, it still owns its
data. The file's pages are the memory now, held once by the parent and by
every worker that maps them. This is *promotion*; it is done piece by piece
(``CHUNK_BYTES``), so the extra memory at any moment is one piece.

Why it stays correct:

* The mapping is private. A write by the parent copies the one page it
  touches; the file, which workers read, does not change during a call; a
  forked child's writes stay in the child.
* Before the array is sent again (once per call), ``/proc/self/pagemap``
  tells which pages were written since: a page present and no longer a file
  page (or swapped out) was copied by a write. That reads 8 bytes a page,
  2 MB for 1 GiB, instead of the array. Those pages are written to the file
  again and their private copies dropped, in one step that no Python code
  can interleave with (``_held_memory``). The first and last pages, partly
  outside the array, stay ordinary memory and are compared byte by byte.
* The file is rewritten in place only when no task that reads it is
  pending and no forked child still maps it privately (a child forked
  while the array was held once reads the file for every page neither has
  written, so a rewrite would reach into the child; looked for in
  ``/proc/*/maps`` only after a fork); otherwise the call gets an ordinary
  dump, as without promotion.
* The held file goes to workers only read-only or copy-on-write, in every
  call, whatever was held before (``Held.reference``): a worker's write
  would reach every page the parent has not written since. A call whose
  workers map writable (``mmap_mode='r+'``/``'w+'``) gets an ordinary dump
  of an array held once, and leaves its file as it is.
* When the array is freed, NumPy's ``free()`` unmaps the whole malloc chunk,
  the file mapping with it; the weak reference callback closes and deletes
  the file, and workers drop their mappings when they see it gone.

What is promoted (everything else is dumped as before): on Linux with
glibc's malloc and the C helper built, an array that owns its data, made by
NumPy's default allocator, in a malloc chunk that glibc served with a
mapping of its own; C or Fortran contiguous, so that the file has the
memory's exact layout; sent with workers mapping read-only or copy-on-write
(with ``mmap_mode='r+'`` a worker's write would reach the parent); and only
when memshare chooses the location (no ``temp_folder``) and the file fits
in shared memory. An array an earlier call held is still sent as it is by a
call with a ``temp_folder``: it needs no new file, so none is written.
``MEMSHARE_PROMOTE=0`` or ``promote=False`` turns it off (for an array
already held too: that call dumps it).

One race is left to the caller, as with any shared data: a NumPy operation
that releases the GIL and writes the array from another thread at the very
moment memshare promotes or refreshes that array.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np

from . import _forksafe, _held_memory
from ._compat import made_by_default_allocator
from ._dumping import CHUNK_BYTES
from ._folders import SHM_ROOT, Location, TempFolder, choose_location, delete_file, free_bytes, reserve
from ._identity import IdentityTable
from ._memfd import duplicate, held_count, is_memfd_path, within_budget
from ._refs import HELD, ArrayRef, data_address

PAGE = _held_memory.PAGE
#: Smallest array worth a file and two extra mappings of its own.
MIN_BYTES = 16 * PAGE
#: Mappings each promotion may add (the file mapping splits the chunk's one or two).
_MAPPINGS_PER_ARRAY = 3
#: The only modes a held file is ever sent with: the worker's writes stay out of the file.
SAFE_MODES = ("r", "c")


@dataclass
class Held:
    """One array held once: its file, and which part of its memory maps the file."""

    ref: ArrayRef  # the whole array in its file, mapped read-only by workers
    address: int
    nbytes: int
    first_page: int  # [first_page, end_page) maps the file; the rest is ordinary memory
    end_page: int
    forks: int  # the process's fork count when no forked copy of the array was last seen
    owner: int = field(default_factory=os.getpid)  # a forked child must not free the parent's file
    pending: int = 0  # tasks in flight (any pool or call) that read the file
    _lock: object = field(default_factory=_forksafe.lock, repr=False)

    def file_offset(self, address: int) -> int:
        return self.ref.offset + address - self.address

    def acquire(self) -> None:
        with self._lock:
            self.pending += 1

    def release(self) -> None:
        with self._lock:
            self.pending -= 1

    def reference(self, worker_mode: str) -> ArrayRef:
        """The reference workers map the held file with, in ``worker_mode``; never a writable one.

        Raises ``ValueError`` for a writable mode (see :func:`mode_unfit_reason`):
        the caller must dump the array instead.
        """
        reason = mode_unfit_reason(worker_mode)
        if reason is not None:
            raise ValueError(f"memshare: an array held once cannot be sent as it is: {reason}")
        return dataclasses.replace(self.ref, mode=worker_mode)

    def describes(self, array: np.ndarray) -> bool:
        """True while ``array``'s memory is still the range that was promoted."""
        return data_address(array) == self.address and array.nbytes == self.nbytes

    def refresh(self, array: np.ndarray) -> Optional[int]:
        """Bring the file up to date with ``array``; the bytes rewritten, or None when it cannot be done in place.

        None means: the array's memory moved or shrank, or it changed while a
        task may still read the file, or after a fork, or its pages' flags
        could not be read.
        """
        if not self.describes(array):
            return None
        try:
            changed = _held_memory.changed_pages(self.first_page, self.end_page)
        except OSError:
            return None
        edges = [
            (self.address, self.first_page - self.address),
            (self.end_page, self.address + self.nbytes - self.end_page),
        ]
        try:
            fd = self._open()
        except OSError:
            return None
        try:
            stale_edges = [
                (start, length)
                for start, length in edges
                if length and not _held_memory.same_bytes(fd, self.file_offset(start), start, length)
            ]
            if changed.size == 0 and not stale_edges:
                return 0
            with self._lock:
                if self.pending or not self._no_forked_copy():
                    return None
                for first, count in _held_memory.runs(changed):
                    start = self.first_page + first * PAGE
                    _held_memory.rewrite_then_drop(fd, self.file_offset(start), start, count * PAGE)
                for start, length in stale_edges:
                    _held_memory.write_range(fd, self.file_offset(start), start, length)
        finally:
            os.close(fd)
        return int(changed.size) * PAGE + sum(length for _, length in stale_edges)

    def _no_forked_copy(self) -> bool:
        """True when no forked process still shares the file's pages privately (with the lock held).

        Only looked for when the process forked since the last look: old loky
        releases start every worker with fork() then exec(), which leaves no
        copy behind, and a child that exits leaves none either.
        """
        if self.forks == _forks.count:
            return True
        count = _forks.count
        if _held_memory.mapped_privately_elsewhere(self.ref.device, self.ref.inode):
            return False
        self.forks = count
        return True

    def _open(self) -> int:
        """A writable descriptor of the file, opened for one refresh.

        Not kept between refreshes: a process holding many arrays once
        would otherwise spend a descriptor on each (a memfd already costs
        one, kept by ``_memfd``).
        """
        if is_memfd_path(self.ref.path):
            return duplicate(self.ref.path)
        fd = os.open(self.ref.path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        if not self.ref.is_file(os.fstat(fd)):
            os.close(fd)
            raise FileNotFoundError(f"memshare: {self.ref.path!r} was replaced")
        return fd

    def close(self) -> None:
        """The array is gone: free the file (workers drop their mappings when they see it gone).

        A forked child inherits the array's weak reference callback too; only
        the process that promoted the array frees its file.
        """
        if os.getpid() != self.owner:
            return
        delete_file(self.ref.path)


def mode_unfit_reason(worker_mode: str) -> Optional[str]:
    """Why a held file must not be sent to workers mapping with ``worker_mode``, or None when it may.

    The rule for every call, whether the array is held once now or was held
    by an earlier call: the held file *is* the parent's memory (each page the
    parent has not written since reads it), so a worker writing into it
    would change the parent's array. Read-only and copy-on-write mappings
    keep the worker's writes, if any, in the worker.
    """
    if worker_mode in SAFE_MODES:
        return None
    return f"workers map it with mmap_mode={worker_mode!r}: their writes would reach the parent's array"


def unfit_reason(array: np.ndarray, worker_mode: str, temp_folder: Optional[str]) -> Optional[str]:
    """Why ``array`` cannot be held once, or None when it can (see the module docstring)."""
    unsupported = _held_memory.unsupported_reason()
    if unsupported is not None:
        return unsupported
    mode_reason = mode_unfit_reason(worker_mode)
    if mode_reason is not None:
        return mode_reason
    location = choose_location(temp_folder)
    if location.in_memory and not within_budget():
        # Its memfd would be one more descriptor kept for the array's whole life (see _memfd).
        return f"memshare holds {held_count()} memfds, its budget of descriptors (half of ulimit -n)"
    if not location.in_memory and location.base != SHM_ROOT:
        return f"it would live in a file outside shared memory ({location.reason})"
    if not location.in_memory and temp_folder is not None:
        return f"its files go where the user asked ({location.reason})"
    if isinstance(array, np.memmap) or array.base is not None or not array.flags.owndata:
        return "it does not own its memory"
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        return "it is not contiguous"
    if array.nbytes < MIN_BYTES:
        return "it is too small to be worth a file of its own"
    if not made_by_default_allocator(array):
        return "its memory does not come from NumPy's default allocator"
    not_own_mapping = _held_memory.mmapped_chunk(data_address(array), array.nbytes)
    if not_own_mapping is not None:
        return not_own_mapping
    if not _held_memory.map_count_room(_MAPPINGS_PER_ARRAY):
        return "the process is near its limit of memory mappings (vm.max_map_count)"
    return None


class _Registry:
    """The process's arrays held once, found by identity.

    One per process because promotion changes the process's own memory: any
    pool or call of the process that sends the array again must find its
    file. Cleared (not released) in a forked child: the files are the
    parent's, and the child's private pages are its own.
    """

    def __init__(self) -> None:
        self.lock = _forksafe.lock()
        self.promoting = _forksafe.lock()  # held for a whole promotion (see promote)
        self.held: IdentityTable[Held] = IdentityTable()
        # One folder per location (memfds, or named files in /dev/shm), made on
        # first use, so that a changed setting takes effect for later arrays
        # while the files of earlier ones stay where they are.
        self.folders: Dict[Location, TempFolder] = {}

    def lookup(self, array: np.ndarray) -> Optional[Held]:
        with self.lock:
            return self.held.get(array)

    def forget(self, array: np.ndarray) -> None:
        """Stop holding ``array`` once (its memory moved): its file goes, its pages stay as they are."""
        with self.lock:
            held = self.held.get(array)
            if held is not None:
                self.held.remove(array)
        if held is not None:
            held.close()

    def promote(self, array: np.ndarray) -> Tuple[Held, float]:
        """Hold ``array`` once, unless another thread just did; the record and the seconds taken.

        Promotions are serialised: two pools or calls in two threads sending
        the same new array must not both remap it (the first file would stay
        mapped by nobody's record and never be freed).
        """
        with self.promoting:
            held = self.lookup(array)
            if held is not None:
                return held, 0.0
            return self._promote(array)

    def _promote(self, array: np.ndarray) -> Tuple[Held, float]:
        """Write ``array`` into a new file and map the file under it; the record and the seconds taken.

        Raises ``OSError`` when shared memory has no room. The array's values
        are right whatever happens: a piece is remapped only once its bytes
        are in the file.
        """
        started = time.perf_counter()
        with self.lock:
            location = choose_location()
            if location not in self.folders:
                # memfds, or else named files, which only ever go to /dev/shm (see unfit_reason).
                self.folders[location] = TempFolder(location=location) if location.in_memory else TempFolder(SHM_ROOT)
            pair = self.folders[location].pair
        address, nbytes = data_address(array), array.nbytes
        head = address % PAGE
        first_page = -(-address // PAGE) * PAGE
        end_page = (address + nbytes) // PAGE * PAGE
        # Room is reserved piece by piece, just before each piece is written:
        # reserving it all first would allocate the whole file while the
        # array's own pages still exist, holding the data twice at the peak.
        pieces = [(address, first_page - address, False)]
        for start in range(first_page, end_page, CHUNK_BYTES):
            pieces.append((start, min(CHUNK_BYTES, end_page - start), True))
        pieces.append((end_page, address + nbytes - end_page, False))
        path, fd = pair.create_file(0, HELD, warn=False)
        try:
            free = None if pair.in_memory else free_bytes(pair.primary)
            if pair.is_fallback(path) or (free is not None and free < head + nbytes):
                raise OSError(errno.ENOSPC, "no room in shared memory for its file")
            for start, length, remap in pieces:
                if not length:
                    continue
                offset = head + start - address
                reserve(fd, offset, length)
                if remap:
                    _held_memory.copy_then_remap(fd, offset, start, length)
                else:
                    _held_memory.write_range(fd, offset, start, length)
        except BaseException:
            # Pieces remapped already hold the right bytes privately; the
            # file's name goes, its memory stays while they map it.
            os.close(fd)
            delete_file(path)
            raise
        try:
            ref = ArrayRef.in_file(
                path,
                os.fstat(fd),
                kind=HELD,
                mode="r",
                offset=head,
                shape=tuple(array.shape),
                strides=tuple(array.strides),
                dtype=array.dtype,
            )
        finally:
            os.close(fd)  # the file lives on: a memfd is held by _memfd, a named file by its name
        held = Held(ref, address, nbytes, first_page, end_page, _forks.count)
        with self.lock:
            self.held.add(array, held, Held.close)
        return held, time.perf_counter() - started


class _ForkCount:
    """How many times this process has forked: a rewrite in place after a fork would reach the child."""

    def __init__(self) -> None:
        self.count = 0

    def before_fork(self) -> None:
        self.count += 1


# Per process, see _Registry; the fork count is the parent's own history.
_registry = _Registry()
_forks = _ForkCount()


def _reset_after_fork() -> None:
    """In a forked child: forget the parent's arrays held once (the child's memfd copies are closed by _memfd)."""
    global _registry
    _registry = _Registry()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_forks.before_fork, after_in_child=_reset_after_fork)


def lookup(array: np.ndarray) -> Optional[Held]:
    """The record of ``array`` if it is held once, else None."""
    return _registry.lookup(array)


def promote(array: np.ndarray) -> Tuple[Held, float]:
    """Hold ``array`` once (see :meth:`_Registry.promote`)."""
    return _registry.promote(array)


def forget(array: np.ndarray) -> None:
    """Stop holding ``array`` once; its file goes."""
    _registry.forget(array)
