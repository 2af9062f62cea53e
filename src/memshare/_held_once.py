"""Arrays held once: a large ordinary array, once sent, keeps its data in its shared file.

The first time a session sends an eligible array (:func:`unfit_reason`), its
bytes go to a file of shared memory and the whole pages of its buffer become
a private (copy-on-write) mapping of that file at the same addresses
(*holding it once*): the array object does not change, and its memory is held
once, by the parent and by every worker that maps the file. The file goes to workers read-only
or copy-on-write only, is brought up to date in place (changed pages only)
once per call, and is deleted when the array is freed. :class:`SessionHolds`
is one session's side of it: each array is looked at once per call.
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
from ._folders import delete_file, reserve
from ._identity import IdentityTable
from ._location import SHM_ROOT, Location, choose_location, free_bytes
from ._memfd import duplicate, held_count, is_memfd_path, within_budget
from ._refs import HELD, ArrayRef, data_address
from ._stats import HELD_ONCE, NOT_HELD_ONCE, CallStats, log_decision
from ._temp_folder import TempFolder

PAGE = _held_memory.PAGE
#: Smallest array worth a file and two extra mappings of its own.
MIN_BYTES = 16 * PAGE
#: Mappings holding one array once may add (the file mapping splits the chunk's one or two).
_MAPPINGS_PER_ARRAY = 3
#: The only modes a held file is ever sent with: the worker's writes stay out of the file.
SAFE_MODES = ("r", "c")


@dataclass
class Held:
    """One array held once: its file, and which part of its memory maps the file.

    The mapping is private: a write by the parent copies the one page it
    touches, so the file, which workers read, does not change during a call,
    and a forked child's writes stay in the child.
    """

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
        """True while ``array``'s memory is still the range that was held once."""
        return data_address(array) == self.address and array.nbytes == self.nbytes

    def refresh(self, array: np.ndarray) -> Optional[int]:
        """Bring the file up to date with ``array``; the bytes rewritten, or None when it cannot be done in place.

        ``/proc/self/pagemap`` tells which pages were written since: a page
        present and no longer a file page (or swapped out) was copied by a
        write. That reads 8 bytes a page (2 MB for 1 GiB) instead of the
        array. Those pages are written to the file again and their private
        copies dropped in one step no Python code can interleave with
        (``_held_memory``); the first and last pages, partly outside the
        array, are ordinary memory and compared byte by byte.

        None means: the array's memory moved or shrank, or it changed while a
        task may still read the file, or after a fork (a child forked while
        the array was held reads the file for every page neither has written,
        so a rewrite would reach into it), or its pages' flags could not be
        read. The caller then dumps the array.
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

        NumPy's ``free()`` unmapped the whole malloc chunk, the file mapping
        with it, before this weak reference callback runs.

        A forked child inherits the array's weak reference callback too; only
        the process that held the array once frees its file.
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
    """Why ``array`` cannot be held once, or None when it can.

    Held once: on Linux with glibc's malloc and the C helper built, an array
    that owns its data, made by NumPy's default allocator, in a malloc chunk
    that glibc served with a mapping of its own; C or Fortran contiguous, so
    that the file has the memory's exact layout; sent with workers mapping
    read-only or copy-on-write; only where memshare chooses the location (no
    ``temp_folder``) and the file fits in shared memory or the memfd budget.
    An array held by an earlier call is sent as it is whatever the call's
    ``temp_folder``: it needs no new file (see :class:`SessionHolds`).
    """
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

    One per process because holding an array once changes the process's own memory: any
    pool or call of the process that sends the array again must find its
    file. Cleared (not released) in a forked child: the files are the
    parent's, and the child's private pages are its own.
    """

    def __init__(self) -> None:
        self.lock = _forksafe.lock()
        self.holding = _forksafe.lock()  # held while one array is made held once (see hold)
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

    def hold(self, array: np.ndarray) -> Tuple[Held, float]:
        """Hold ``array`` once, unless another thread just did; the record and the seconds taken.

        Promotions are serialised: two pools or calls in two threads sending
        the same new array must not both remap it (the first file would stay
        mapped by nobody's record and never be freed).
        """
        with self.holding:
            held = self.lookup(array)
            if held is not None:
                return held, 0.0
            return self._hold(array)

    def _hold(self, array: np.ndarray) -> Tuple[Held, float]:
        """Write ``array`` into a new file and map the file under it; the record and the seconds taken.

        Raises ``OSError`` when shared memory has no room. The array's values
        are right whatever happens: a piece is remapped only once its bytes
        are in the file, piece by piece (``CHUNK_BYTES``), so the extra
        memory at any moment is one piece. One race is left to the caller,
        as with any shared data: a NumPy operation that releases the GIL and
        writes the array from another thread while it is made held once or
        refreshed.
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


def hold(array: np.ndarray) -> Tuple[Held, float]:
    """Hold ``array`` once (see :meth:`_Registry.hold`)."""
    return _registry.hold(array)


def forget(array: np.ndarray) -> None:
    """Stop holding ``array`` once; its file goes."""
    _registry.forget(array)


class SessionHolds:
    """One session's arrays held once: each array is held or refreshed once per generation, not once per task.

    Remembers, per array, the generation in which its file was last brought
    up to date and the one in which it was last refused (the reason logged
    then, once per call). Not thread-safe on its own: the session calls it
    with its lock held.
    """

    def __init__(self, stats: CallStats) -> None:
        self._stats = stats
        self._refreshed: IdentityTable[int] = IdentityTable()
        self._refused: IdentityTable[int] = IdentityTable()

    def hold(self, array: np.ndarray, generation: int, worker_mode: str, temp_folder: Optional[str]) -> Optional[Held]:
        """The record of ``array``, held once and current for ``generation``, acquired for one task; None: dump it.

        An array is held once the first time, brought up to date once per
        generation after that, and refused (dumped) when it cannot be held
        once or brought up to date in place. One held by an earlier call is
        used whatever ``temp_folder``: it needs no new file, so nothing is
        written anywhere. ``worker_mode`` must be one of ``SAFE_MODES``.
        """
        if self._refused.get(array) == generation:
            return None
        held = lookup(array)
        if held is None:
            reason = unfit_reason(array, worker_mode, temp_folder)
            if reason is None:
                try:
                    held, seconds = hold(array)
                except OSError as exc:
                    reason = f"{exc.strerror or exc}"
            if held is None:
                self.refuse(array, generation, reason)
                return None
            self._stats.add(arrays_held_once=1, bytes_held_once=array.nbytes, dump_seconds=seconds)
            log_decision(HELD_ONCE, array, held.ref.path, seconds)
            self._refreshed.add(array, generation)
        elif self._refreshed.get(array) != generation:
            rewritten = held.refresh(array)
            if rewritten is None:
                if not held.describes(array):
                    forget(array)  # its memory moved (ndarray.resize): a plain array again
                self.refuse(
                    array,
                    generation,
                    "its file cannot be brought up to date in place "
                    "(a task still reads it, or a forked child still shares its pages)",
                )
                return None
            self._stats.add(bytes_refreshed=rewritten)
            self._refreshed.add(array, generation)
        held.acquire()
        return held

    def refuse(self, array: np.ndarray, generation: int, reason: str) -> None:
        """``array`` is dumped, not held once, in ``generation`` because of ``reason`` (logged once per generation)."""
        if self._refused.get(array) != generation:
            self._refused.add(array, generation)
            log_decision(NOT_HELD_ONCE, array, f"dumped instead: {reason}")

    def clear(self) -> None:
        self._refreshed.clear()
        self._refused.clear()
