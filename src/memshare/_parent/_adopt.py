"""The parent side of results: restoring an outcome, adopting its result files and memfds.

:func:`restore` unpickles an outcome with each slot loaded once: a result
file or memfd is adopted (mapped, its name deleted at once, so that its
memory lives exactly as long as the returned array), the user's own file or
the parent's own shared array is viewed, a view of a dump or a held file
the task was given is that file mapped copy-on-write, an array that came by
value is taken as it is. A named result file is adopted only from the session's own
folder pair, checked by the (device, inode) of the opened folder.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Callable, Dict, Optional, Set, Tuple

from .._errors import RemoteTraceback
from .._lifetime import _memfd
from .._lifetime._folders import FolderPair
from .._lifetime._holdings import note_mapping
from .._numpy import np
from .._payload._unpacking import unpack
from .._transport._handoff import Inbox
from .._transport._mapping import array_from_ref, map_descriptor
from .._transport._protocol import Outcome, Receive, Slot
from .._transport._refs import DUMP, HELD, RESULT, ArrayRef, file_identity, kind_of_path
from .._transport._shared_store import lookup_shared

#: In the parent: a new descriptor of the file of the parent's own that a result slot names (a dump or a
#: file held once that the task was given), checked by (device, inode); PermissionError for any other file.
OpenGiven = Callable[[ArrayRef], int]


def restore(
    outcome: Outcome,
    receive: Optional[Receive] = None,
    folder: Optional[FolderPair] = None,
    open_given: Optional[OpenGiven] = None,
) -> Tuple[bool, Any]:
    """In the parent: (True, value) or (False, exception with remote traceback).

    ``receive`` gives the descriptors of result memfds the worker passed
    (see ``_handoff``), by (device, inode); result files are adopted only
    from ``folder``, the session's folder pair (see :func:`adopt_result`).
    A slot naming a dump or a held file is mapped only through
    ``open_given`` (see :func:`map_given`).
    """

    # Two slots may name one result file (two views of one array of the worker): the file,
    # known by its (device, inode), is adopted once, its name deleted (or its one received
    # descriptor taken) then, and every slot that names it views that mapping.
    adopted: Dict[Tuple[int, int], np.ndarray] = {}

    def load_slot(where: Slot) -> np.ndarray:
        if isinstance(where, ArrayRef) and where.kind == RESULT:
            key = (where.device, where.inode)
            if key not in adopted:
                adopted[key] = adopt_mapping(where, receive, folder)
            return _view(adopted[key], where)
        if isinstance(where, ArrayRef) and where.kind in (DUMP, HELD):
            return map_given(where, open_given)
        return _load_slot(where, receive, folder)

    try:
        value = unpack(outcome.stream, outcome.slots, load_slot)
    except BaseException as exc:
        return False, exc
    if outcome.ok:
        return True, value
    exc = value.exception
    if exc.__cause__ is None:
        exc.__cause__ = RemoteTraceback(value.traceback)
    return False, exc


def restore_with_memfds(
    outcome: Outcome, inbox: Inbox, pair: FolderPair, open_given: Optional[OpenGiven] = None
) -> Tuple[bool, Any]:
    """Restore ``outcome``, taking the result memfds its worker passed; close any left unclaimed.

    :func:`restore` adopts each file once, however many slots name it (two
    views of a worker's shared array), so each memfd's one descriptor is
    taken once; the adoption maps and closes it.
    """
    claimed: Set[Tuple[int, int]] = set()

    def receive(identity: Tuple[int, int]) -> Optional[int]:
        fd = inbox.take(identity)
        if fd is not None:
            claimed.add(identity)
        return fd

    try:
        return restore(outcome, receive, folder=pair, open_given=open_given)
    finally:
        # One descriptor came per memfd this outcome names (others of the same memfd
        # belong to other outcomes): close those it did not claim.
        inbox.discard({(ref.device, ref.inode) for ref in outcome.result_files()} - claimed)


def _load_slot(where: Slot, receive: Optional[Receive], folder: Optional[FolderPair]) -> np.ndarray:
    """The array of a result slot."""
    if isinstance(where, np.ndarray):
        return where  # no file had room: it came by value
    if where.kind == RESULT:
        return adopt_result(where, receive, folder)
    return _rebuild_reference(where)


def map_given(ref: ArrayRef, open_given: Optional[OpenGiven]) -> np.ndarray:
    """A result that views a file of the parent's own the task was given: that file, mapped copy-on-write.

    No copy and no new file, and still an array of the parent's own, as a
    copy would be: its writes stay in its private pages, and the file is
    never written again (dumps and held files are written once; a changed
    array gets a new file), so a later write to the argument never shows in
    it. One mapping per slot: results that were distinct arrays in the
    worker stay independent. The file is opened only through ``open_given``,
    which finds it among the task's own files by (device, inode): a worker
    cannot make the parent map any other file.
    """
    if open_given is None:
        raise PermissionError(f"memshare: refusing to map {ref.path!r}: a result names a file it may not")
    fd = open_given(ref)
    try:
        info = os.fstat(fd)
        raw = map_descriptor(fd, info.st_size, "c")
    finally:
        os.close(fd)
    _note(raw, info, ref.path)  # it keeps the file alive once the dump or held file is let go of
    return _view(raw, ref)


def _rebuild_reference(ref: ArrayRef) -> np.ndarray:
    """A result that views the user's own file mapping, or the parent's own shared array."""
    shared = lookup_shared(ref)
    if shared is not None:
        return shared
    return array_from_ref(ref, cached=False)


def adopt_result(ref: ArrayRef, receive: Optional[Receive] = None, folder: Optional[FolderPair] = None) -> np.ndarray:
    """Map a worker's result file and delete its name at once.

    From then on the memory lives exactly as long as the returned array (the
    mapping is its base); nothing is left on disk whatever happens next. The
    array is a plain, writable ``np.ndarray``: the mapping is shared but no
    other process has the file any more. The mapping keeps no descriptor
    (:func:`~memshare._transport._mapping.map_descriptor`): a call may return any number
    of results under the process's descriptor limit.

    A memfd result comes as the descriptor the worker passed (``receive``),
    already checked against the reference's (device, inode); the worker
    closed its own. A named result file is adopted (mapped, then unlinked)
    only from ``folder``, the session's folder pair: an outcome naming a
    file anywhere else, another session's for one, raises
    ``PermissionError`` and leaves that file alone. ``folder`` None skips
    that check (for callers that made the outcome themselves).
    """
    return _view(adopt_mapping(ref, receive, folder), ref)


def adopt_mapping(ref: ArrayRef, receive: Optional[Receive] = None, folder: Optional[FolderPair] = None) -> np.ndarray:
    """The whole mapping of ``ref``'s result file, adopted as :func:`adopt_result` says (bytes, no view)."""
    if ref.kind != RESULT:
        raise PermissionError(f"memshare: {ref.path!r} is not a result file")
    if _memfd.is_memfd_path(ref.path):
        fd = receive((ref.device, ref.inode)) if receive is not None else None
        if fd is None:
            raise FileNotFoundError(f"memshare: the memory of a {ref.nbytes}-byte result never arrived from its worker")
        try:
            info = os.fstat(fd)
            raw = map_descriptor(fd, info.st_size, "r+")  # shared, read-write: the worker closed its own
        finally:
            os.close(fd)
        _note(raw, info, ref.path)
        return raw
    return _take_result_file(ref, folder)


def _note(raw: np.ndarray, info: os.stat_result, path: str) -> None:
    """Count the file ``raw`` maps among what this process holds (``last_call_stats``) while it is mapped."""
    if raw.base is not None:  # an empty file maps nothing
        note_mapping(raw.base, info, path)


def _view(raw: np.ndarray, ref: ArrayRef) -> np.ndarray:
    return np.ndarray(ref.shape, ref.dtype, buffer=raw, offset=ref.offset, strides=ref.strides)


def _take_result_file(ref: ArrayRef, folder: Optional[FolderPair]) -> np.ndarray:
    """Map the named result file of ``ref`` (checked to be in ``folder``) and delete its name.

    The directory is opened first and every later step goes through that
    descriptor (``dir_fd``): the directory checked is the one the file is
    opened and unlinked in, whatever happens to the path's components
    meanwhile. The file itself is opened with ``O_NOFOLLOW`` and must be the
    reference's (device, inode).
    """
    if kind_of_path(ref.path) != RESULT:
        raise PermissionError(f"memshare: refusing to adopt {ref.path!r}: not a memshare result file")
    directory, name = os.path.split(ref.path)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if folder is not None and not _is_session_folder(os.fstat(dir_fd), folder):
            raise PermissionError(
                f"memshare: refusing to adopt the result file {ref.path!r}: it is not in this call's folders "
                f"({', '.join(map(repr, folder.folders()))}), where its workers write their results. The outcome "
                "names another call's file (left alone): a worker sent a result it did not make"
            )
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or not ref.is_file(info):
                raise FileNotFoundError(f"memshare: {ref.path!r} was replaced since it was shared")
            raw = map_descriptor(fd, info.st_size, "r+")
        finally:
            os.close(fd)
        _note(raw, info, ref.path)
        # The mapping keeps the memory: the name can go now. Only this file's
        # name, should another file have taken it meanwhile.
        try:
            if ref.is_file(os.stat(name, dir_fd=dir_fd, follow_symlinks=False)):
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass  # removed already (the session closed its folder)
    finally:
        os.close(dir_fd)
    return raw


def _is_session_folder(directory: os.stat_result, folder: FolderPair) -> bool:
    """True when ``directory`` (a stat result) is one of ``folder``'s folders: the primary or a disk fallback.

    Compared by (device, inode), not by path: a path can name a folder
    through a symbolic link or ``..``, and another folder can have a name
    that starts like this one's. A folder of another user at one of the
    pair's names (planted there, and so passed over by the workers) is not
    the session's.
    """
    if directory.st_uid != os.geteuid():
        return False
    for path in folder.folders():
        try:
            if file_identity(os.stat(path)) == file_identity(directory):
                return True
        except OSError:
            continue  # not made yet: no result can be in it
    return False


__all__ = ["OpenGiven", "adopt_result", "map_given", "restore", "restore_with_memfds"]
