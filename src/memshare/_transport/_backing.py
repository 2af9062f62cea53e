"""Which file an array's memory lives in: numpy's memmaps, the user's raw mappings, memshare's own mappings.

:func:`find_backing` walks an array's chain of bases to the mapping under it
and returns an ``ArrayRef`` to that file, or None for memory of the
process's own. Mappings memshare made itself are known from their open
descriptor (:func:`note_mapped_file`); others are found through
``/proc/self/maps``.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .._lifetime import _memfd, _procfs
from .._numpy import np
from ._identity import IdentityTable
from ._refs import USER, ArrayRef, data_address, file_identity, is_file, kind_of_path, root_array


def _nearest_memmap(array: np.ndarray) -> Optional[np.memmap]:
    """The first ``np.memmap`` over a file in ``array``'s chain of bases, itself first."""
    while isinstance(array, np.ndarray):
        if isinstance(array, np.memmap) and getattr(array, "filename", None):
            return array
        array = array.base
    return None


def _outermost_memmap(array: np.ndarray) -> Optional[np.memmap]:
    """The last ``np.memmap`` over a file in ``array``'s chain of bases: the one that maps the file.

    numpy's own memmap is the root of its chain (its base is the ``mmap``);
    memshare maps a reference as a memmap over a plain array over a mapping
    that keeps no descriptor (``_mapping.map_file``), one level further in.
    Either way its ``offset`` is the file offset of its first byte.
    """
    found = None
    while isinstance(array, np.ndarray):
        if isinstance(array, np.memmap) and getattr(array, "filename", None):
            found = array
        array = array.base
    return found


def _maps_file(owner: Any) -> bool:
    """True when ``owner``, the base of an array chain's root, is a mapping of a file.

    An ``mmap.mmap``, or the owner of a mapping memshare made without a
    descriptor, which says so with a ``maps_file`` class attribute.
    """
    return isinstance(owner, mmap.mmap) or getattr(type(owner), "maps_file", False) is True


def is_copy_on_write(array: np.ndarray) -> bool:
    """True when ``array``'s memory is a copy-on-write ``np.memmap`` (``mode="c"``)."""
    top = _outermost_memmap(array)
    return top is not None and top.mode in ("c", "copyonwrite")


def is_raw_mapping(array: np.ndarray) -> bool:
    """True when ``array``'s memory is a file mapping with no ``np.memmap`` in its chain of bases.

    An ``mmap.mmap`` the user made (or ``multiprocessing.shared_memory``):
    unlike a memmap, it has no mode of its own for workers to keep.
    """
    return _outermost_memmap(array) is None and _maps_file(_owner(root_array(array)))


def maps_privately(array: np.ndarray) -> bool:
    """True when ``array``'s memory is a private (copy-on-write) mapping of a file.

    A copy-on-write ``np.memmap``, or a raw mapping made with
    ``mmap.ACCESS_COPY`` or ``mmap.MAP_PRIVATE``, which ``/proc/self/maps``
    lists as private. Its written pages are private to this process and may
    differ from the file.
    """
    if _outermost_memmap(array) is not None:
        return is_copy_on_write(array)
    root = root_array(array)
    if not _maps_file(_owner(root)):
        return False
    located = _locate_mapping(*_byte_span(root))
    return located is not None and located[2]


@dataclass(frozen=True)
class MappedFile:
    """The file a mapping that memshare made maps: known when it was made, from its open descriptor."""

    path: str
    device: int
    inode: int
    kind: str


# Per process: mappings are. The records stay valid in a forked child (its inherited mappings
# map the same files); what a path names now is checked on each use (_names_file), never assumed.
_mapped_files: IdentityTable[MappedFile] = IdentityTable()
# The references find_backing made to such files, per array object, with the geometry they were
# made for (a broadcast's data is sent by every task that names it, call after call). Valid as long
# as the array lives: its data address and chain of bases never change, and its shape, strides,
# dtype and writeable flag, which can, are compared. Per process, as the records above.
_found: IdentityTable[Tuple[ArrayRef, MappedFile, Tuple[int, ...], Tuple[int, ...], np.dtype, bool]] = IdentityTable()


def note_mapped_file(mapping: np.memmap, file: MappedFile) -> None:
    """Remember that ``mapping``, a memmap over a whole mapping made from an open descriptor, maps ``file``.

    Lets :func:`find_backing` name the file of any view of ``mapping``
    without a ``stat`` or a ``readlink``: the record lives exactly as long as
    ``mapping`` (an identity table: the entry goes when it is collected).
    """
    _mapped_files.add(mapping, file)


def mapped_file(array: np.ndarray) -> Optional[MappedFile]:
    """The file that the mapping under ``array`` maps, when memshare made that mapping; else None.

    The file the memory is, whether or not its path still names it: a
    worker keys a broadcast's copy by it. :func:`find_backing` also checks the path.
    """
    top = _outermost_memmap(array)
    return None if top is None else _record_of(top)


def _record_of(top: np.memmap) -> Optional[MappedFile]:
    """The record of ``top``, the outermost memmap of a chain, unless its ``filename`` is no longer the record's."""
    known = _mapped_files.get(top)
    return known if known is not None and known.path == top.filename else None


def _names_file(known: MappedFile) -> bool:
    """True when ``known.path`` names ``known``'s file now: the reference is not stale.

    No system call for a memfd this process holds: its path names it until
    this process closes it (``_memfd.held_identity``). Otherwise one
    ``stat``: a deleted file, a memfd path whose number another file took,
    a user's file replaced under its mapping all fail it.
    """
    identity = (known.device, known.inode)
    if _memfd.held_identity(known.path) == identity:
        return True
    return is_file(known.path, identity)


def find_backing(array: np.ndarray, copy_on_write: bool = False) -> Optional[ArrayRef]:
    """A reference to the file that ``array``'s memory maps, if there is one.

    A copy-on-write mapping has none (its private pages may differ from the
    file) unless ``copy_on_write``: the caller checked that none is private.
    That is a ``mode="c"`` memmap, or a raw mapping that ``/proc/self/maps``
    lists as private (``mmap.ACCESS_COPY``, ``mmap.MAP_PRIVATE``).

    Covers ``np.memmap`` and its views at any depth (found through the
    public ``filename``/``offset`` of the memmap that owns the mapping) and,
    on Linux, arrays over a raw ``mmap.mmap`` of a file, directly or through a
    ``memoryview`` as ``multiprocessing.shared_memory`` gives (found through
    ``/proc/self/maps``). Returns None for ordinary memory. The mode of a
    raw mapping's reference is its own ('r+', 'r' or 'c'): the caller gives
    it the call's (``_routes.input_route``).

    A mapping memshare made (``_mapping.map_file``: shared arrays,
    broadcasts, a worker's inputs) has its file on record
    (:func:`note_mapped_file`): its identity and kind need no ``stat`` nor
    ``readlink``, and none at all when it is a memfd this process holds
    (a shared array's, a broadcast's). Only whether the path still names that
    file is checked (:func:`_names_file`); when it does not, the array has no
    backing: its memory is not what the path now holds.
    """
    found = _found.get(array)
    if found is not None:
        ref, known, shape, strides, dtype, writeable = found
        if (
            array.shape == shape
            and array.strides == strides
            and array.dtype is dtype
            and array.flags.writeable == writeable
        ):
            return ref if _names_file(known) else None
    root = root_array(array)
    if not _maps_file(_owner(root)):
        return None
    memmap_offset = memmap_mode = known = None
    top = _outermost_memmap(array)
    if top is not None:
        # The file offset of top's first byte, moved to root's: offsets below count from root.
        path, root_offset = top.filename, int(top.offset) - (data_address(top) - data_address(root))
        known = _record_of(top)
        if known is not None:
            if not _names_file(known):
                return None
        elif not _still_maps(root, path):
            return None
        mode = _mapping_mode(top.mode)
        nearest = _nearest_memmap(array)
        memmap_offset = int(nearest.offset)
        # 'w+' is reported as 'r+', as joblib does: reopening a file with
        # np.memmap(x.filename, mode=x.mode) must not zero it.
        memmap_mode = _mapping_mode(nearest.mode)
    else:
        located = _locate_mapping(*_byte_span(root))
        if located is None:
            return None
        path, root_offset, private = located
        mode = "c" if private else "r+" if root.flags.writeable else "r"
    if mode == "c" and not copy_on_write:
        # A copy-on-write mapping's private pages differ from the file: the
        # file is not the array's content, so it must travel by value.
        return None
    # A copy-on-write mapping's reference is not remembered: whether it has one depends on the caller's check.
    remember = known is not None and mode != "c"
    if not array.flags.writeable:
        mode = "r"
    if known is not None:
        device, inode, kind = known.device, known.inode, known.kind
    else:
        try:
            device, inode = file_identity(os.stat(path))
        except OSError:
            return None
        kind = kind_of_path(path)
    offset = root_offset + data_address(array) - data_address(root)
    ref = ArrayRef(
        path=path,
        device=device,
        inode=inode,
        kind=kind,
        mode=mode,
        offset=offset,
        shape=tuple(array.shape),
        strides=tuple(array.strides),
        dtype=array.dtype,
        memmap_offset=memmap_offset,
        memmap_mode=memmap_mode,
    )
    if remember:
        _found.add(array, (ref, known, ref.shape, ref.strides, ref.dtype, bool(array.flags.writeable)))
    return ref


def _still_maps(root: np.ndarray, path: Optional[str]) -> bool:
    """True when the file now at a memmap's ``path`` is the one its memory maps.

    A file replaced since it was mapped (``os.replace`` of a new version,
    say) leaves the memmap on the old file, which ``/proc/self/maps`` then
    lists as deleted or under another name: a reference to ``path`` would
    give workers the new file's bytes. Where ``/proc`` cannot tell (not
    Linux), the memmap's own path is trusted, as before.
    """
    if path is None:
        return False
    if kind_of_path(path) != USER or not sys.platform.startswith("linux") or not os.path.exists(_procfs.MAPS):
        return True  # memshare's own files (memfds among them) are never replaced under a mapping
    same = _maps_same_file(_owner(root), path)
    if same is not None:
        return same
    located = _locate_mapping(*_byte_span(root))
    return located is not None and located[0] == os.path.realpath(path)


def _maps_same_file(mapping: Any, path: str) -> Optional[bool]:
    """Whether the ``mmap.mmap`` ``mapping`` maps the file now at ``path``; None when it cannot tell.

    One ``stat`` of the mapping's ``/proc/self/map_files`` entry, which names
    the mapped inode even once it is replaced or deleted, against one of
    ``path``: a thousand times cheaper than reading ``/proc/self/maps``. The
    entry exists only while the kernel keeps the mapping as one region (not
    split by ``mprotect`` or merged with a neighbour): None sends the caller
    to the full scan.
    """
    if not isinstance(mapping, mmap.mmap) or len(mapping) == 0:
        return None
    try:
        start = data_address(np.frombuffer(mapping, dtype=np.uint8, count=1))
        end = start + -(-len(mapping) // mmap.PAGESIZE) * mmap.PAGESIZE
        mapped = os.stat(f"/proc/self/map_files/{start:x}-{end:x}")
        now = os.stat(path)
    except (OSError, ValueError, TypeError):
        return None
    return (mapped.st_dev, mapped.st_ino) == (now.st_dev, now.st_ino)


def _mapping_mode(memmap_mode: str) -> str:
    """The mode to map a file with for a memmap of ``memmap_mode``: 'r', 'r+' or 'c'."""
    return {"w+": "r+", "readwrite": "r+", "write": "r+", "readonly": "r", "copyonwrite": "c"}.get(
        memmap_mode, memmap_mode
    )


def _owner(root: np.ndarray) -> Any:
    """What owns the memory of ``root``, the outermost array of a chain (through a memoryview, its object)."""
    return root.base.obj if isinstance(root.base, memoryview) else root.base


def _byte_span(array: np.ndarray) -> Tuple[int, int]:
    """[first, end) addresses of the bytes ``array``'s elements occupy (any strides)."""
    low = high = data_address(array)
    if array.size == 0:
        return low, low + 1  # no bytes: where it points, as for a byte
    for count, stride in zip(array.shape, array.strides):
        reach = (count - 1) * stride
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high + array.itemsize


def _locate_mapping(start: int, end: int) -> Optional[Tuple[str, int, bool]]:
    """(path, file offset of ``start``, private) of the file mapping of this process that holds [start, end).

    The range may span several entries of ``/proc/self/maps`` (the kernel
    splits a mapping whose pages differ in protection or advice): each must
    map the same file at the next offset. Private when any entry is
    (``p`` in its permissions): its written pages are not the file's.
    None when the range is not wholly one file's mapping.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        mappings = _procfs.mappings()
    except OSError:
        return None
    found: Optional[Tuple[str, int, bool]] = None
    reached = start  # the first address not yet covered
    for low, high, permissions, file_offset, _, _, path in mappings:
        if path is None:
            continue
        if high <= reached:
            continue
        if low > reached:
            return None  # a hole, or the range starts outside any mapping
        path = path.strip()
        if not path.startswith(b"/") or path.endswith(b" (deleted)"):
            return None
        offset = file_offset + reached - low
        private = permissions.endswith(b"p")
        if found is None:
            found = (os.fsdecode(path), offset, private)
        elif os.fsdecode(path) != found[0] or offset != found[1] + reached - start:
            return None  # another file, or the same one at another offset
        else:
            found = (found[0], found[1], found[2] or private)
        reached = high
        if reached >= end:
            return found
    return None
