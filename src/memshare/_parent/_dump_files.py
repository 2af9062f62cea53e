"""A session's dump files by path: who reads each, and how long one that no task reads stays for reuse.

Each file has a :class:`~memshare._lifetime._file_lifetime.FileLifetime`:
its readers are the pending tasks that name it, and it stops being current
when its owner (an array, a buffer, an object) is collected, changes or is
forgotten. On top of that count, a current file no task reads follows one of
two rules, chosen by its kind, once its only task is done:

* ``IDLE`` (an array's dump): kept, and deleted oldest first when a new dump
  would make idle files outweigh the files pending tasks read;
* ``RECENT`` (a buffer's or an object's dump): kept while the last few tasks
  that released such dumps are the latest, for a later task of the same call.

A file used by two or more tasks stays while it is current. Not thread-safe
on its own: the session calls every method with its lock held.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, KeysView, List, Optional, Set

from .._lifetime._file_lifetime import FileLifetime
from .._numpy import np
from .._transport._refs import ArrayRef

#: Where a current file used by one task so far waits once that task is done.
IDLE, RECENT = "idle", "recent"

# Of how many finished tasks the recent (single-use buffer and object) dumps are kept for a later task.
_RECENT_SINGLE_USE = 2


@dataclass
class Uses:
    """How many tasks have named something dumped (an array, a buffer, an object) so far."""

    count: int = 0


@dataclass(eq=False)
class DumpFile:
    """One dump file: its reference, its lifetime, and the uses of what it holds."""

    ref: ArrayRef
    uses: Uses
    single_use: str  # IDLE or RECENT
    on_gone: Callable[[DumpFile], None]  # its owner's bookkeeping once the file is deleted
    lifetime: FileLifetime = field(init=False, repr=False)
    parent_view: Optional[np.ndarray] = field(default=None, repr=False)  # the parent's mapping, for comparisons


class DumpFiles:
    """The dump files of one session, by path, deleted through their lifetimes."""

    def __init__(self, let_go: Callable[[str], None]) -> None:
        """``let_go(path)`` deletes a file (or releases one kept elsewhere); it must not raise."""
        self._let_go = let_go
        self._by_path: Dict[str, DumpFile] = {}  # every file not yet deleted, current or retired
        self._idle: OrderedDict[str, DumpFile] = OrderedDict()
        # Recent single-use files: the paths still kept, and the paths kept per finished task, newest
        # last (a path used again or deleted since is in the second but no longer in the first).
        self._recent: Set[str] = set()
        self._recent_tasks: Deque[List[str]] = deque()

    @property
    def paths(self) -> KeysView[str]:
        """The paths of the files not yet deleted (a live, read-only view)."""
        return self._by_path.keys()

    def get(self, path: str) -> Optional[DumpFile]:
        return self._by_path.get(path)

    def add(self, ref: ArrayRef, uses: Uses, single_use: str, on_gone: Callable[[DumpFile], None]) -> DumpFile:
        """A file just written; current, read by no task yet."""
        file = DumpFile(ref, uses, single_use, on_gone)
        file.lifetime = FileLifetime(ref.path, lambda: self._gone(file))
        self._by_path[ref.path] = file
        return file

    def use(self, file: DumpFile, files: List[str]) -> None:
        """One more task reads ``file``; its path is noted in ``files`` (the task's record)."""
        self._idle.pop(file.ref.path, None)
        self._recent.discard(file.ref.path)
        file.uses.count += 1
        file.lifetime.acquire()
        files.append(file.ref.path)

    def release(self, files: List[str]) -> None:
        """A task that read ``files`` is done: each file no pending task reads goes, stays, or waits by its rule."""
        recent: List[str] = []
        for path in files:
            file = self._by_path.get(path)
            if file is None or file.lifetime.release() or file.lifetime.readers > 0:
                continue  # deleted already, deleted now (no longer current), or still read
            if file.uses.count >= 2:
                continue  # shared: stays while current
            if file.single_use == IDLE:
                self._idle[path] = file
            else:
                recent.append(path)
        if recent:
            self._keep_recent(recent)

    def _keep_recent(self, paths: List[str]) -> None:
        self._recent.update(paths)
        self._recent_tasks.append(paths)
        while len(self._recent_tasks) > _RECENT_SINGLE_USE:
            for oldest in self._recent_tasks.popleft():
                if oldest in self._recent:  # else used again or deleted since
                    self._recent.discard(oldest)
                    self._by_path[oldest].lifetime.retire()

    def retire(self, file: DumpFile) -> None:
        """``file`` is no longer current: it goes now if no task reads it, else with its last reader."""
        self._idle.pop(file.ref.path, None)
        self._recent.discard(file.ref.path)
        file.lifetime.retire()

    def make_room(self) -> None:
        """Before a new dump: delete idle files, oldest first, until they weigh at most what pending tasks read."""
        limit = sum(f.ref.nbytes for f in self._by_path.values() if f.lifetime.readers > 0)
        idle_bytes = sum(f.ref.nbytes for f in self._idle.values())
        while self._idle and idle_bytes > limit:
            _, file = self._idle.popitem(last=False)
            idle_bytes -= file.ref.nbytes
            file.lifetime.retire()

    def _gone(self, file: DumpFile) -> None:
        """``file``'s lifetime ended: forget it, let its owner know, then delete it."""
        path = file.ref.path
        self._by_path.pop(path, None)
        self._idle.pop(path, None)
        self._recent.discard(path)
        file.parent_view = None
        on_gone, file.on_gone = file.on_gone, _gone_already  # the owner and its file name each other: not after
        on_gone(file)
        self._let_go(path)

    def close(self) -> None:
        """Delete every file, read or not (the session is closing; its tasks are done or abandoned)."""
        for file in list(self._by_path.values()):
            file.lifetime.end()
        self._recent_tasks.clear()


def _gone_already(file: DumpFile) -> None:
    pass


__all__ = ["IDLE", "RECENT", "DumpFile", "DumpFiles", "Uses"]
