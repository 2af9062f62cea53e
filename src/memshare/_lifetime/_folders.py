"""Safe shared files of a folder pair: private folders, exclusive files with their room reserved, one delete.

:class:`FolderPair` is plain, picklable data that every process creating
files for a folder holds (the owner, and its workers for results);
:meth:`FolderPair.create_file` and :func:`delete_file` are the one
create/delete pair for memfds and named files. Folders are 0700 and files
0600 whatever the umask; files are created with ``O_EXCL | O_NOFOLLOW``, so a
planted file or symlink is never followed or truncated; names carry random
parts. A file's room is reserved when it is created: a full file system fails
there, never later with SIGBUS.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Any, Callable, Container, Optional, Tuple

from .._config import ENV_TEMP_FOLDER, format_bytes
from .._errors import SharedMemoryFullError
from . import _memfd
from ._folder_warnings import warn_fallback
from ._location import free_bytes

logger = logging.getLogger("memshare")

_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


#: errno values meaning that a file system has no room (quotas and file size limits included).
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def unlink_quietly(path: str) -> None:
    """Delete the name ``path``; one already gone is no error (cleanups race)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def delete_file(path: str) -> None:
    """Delete a file that :meth:`FolderPair.create_file` made, whichever the mechanism.

    A memfd of this process is closed (its memory goes with the last
    mapping); a named file loses its name. A memfd of another process is
    left to that process. Deleting twice is no error.
    """
    if not _memfd.release(path):
        unlink_quietly(path)


class FolderTakenError(PermissionError):
    """The path of a memshare folder holds something that is not this user's directory."""


def ensure_private_dir(path: str) -> None:
    """Create ``path`` as a 0700 directory of ours, or check that it is one.

    Safe against races with other processes of the same owner (workers may
    create the folder of their parent's call for results) and refuses
    anything that is not a directory we own: a symlink planted at the path is
    never followed.
    """
    try:
        _make_dir(path)
    except FileNotFoundError:
        # The base folder does not exist yet: create it, then try once more.
        # Where it exists and mkdir still says ENOENT (/proc, say), retrying
        # would only recurse, so the second failure is reported.
        parent = os.path.dirname(path)
        try:
            created = not os.path.isdir(parent)
            os.makedirs(parent, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise _unusable_base(exc, parent) from None
        if created:  # a mistyped temp_folder would otherwise appear silently
            logger.info("memshare: created the temp folder %s (mode 0700): it did not exist", parent)
        try:
            _make_dir(path)
        except OSError as exc:
            raise _unusable_base(exc, parent) from None
    except OSError as exc:
        raise _unusable_base(exc, os.path.dirname(path)) from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise FolderTakenError(
            errno.EPERM,
            "refusing to use a temp folder that is not a directory owned by this user",
            path,
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        # mkdir applies the umask, which can only remove bits; chmod makes the
        # mode exact. Never loosen a folder that someone else prepared.
        os.chmod(path, 0o700)


def _make_dir(path: str) -> None:
    """``mkdir`` with mode 0700; a directory already there is fine (checked by the caller)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def _unusable_base(exc: OSError, base: str) -> OSError:
    """``exc`` (same type and errno) with a message naming the folder and the fix."""
    reason = exc.strerror or str(exc)
    return type(exc)(
        exc.errno,
        f"memshare cannot create its folder in {base!r}: {reason}. Pass temp_folder= (or set "
        f"{ENV_TEMP_FOLDER}) to a writable directory on a real file system, such as /dev/shm or /tmp",
        exc.filename,
    )


def open_for_writing(path: str) -> int:
    """A read-write descriptor of a file this process made with :meth:`FolderPair.create_file`.

    A memfd is duplicated from the descriptor that holds it (its ``/proc``
    path is a magic link, which ``O_NOFOLLOW`` refuses); a named file is
    opened with ``O_NOFOLLOW``, so a symlink planted at its path is refused.
    """
    if _memfd.is_memfd_path(path):
        return _memfd.duplicate(path)
    return os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))


@dataclass(frozen=True)
class FolderPair:
    """The paths of one folder and of its disk fallback: plain, picklable data.

    Both the owner and its workers (for results) create files through it.
    With ``in_memory``, files are memfds first (see ``_memfd``), and named
    files only where a memfd cannot be made.

    The fallback *twin* is a folder on disk, used file by file when shared
    memory has no room for one array. Its name has a random part of its own:
    the primary folder shows in world-readable ``/dev/shm`` as soon as it
    exists, and a twin named after it could be created first by another user.
    """

    primary: str
    fallback: Optional[str] = None
    in_memory: bool = False
    #: Twins used in turn when the fallback's path is taken by something not this user's, named in
    #: advance like it (in the same folder), so that every process writing for the pair agrees on
    #: them and the owner removes them all.
    spares: Tuple[str, ...] = ()

    def twins(self) -> Tuple[str, ...]:
        """The disk fallback folders, in the order they are tried: the twin, then its spares."""
        return (self.fallback, *self.spares) if self.fallback else ()

    def folders(self) -> Tuple[str, ...]:
        """Every folder files of this pair may be in: the primary, then the twins."""
        return (self.primary, *self.twins())

    def is_fallback(self, path: str) -> bool:
        """True when the file at ``path`` went to the disk fallback."""
        return os.path.dirname(path) in self.twins()

    def holds(self, path: str) -> bool:
        """True when ``path`` names a file directly in one of this pair's folders."""
        return os.path.dirname(path) in self.folders()

    def link_file(self, source: str, prefix: str) -> Optional[str]:
        """A new name for ``source`` in the primary folder (no copy); None if impossible.

        A hard link works only within one file system, and a memfd has no
        name to link; the caller copies then.
        """
        if _memfd.is_memfd_path(source):
            return None
        ensure_private_dir(self.primary)
        path = os.path.join(self.primary, f"{prefix}-{secrets.token_hex(8)}.bin")
        try:
            os.link(source, path, follow_symlinks=False)
        except OSError:
            return None
        return path

    def create_file(self, nbytes: int, prefix: str, warn: bool = True) -> Tuple[str, int]:
        """Create an exclusive 0600 file with ``nbytes`` reserved; return (path, fd).

        The space is reserved up front with ``posix_fallocate``: a tmpfs that
        fills up then fails here with ENOSPC, instead of killing a process
        with SIGBUS when a page is first touched. When the primary location
        has no room, the file goes to the fallback with a warning (unless
        ``warn`` is false: a worker leaves the warning to its parent); when
        neither has, :class:`SharedMemoryFullError` names the sizes.
        With ``in_memory``, a memfd is tried first; the path returned is then
        ``/proc/<pid>/fd/<n>``, and :func:`delete_file` closes it. A file made
        with ``nbytes`` > 0 keeps that size (its memfd is counted as settled,
        see ``_memfd.settle``); one made empty may grow (``reserve``).
        """
        attempts = [self.primary] + ([self.fallback] if self.fallback else [])
        if self.in_memory:
            try:
                created = _create_memfd(nbytes, prefix)
            except OSError as exc:
                if exc.errno not in _NO_DESCRIPTOR_ERRNOS:
                    raise
                # Out of descriptors, not of room (a memfd takes two while it is made, a
                # named file one): shared memory still comes first, and no warning speaks of room.
                created = None
            else:
                if created is None:
                    attempts = attempts[1:] if self.fallback else attempts  # shared memory is what memfds are
            if created is not None:
                return created
        for folder in attempts:
            if folder == self.primary:
                created = _create_reserved(folder, nbytes, prefix)
            else:
                created, folder = self._create_in_twin(nbytes, prefix)
            if created is not None:
                if folder != self.primary and warn:
                    warn_fallback(self.primary, folder, nbytes)
                return created
        free = ", ".join(f"{format_bytes(free_bytes(f))} free in {os.path.dirname(f)}" for f in attempts)
        raise SharedMemoryFullError(
            errno.ENOSPC,
            f"no room for a {format_bytes(nbytes)} array ({free}). Give shared memory more "
            f"room (docker run --shm-size=...), point {ENV_TEMP_FOLDER} at a larger folder, "
            "or raise max_nbytes / pass max_nbytes=None to pickle arrays instead",
        )

    def _create_in_twin(self, nbytes: int, prefix: str) -> Tuple[Optional[Tuple[str, int]], str]:
        """A file in the first twin whose path is free or ours, and that twin; (None, twin) when it has no room.

        A twin's path taken by another user's folder, a symlink or a file is
        passed over for the next (they share one file system, so a twin
        without room ends the search). With every name taken, the call fails
        saying so: only someone who learned names that memshare never shows
        before creating them could do that.
        """
        taken = []
        for twin in self.twins():
            try:
                return _create_reserved(twin, nbytes, prefix), twin
            except FolderTakenError:
                taken.append(twin)
                logger.warning("memshare: %s is taken by another user or file; using another disk folder", twin)
        raise FolderTakenError(
            errno.EPERM,
            f"memshare: every disk fallback folder of {self.primary} is taken by something not this user's "
            f"({', '.join(taken)}). Another user may be interfering: point {ENV_TEMP_FOLDER} (or TMPDIR) at a "
            "folder only you can write to",
        )


#: errno values of memfd_create or its reservation that leave named files to try, outside
#: shared memory: no room (RAM or the memory cgroup).
_MEMFD_FALLBACK_ERRNOS = NO_ROOM_ERRNOS + (errno.ENOMEM,)
#: errno values that say this process (or the system) has no descriptor left: named files
#: in shared memory are tried next.
_NO_DESCRIPTOR_ERRNOS = (errno.EMFILE, errno.ENFILE)


def _create_memfd(nbytes: int, prefix: str) -> Optional[Tuple[str, int]]:
    """A new memfd with ``nbytes`` reserved (see :meth:`FolderPair.create_file`); None to fall back."""
    try:
        path, fd = _memfd.create(prefix)
    except OSError as exc:
        if exc.errno in _MEMFD_FALLBACK_ERRNOS:
            return None
        raise
    made = _with_room(path, fd, nbytes, _memfd.release, _MEMFD_FALLBACK_ERRNOS)
    if made is not None and nbytes > 0:
        # Reserved whole, never resized: its blocks are counted once. A file made empty grows
        # piece by piece (arrays held once, results written in pieces): it is asked each time.
        _memfd.settle(path)
    return made


def _create_reserved(folder: str, nbytes: int, prefix: str) -> Optional[Tuple[str, int]]:
    """Create and reserve a file in ``folder``; None when it has no room."""
    ensure_private_dir(folder)
    path = os.path.join(folder, f"{prefix}-{secrets.token_hex(8)}.bin")
    fd = os.open(path, _FILE_FLAGS, 0o600)
    return _with_room(path, fd, nbytes, os.unlink, NO_ROOM_ERRNOS)


def _with_room(
    path: str, fd: int, nbytes: int, discard: Callable[[str], Any], no_room: Container[int]
) -> Optional[Tuple[str, int]]:
    """The new file ``(path, fd)``, 0600 with ``nbytes`` reserved; None when an errno in ``no_room`` says it cannot be.

    Any failure closes ``fd`` and discards the file (``discard(path)``:
    unlink a named file, release a memfd) before it propagates.
    """
    try:
        os.fchmod(fd, 0o600)
        if nbytes > 0:
            reserve(fd, 0, nbytes)
    except BaseException as exc:
        os.close(fd)
        discard(path)
        if isinstance(exc, OSError) and exc.errno in no_room:
            return None
        raise
    return path, fd


def reserve(fd: int, offset: int, nbytes: int) -> None:
    """Allocate bytes ``[offset, offset + nbytes)`` of ``fd`` now, so that writing them cannot run out of room.

    Raises an OSError with an errno of :data:`NO_ROOM_ERRNOS` when there is no room.
    """
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, offset, nbytes)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", -1)):
                raise
    # No fallocate on this system or file system: check the free space instead
    # (racy, but write() then fails with ENOSPC rather than SIGBUS anyway).
    info = os.fstatvfs(fd)
    if info.f_bavail * info.f_frsize < nbytes:
        raise OSError(errno.ENOSPC, "no space left")
    if os.fstat(fd).st_size < offset + nbytes:
        os.ftruncate(fd, offset + nbytes)
