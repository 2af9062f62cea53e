"""Who still needs one shared file: the readers holding it, and whether it is still its owner's current file.

CPython's ``SharedMemory`` separates ``close()`` (this holder is done) from
``unlink()`` (the file goes). memshare's files are counted the same way: a
:class:`FileLifetime` goes (its ``delete`` runs, once) when it is no longer
current (its owner moved on to a newer file, or was collected) and no reader
(a pending task, a session using it for a call) holds it. Each kind of file
keeps its own rule for when it stops being current; the counting is this one.
"""

from __future__ import annotations

from typing import Callable, Optional


class FileLifetime:
    """The readers of one shared file and whether it is current; it goes once neither holds it.

    Not thread-safe on its own: its owner's lock guards it. ``delete`` must
    not raise (``_folders.delete_file`` does not).
    """

    __slots__ = ("path", "readers", "current", "deleted", "_delete")

    def __init__(self, path: str, delete: Callable[[], None], readers: int = 0) -> None:
        self.path = path
        self.readers = readers
        self.current = True
        self.deleted = False
        self._delete: Optional[Callable[[], None]] = delete

    def acquire(self) -> None:
        """One more reader holds the file."""
        self.readers += 1

    def release(self) -> bool:
        """A reader is done; True when that made the file go."""
        self.readers -= 1
        return self._settle()

    def retire(self) -> bool:
        """The file is no longer current: it goes now if nobody reads it, else with its last reader."""
        self.current = False
        return self._settle()

    def end(self) -> bool:
        """Its owner is closing: the file goes now, whoever still reads it; True unless it had gone already."""
        self.current, self.readers = False, 0
        return self._settle()

    def _settle(self) -> bool:
        if self.current or self.readers > 0 or self.deleted:
            return False
        self.deleted = True
        delete, self._delete = self._delete, None  # a delete that names its owner holds no cycle once run
        delete()
        return True

    def __repr__(self) -> str:
        state = "deleted" if self.deleted else "current" if self.current else "retired"
        return f"<FileLifetime {self.path!r} {state}, {self.readers} reader(s)>"


__all__ = ["FileLifetime"]
