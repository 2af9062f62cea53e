"""References to array memory that lives in a file: what travels between processes instead of the bytes.

An :class:`ArrayRef` is what travels between processes instead of an array's
bytes: the file, its identity (device and inode, so that a recycled path is
never mistaken for the original), and the array's geometry in it. It can
describe any strided view, including transposes, negative strides and
offsets that are not page-aligned, so a worker rebuilds exactly the parent's
array: same values, shape, strides, dtype and order.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .._lifetime import _memfd
from .._lifetime._owners import parse_folder_name
from .._numpy import np

#: What the file behind a reference is, which decides its lifetime and how
#: results that view it come back (see ``_result_policy`` and ``_adopt``).
DUMP = "dump"  # written by memshare for one pool or call; temporary
RESULT = "result"  # written by a worker for a result; the parent adopts it
SHARED = "shared"  # a memshare.empty()/share() array owned by the user's process
HELD = "held"  # an ordinary array of the parent held once: the file is its memory (``_held_once``)
USER = "user"  # any other file mapping the user made (np.memmap, mmap.mmap)
_KINDS = (DUMP, RESULT, SHARED, HELD)  # memshare's own files


@dataclass(frozen=True)
class ArrayRef:
    """Where an array's elements are in a file, and how to map them."""

    path: str
    device: int
    inode: int
    kind: str
    mode: str  # the mode workers map the file with: 'r', 'r+' or 'c'
    offset: int  # file offset of the element at index (0, ..., 0)
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    dtype: Any  # a numpy dtype (see _numpy for why not np.dtype)
    # What the rebuilt np.memmap reports as ``.offset`` and ``.mode``. numpy
    # gives every slice of a memmap the offset and mode the memmap was opened
    # with; for a view of the user's own memmap the rebuilt array must report
    # the same. None for memshare's own files (offset 0, the mapping's mode).
    memmap_offset: Optional[int] = None
    memmap_mode: Optional[str] = None

    @functools.cached_property
    def nbytes(self) -> int:
        # Cached (in the instance's __dict__, which a frozen dataclass allows): a session sums
        # it over every dump it holds, thousands of times in a call over thousands of arrays.
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def in_file(cls, path: str, info: os.stat_result, **geometry: Any) -> ArrayRef:
        """A reference into the file at ``path`` whose stat result is ``info``; ``geometry`` gives the other fields."""
        device, inode = file_identity(info)
        return cls(path=path, device=device, inode=inode, **geometry)

    def is_file(self, info: os.stat_result) -> bool:
        """True when ``info`` (a stat result) is this reference's file, not another one now at its path."""
        return file_identity(info) == (self.device, self.inode)

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        # The fields in order: smaller and quicker than the default's dict of state, for a
        # reference every task that names a shared array or a broadcast carries.
        return ArrayRef, (
            self.path,
            self.device,
            self.inode,
            self.kind,
            self.mode,
            self.offset,
            self.shape,
            self.strides,
            self.dtype,
            self.memmap_offset,
            self.memmap_mode,
        )


def file_identity(info: os.stat_result) -> Tuple[int, int]:
    """(device, inode) of a stat result: what tells a file from a later one at the same path."""
    return info.st_dev, info.st_ino


def is_file(path: str, identity: Tuple[int, int]) -> bool:
    """True while ``path`` stats to the file of ``identity`` (device, inode): not deleted, not replaced."""
    try:
        return file_identity(os.stat(path)) == identity
    except OSError:
        return False


def data_address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def root_array(array: np.ndarray) -> np.ndarray:
    """The outermost ndarray in ``array``'s chain of bases."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def kind_of_path(path: str) -> str:
    """Classify a file by its name: memshare's own files carry their kind.

    A memfd's ``/proc/<pid>/fd/<n>`` path is classified by the name its link
    shows (``/memfd:memshare-<kind>-...``).
    """
    if _memfd.is_memfd_path(path):
        kind = _memfd.kind_of(path)
        return kind if kind in _KINDS else USER
    folder, name = os.path.split(path)
    owner_folder = os.path.basename(folder)
    if parse_folder_name(owner_folder) is None:
        return USER
    prefix = name.split("-", 1)[0]
    return prefix if prefix in _KINDS else USER
