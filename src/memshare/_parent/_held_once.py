"""Arrays held once: a large ordinary array, once sent, keeps its data in its shared file.

The first time a session sends an eligible array (:func:`unfit_reason`), its
bytes go to a file of shared memory and the whole pages of its buffer become
a private (copy-on-write) mapping of that file at the same addresses
(*holding it once*): the array object does not change, and its memory is held
once, by the parent and by every worker that maps the file. The file goes to
workers read-only or copy-on-write only and is never written again: when a
later call finds the array changed, its pages move to a new file, and the old
one goes once no task reads it. ``_session_holds.SessionHolds`` is one session's side of
it: each array is looked at once per call.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from .. import _forksafe
from .._compat import made_by_default_allocator
from .._lifetime._file_lifetime import FileLifetime
from .._lifetime._folders import FolderPair, delete_file, reserve
from .._lifetime._location import SHM_ROOT, Location, choose_location, free_bytes
from .._lifetime._memfd import duplicate, held_count, is_memfd_path, within_budget
from .._lifetime._temp_folder import TempFolder
from .._numpy import np
from .._payload._routes import mode_unfit_reason
from .._payload._torch import is_storage_bytes
from .._transport import _pages
from .._transport._compare import same_bytes
from .._transport._dumping import CHUNK_BYTES, write_range
from .._transport._identity import IdentityTable
from .._transport._refs import HELD, ArrayRef, data_address
from . import _held_memory

PAGE = _held_memory.PAGE
#: Smallest array worth a file and two extra mappings of its own.
MIN_BYTES = 16 * PAGE
#: Mappings holding one array once may add (the file mapping splits the chunk's one or two).
_MAPPINGS_PER_ARRAY = 3


@dataclass
class HeldFile:
    """One file of an array held once: written once, then never changed.

    Never rewritten in place, because a process may map it privately
    without memshare knowing: a pending task, or a child forked by C code
    (its unwritten pages read the file). Its lifetime's readers are the
    pending tasks (any pool or call) that read it; it is deleted once it is
    no longer the array's current file and none reads it.
    """

    ref: ArrayRef
    lifetime: FileLifetime

    @classmethod
    def new(cls, ref: ArrayRef) -> HeldFile:
        """The record of a file this process just wrote: only this process deletes it (not a forked child)."""
        return cls(ref, FileLifetime(ref.path, functools.partial(_delete_if_owner, os.getpid(), ref.path)))


@dataclass
class Held:
    """One array held once: its current file, and which part of its memory maps that file.

    The mapping is private: a write by the parent copies the one page it
    touches, so the file, which workers read, does not change, and a
    forked child's writes stay in the child.
    """

    file: HeldFile  # the array as of its last move; older files live on while tasks read them
    address: int
    nbytes: int
    first_page: int  # [first_page, end_page) maps the file; the rest is ordinary memory
    end_page: int
    # Taken for a whole refresh: another session refreshing the same array waits, then finds it current.
    _lock: object = field(default_factory=_forksafe.lock, repr=False)

    @property
    def ref(self) -> ArrayRef:
        """The reference to the current file, read-only."""
        return self.file.ref

    def acquire(self) -> HeldFile:
        """One more pending task reads the current file; the file, to :meth:`release` when it is done."""
        with self._lock:
            self.file.lifetime.acquire()
            return self.file

    def release(self, file: HeldFile) -> None:
        """A task that read ``file`` is done: a file no longer current goes with its last reader."""
        with self._lock:
            file.lifetime.release()

    def reference(self, worker_mode: str, file: Optional[HeldFile] = None) -> ArrayRef:
        """The reference workers map ``file`` (default: the current one) with, in ``worker_mode``; never writable.

        Raises ``ValueError`` for a writable mode (see :func:`mode_unfit_reason`):
        the caller must dump the array instead.
        """
        reason = mode_unfit_reason(worker_mode)
        if reason is not None:
            raise ValueError(f"memshare: an array held once cannot be sent as it is: {reason}")
        return dataclasses.replace((file or self.file).ref, mode=worker_mode)

    def describes(self, array: np.ndarray) -> bool:
        """True while ``array``'s memory is still the range that was held once."""
        return data_address(array) == self.address and array.nbytes == self.nbytes

    def refresh(self, array: np.ndarray) -> Optional[int]:
        """Make the current file hold ``array``'s bytes; the bytes written (0: it did), or None when it cannot tell.

        ``/proc/self/pagemap`` tells which pages were written since the last
        move: a page present and no longer a file page (or swapped out) was
        copied by a write. That reads 8 bytes a page (2 MB for 1 GiB) instead
        of the array. The first and last pages, partly outside the array, are
        ordinary memory and compared byte by byte. When anything changed, the
        whole array moves to a new file (as when it was first held) and the
        old file goes once no task reads it: a task sees its arguments as
        they were when it was packed, however many earlier tasks still run.

        None means: the array's memory moved or shrank, or its pages' flags
        could not be read; the caller then dumps it. Raises ``OSError`` when
        the new file could not be written; the record is then unusable (part
        of the array maps the new file) and the caller must :func:`forget` it.
        """
        with self._lock:
            if not self.describes(array):
                return None
            try:
                changed = _pages.changed_pages(self.first_page, self.end_page)
                if changed.size == 0 and self._edges_match():
                    return 0
            except OSError:
                return None
            file = HeldFile.new(_registry.write_file(array, self.first_page, self.end_page))
            old, self.file = self.file, file
            old.lifetime.retire()
            return self.nbytes

    def _edges_match(self) -> bool:
        """True when the partial first and last pages still hold the current file's bytes."""
        edges = [
            (self.address, self.first_page - self.address),
            (self.end_page, self.address + self.nbytes - self.end_page),
        ]
        edges = [(start, length) for start, length in edges if length]
        if not edges:
            return True
        fd = _open_for_reading(self.file.ref)
        try:
            offset = self.file.ref.offset - self.address
            for start, length in edges:
                stored = np.frombuffer(os.pread(fd, length, offset + start), np.uint8)
                if not same_bytes(_held_memory.memory_at(start, length), stored):
                    return False
            return True
        finally:
            os.close(fd)

    def close(self) -> None:
        """The array is gone: its current file goes now, or with its last reader.

        NumPy's ``free()`` unmapped the whole malloc chunk, the file mapping
        with it, before this weak reference callback runs. A forked child
        inherits the callback too; only the process that held the array
        once frees its files.
        """
        with self._lock:
            self.file.lifetime.retire()


def _delete_if_owner(owner: int, path: str) -> None:
    """Delete a held file, in the process that wrote it only: a forked child inherits the records, not the files."""
    if os.getpid() == owner:
        delete_file(path)


def _open_for_reading(ref: ArrayRef) -> int:
    """A descriptor of a held file of this process, opened to compare bytes with it."""
    if is_memfd_path(ref.path):
        return duplicate(ref.path)
    fd = os.open(ref.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    if not ref.is_file(os.fstat(fd)):
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, f"memshare: {ref.path!r} was replaced")
    return fd


def unfit_reason(array: np.ndarray, worker_mode: str, temp_folder: Optional[str]) -> Optional[str]:
    """Why ``array`` cannot be held once, or None when it can.

    Held once: on Linux with glibc's malloc and the C helper built, an array
    that owns its data, made by NumPy's default allocator, in a malloc chunk
    that glibc served with a mapping of its own; C or Fortran contiguous, so
    that the file has the memory's exact layout; sent with workers mapping
    read-only or copy-on-write; only where memshare chooses the location (no
    ``temp_folder``) and the file fits in shared memory or the memfd budget.
    An array held by an earlier call is sent as it is whatever the call's
    ``temp_folder``: it needs no new file (see ``_session_holds.SessionHolds``).
    The byte array of a torch tensor's storage (``_torch.is_storage_bytes``)
    need not own its memory or come from NumPy: its memory must be a chunk of
    its own all the same, which an aligned allocation may be.
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
    storage = is_storage_bytes(array)
    if not storage and (isinstance(array, np.memmap) or array.base is not None or not array.flags.owndata):
        return "it does not own its memory"
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        return "it is not contiguous"
    if array.nbytes < MIN_BYTES:
        return "it is too small to be worth a file of its own"
    if not storage and not made_by_default_allocator(array):
        return "its memory does not come from NumPy's default allocator"
    not_own_mapping = _held_memory.mmapped_chunk(data_address(array), array.nbytes, aligned=storage)
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
            started = time.perf_counter()
            address, nbytes = data_address(array), array.nbytes
            first_page = -(-address // PAGE) * PAGE
            end_page = (address + nbytes) // PAGE * PAGE
            ref = self.write_file(array, first_page, end_page)
            held = Held(HeldFile.new(ref), address, nbytes, first_page, end_page)
            with self.lock:
                self.held.add(array, held, Held.close)
            return held, time.perf_counter() - started

    def write_file(self, array: np.ndarray, first_page: int, end_page: int) -> ArrayRef:
        """Write ``array`` into a new file and map the file over its whole pages ``[first_page, end_page)``.

        Raises ``OSError`` when shared memory has no room. The array's values
        are right whatever happens: a piece is remapped only once its bytes
        are in the file, piece by piece (``CHUNK_BYTES``), so the extra
        memory at any moment is one piece, and a thread writing into a piece
        meanwhile waits for the new mapping (``_remap``). The partial first
        and last pages stay ordinary memory: a write racing with their copy
        may or may not reach the file (as any write racing with a send), but
        never leaves the parent's memory.
        """
        pair = self._pair()
        address, nbytes = data_address(array), array.nbytes
        head = address % PAGE
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
                    write_range(fd, memoryview(_held_memory.memory_at(start, length)), offset)
            return ArrayRef.in_file(
                path,
                os.fstat(fd),
                kind=HELD,
                mode="r",
                offset=head,
                shape=tuple(array.shape),
                strides=tuple(array.strides),
                dtype=array.dtype,
            )
        except BaseException:
            # Pieces remapped already hold the right bytes privately; the
            # file's name goes, its memory stays while they map it.
            delete_file(path)
            raise
        finally:
            os.close(fd)  # the file lives on: a memfd is held by _memfd, a named file by its name

    def _pair(self) -> FolderPair:
        """The folder pair new held files go to: memfds, or else named files, which only ever go to /dev/shm."""
        with self.lock:
            location = choose_location()
            if location not in self.folders:
                self.folders[location] = TempFolder(location=location) if location.in_memory else TempFolder(SHM_ROOT)
            return self.folders[location].pair


# Per process, see _Registry.
_registry = _Registry()


def _reset_after_fork() -> None:
    """In a forked child: forget the parent's arrays held once (the child's memfd copies are closed by _memfd)."""
    global _registry
    _registry = _Registry()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def lookup(array: np.ndarray) -> Optional[Held]:
    """The record of ``array`` if it is held once, else None."""
    return _registry.lookup(array)


def hold(array: np.ndarray) -> Tuple[Held, float]:
    """Hold ``array`` once (see :meth:`_Registry.hold`)."""
    return _registry.hold(array)


def forget(array: np.ndarray) -> None:
    """Stop holding ``array`` once; its file goes."""
    _registry.forget(array)
