"""A worker's large results: files made while the value is pickled, filled after.

Two steps, because the best moment to write an array is after the return
value has been pickled and dropped: memshare then often holds the only
reference to it, and its memory can be given back piece by piece as it is
written (``_release``), so the worker never holds the result twice.

Room is reserved a piece at a time, just before each piece is written, and
not for the whole file at once as for inputs: on tmpfs, reserving allocates
the pages, so a whole-file reservation would hold the result twice at the
start of the write whatever is released afterwards. A full file system still
fails at reservation (never with SIGBUS: the parent maps complete files).

If shared memory fills up midway, because another worker or process took
the room between two pieces, the result moves: a new file with the whole
size reserved (in shared memory if room appeared, else in the disk fallback
with the warning left to the parent), the pieces already written copied
into it, and the rest written from the array, which still holds them (a
piece is only released once written). When no location has room at all,
the result is sent by value instead, as joblib sends every result: a copy
in the worker's memory, made of the pieces already written (read back) and
the rest of the array. The returned reference (or copy) says where the
result ended up, which is what the outcome's slot table tells the parent.

A task keeps its arrays waiting in :class:`PendingResults` and every file it
made in :class:`MadeFiles`, which deletes them all if the outcome cannot be
sent.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Dict, List, MutableSequence, Optional, Tuple, Union

from .._errors import SharedMemoryFullError
from .._lifetime import _memfd
from .._lifetime._file_lifetime import FileLifetime
from .._lifetime._folders import NO_ROOM_ERRNOS, FolderPair, delete_file, open_for_writing, reserve
from .._numpy import np
from .._transport._dumping import file_order, file_reference, iter_pieces, write_range
from .._transport._refs import RESULT, ArrayRef, file_identity
from ._release import can_release, release_pages

_COPY_BYTES = 8 * 1024**2  # block size when copying a moved result's written part


def create_result_file(folder: FolderPair, array: np.ndarray) -> ArrayRef:
    """Create an empty file for ``array`` in ``folder`` and return its reference.

    The file is filled later by :func:`fill_result_file`; until then the
    caller is responsible for removing it.
    """
    path, fd = folder.create_file(0, RESULT)
    try:
        return file_reference(path, fd, RESULT, "r+", array.shape, array.dtype, file_order(array))
    finally:
        os.close(fd)


def fill_result_file(
    folder: FolderPair, ref: ArrayRef, array: np.ndarray, release: bool
) -> Union[ArrayRef, np.ndarray]:
    """Write ``array`` into the file of ``ref``; return where it ended up.

    With ``release``, each piece of the array's memory is freed once it is
    in the file, destroying the array: pass it only when
    ``_release.can_release`` allowed it. The result is ``ref`` itself unless
    the file had to move (see the module docstring); then the first file is
    gone, and on failure so is the second. When no file had room, the
    result is a copy of ``array`` to send by value, and the file is gone.
    The caller removes ``ref``'s file on failure.
    """
    fd = open_for_writing(ref.path)
    first = ref
    copy: Optional[np.ndarray] = None  # the result's bytes, once no file has room for them
    try:
        if not ref.is_file(os.fstat(fd)):
            raise FileNotFoundError(f"memshare: result file {ref.path!r} was replaced before it was written")
        written = 0
        for piece, address in iter_pieces(array, file_order(array)):
            if copy is not None:
                copy[written : written + len(piece)] = np.frombuffer(piece, np.uint8)
            else:
                try:
                    reserve(fd, written, len(piece))
                    write_range(fd, piece)
                except OSError as exc:
                    if exc.errno not in NO_ROOM_ERRNOS:
                        raise
                    try:
                        moved_fd, moved = _move(folder, fd, ref, written, array.nbytes)
                    except SharedMemoryFullError:
                        copy = _read_back(fd, written, array.nbytes)
                        copy[written : written + len(piece)] = np.frombuffer(piece, np.uint8)
                    else:
                        old_fd, old_path = fd, ref.path
                        fd, ref = moved_fd, moved
                        os.close(old_fd)
                        delete_file(old_path)
                        write_range(fd, piece)
            if release and address is not None:
                release_pages(address, len(piece))
            written += len(piece)
    except BaseException:
        if ref is not first:
            delete_file(ref.path)
        raise
    finally:
        os.close(fd)
    if copy is not None:
        delete_file(ref.path)  # no move succeeded: this is the first file, holding the copied pieces
        return np.ndarray(ref.shape, ref.dtype, buffer=copy, offset=0, strides=ref.strides)
    return ref


def _read_back(fd: int, written: int, nbytes: int) -> np.ndarray:
    """A new buffer of ``nbytes`` starting with the first ``written`` bytes of ``fd``."""
    copy = np.empty(nbytes, np.uint8)
    view = memoryview(copy)
    done = 0
    while done < written:
        count = os.preadv(fd, [view[done:written]], done)
        if count == 0:
            raise OSError(f"memshare: a result file is shorter than the {written} bytes written")
        done += count
    return copy


def _move(folder: FolderPair, fd: int, ref: ArrayRef, written: int, nbytes: int):
    """A new file of ``nbytes`` with room reserved, holding the first ``written`` bytes of ``fd``.

    Returns its descriptor, positioned after those bytes, and its reference.
    Raises :class:`SharedMemoryFullError` when no location has room.
    """
    path, new_fd = folder.create_file(nbytes, RESULT, warn=False)  # the parent warns
    try:
        copied = 0
        while copied < written:
            block = os.pread(fd, min(_COPY_BYTES, written - copied), copied)
            if not block:
                raise OSError(f"memshare: result file {ref.path!r} is shorter than the {written} bytes written")
            write_range(new_fd, memoryview(block))
            copied += len(block)
        device, inode = file_identity(os.fstat(new_fd))
    except BaseException:
        os.close(new_fd)
        delete_file(path)
        raise
    return new_fd, dataclasses.replace(ref, path=path, device=device, inode=inode)


class MadeFiles:
    """The files one task made for its results, each deleted if its outcome cannot be sent.

    Each has a :class:`FileLifetime`, current until the outcome is sent:
    then the parent owns the files (it adopts them), and nothing here
    deletes them. No reader is counted: the task's one thread writes them.
    """

    def __init__(self) -> None:
        self._files: Dict[str, FileLifetime] = {}

    def add(self, path: str) -> None:
        self._files[path] = FileLifetime(path, functools.partial(delete_file, path))

    def __contains__(self, path: str) -> bool:
        return path in self._files

    def delete(self, path: str) -> None:
        """Delete the file at ``path`` (one of these) and forget it."""
        self._files.pop(path).end()

    def delete_all(self) -> None:
        files, self._files = self._files, {}
        for lifetime in files.values():
            lifetime.end()


class PendingResults:
    """The large arrays of one return value, each with its empty result file, written once the value is dropped.

    ``folder`` is the task's folder pair; a file that must move (see the
    module docstring) stays a memfd if it was one, else a named file.
    """

    def __init__(self, folder: FolderPair, made: MadeFiles) -> None:
        self._folder = folder
        self._named = dataclasses.replace(folder, in_memory=False)
        self._made = made
        # (slot, reference, one-item list holding the array): the list is the only
        # reference memshare keeps, which _release.can_release relies on.
        self._pending: List[Tuple[int, ArrayRef, List[np.ndarray]]] = []

    def add(self, slot: int, ref: ArrayRef, array: np.ndarray) -> None:
        """Write ``array`` into the file of ``ref`` (made by :func:`create_result_file`) for ``slot``, later."""
        self._pending.append((slot, ref, [array]))

    def write(self, slots: MutableSequence[Union[None, ArrayRef, np.ndarray]]) -> None:
        """Write every array, in the order they were added, and put where each ended up in ``slots``.

        Call it once every other reference the worker held to the return
        value is gone. Each array is let go of as soon as it is written, so
        the next one is written with it already freed.
        """
        pending, self._pending = self._pending, []
        pending.reverse()  # pop() from the end, in the order they were added
        while pending:
            slot, ref, box = pending.pop()
            release = can_release(box)  # before box[0] is read again: that read is one more reference
            folder = self._folder if _memfd.is_memfd_path(ref.path) else self._named
            final = fill_result_file(folder, ref, box[0], release)
            box.clear()
            if isinstance(final, ArrayRef) and final.path != ref.path:
                self._made.add(final.path)  # it moved to a new file
            slots[slot] = final

    def clear(self) -> None:
        self._pending.clear()


__all__ = ["MadeFiles", "PendingResults", "create_result_file", "fill_result_file"]
