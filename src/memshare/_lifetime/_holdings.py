"""What shared memory this process holds: its memfds, its folders' files, and files only its mappings keep.

Shared memory is charged to whoever first touched its pages, and tools that
look at one process count it only once that process touches it: a result
adopted but not read yet adds nothing to the parent's RSS or PSS, yet it
fills ``/dev/shm`` (or memfds) and counts against a container's memory
limit. :func:`held` totals what memshare holds for this process from what
the process already knows, with no scan of ``/proc``: the memfds of its
registry (one ``fstat`` each, or none for a file reserved whole), the files in its folders, and the files that
are already deleted and live on only through one of its mappings (adopted
results, results that view a dump), which :func:`note_mapping` records when
they are mapped. A file found twice (a dump still held and also mapped by a
result) counts once, by its (device, inode). Sizes are allocated blocks, as
``du`` and the kernel's shmem figures count them. Files in a disk fallback
twin (``-disk``) are on disk, not in memory: they are left out.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
import weakref
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

from .. import _forksafe
from . import _memfd
from ._owners import TWIN_SUFFIX
from ._temp_folder import live_folders

#: A file's identity: (device, inode).
Identity = Tuple[int, int]


class _Mapped:
    """Files kept alive by a mapping of this process: token -> (identity, bytes).

    Per process because mappings are. A forked child maps the same pages
    but holds nothing of memshare's (its registries are emptied too): it
    forgets them; the finalizers it inherited find no token then.
    """

    def __init__(self) -> None:
        self.lock = _forksafe.lock()
        self.files: Dict[int, Tuple[Identity, int]] = {}
        self.tokens = itertools.count()

    def after_fork_in_child(self) -> None:
        self.lock = _forksafe.lock()
        self.files = {}

    def forget(self, token: int) -> None:
        with self.lock:
            self.files.pop(token, None)


_mapped = _Mapped()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mapped.after_fork_in_child)


def note_mapping(owner: object, info: os.stat_result, path: str) -> None:
    """``owner`` (the object that unmaps when collected) maps the file ``info`` describes, found at ``path``.

    Counted until ``owner`` is collected, whether or not the file still has
    a name or a holder: for a result, it has none once adopted. A file in a
    disk fallback twin is not counted.
    """
    if os.path.basename(os.path.dirname(path)).endswith(TWIN_SUFFIX):
        return
    with _mapped.lock:
        token = next(_mapped.tokens)
        _mapped.files[token] = ((info.st_dev, info.st_ino), info.st_blocks * 512)
    finalizer = weakref.finalize(owner, _mapped.forget, token)
    finalizer.atexit = False  # nothing to report at exit


@dataclass(frozen=True)
class Held:
    """The shared memory memshare holds for this process, in bytes, each file counted once."""

    memfds: int = 0  # in memfds this process holds open (dumps, held once, shared arrays, kept buffers)
    folders: int = 0  # in files of its folders (the same kinds as named files, and results not adopted yet)
    mapped: int = 0  # in deleted files only its mappings keep (results adopted, results viewing a dump)
    files: int = 0

    @property
    def total(self) -> int:
        return self.memfds + self.folders + self.mapped


def held() -> Held:
    """What memshare holds for this process now: a sum over its own records (no ``/proc`` scan)."""
    seen: Dict[Identity, None] = {}
    sums = {"memfds": 0, "folders": 0, "mapped": 0}

    def count(where: str, identity: Identity, nbytes: int) -> None:
        if identity not in seen:
            seen[identity] = None
            sums[where] += nbytes

    memfds = _memfd.held_memfds()  # the settled ones as one sum: distinct files, never in a folder
    for info in memfds.others:
        count("memfds", (info.st_dev, info.st_ino), info.st_blocks * 512)
    for info in _folder_files():
        count("folders", (info.st_dev, info.st_ino), info.st_blocks * 512)
    with _mapped.lock:
        mapped = list(_mapped.files.values())
    for identity, nbytes in mapped:
        if not _memfd.is_settled(identity):  # a result viewing a dump memfd still held
            count("mapped", identity, nbytes)
    return Held(
        sums["memfds"] + memfds.settled_bytes, sums["folders"], sums["mapped"], len(seen) + memfds.settled_count
    )


def held_bytes() -> int:
    """The total of :func:`held`."""
    return held().total


def _folder_files() -> Iterator[os.stat_result]:
    """The regular files in this process's folders in memory (its disk twins left out)."""
    for folder in live_folders():
        if not folder.endswith(TWIN_SUFFIX):
            yield from folder_files(folder)


def folder_files(folder: str) -> Iterator[os.stat_result]:
    """The regular files in the memshare folder ``folder`` (none when it is missing or unreadable)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return  # not made yet, or removed meanwhile
    for name in names:
        try:
            info = os.lstat(os.path.join(folder, name))
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            yield info


#: A line of ``/proc/<pid>/maps`` mapping a deleted memshare file: a memfd (its link always says deleted)
#: or a named file whose name is gone. Groups: start, end, offset, device (hex major:minor), inode.
_DELETED_MAPPING = re.compile(
    r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) ([0-9a-f]+):([0-9a-f]+) (\d+)\s+"
    r"(?:/memfd:memshare-[a-z]+-[0-9a-f]{16}|\S*/memshare-[^ ]*) \(deleted\)$"
)


def mapped_by(pid: int) -> Dict[Identity, int]:
    """The deleted memshare files process ``pid`` maps: identity -> bytes mapped (its furthest mapped end).

    For the doctor, about other processes too: read from ``/proc/<pid>/maps``
    (empty when it cannot be read). A memfd shows there as deleted whether
    or not some process still holds it open: the caller tells those apart.
    """
    found: Dict[Identity, int] = {}
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            lines: List[str] = maps.read().splitlines()
    except OSError:
        return found
    for line in lines:
        match = _DELETED_MAPPING.match(line)
        if match is None:
            continue
        start, end, offset, major, minor, inode = match.groups()
        identity = (os.makedev(int(major, 16), int(minor, 16)), int(inode))
        reach = int(offset, 16) + int(end, 16) - int(start, 16)
        found[identity] = max(found.get(identity, 0), reach)
    return found
