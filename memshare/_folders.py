"""Where shared files live: private folders, safe file creation, cleanup.

Lifetimes
---------
A :class:`TempFolder` belongs to one pool, or to one joblib call (or managed
``with Parallel()`` context). It is created lazily, on the first file, and
removed by :meth:`TempFolder.remove`, by a finalizer when the object is
garbage-collected, at interpreter exit, and, if the owner dies without any of
those, by the owner's watchdog process (see ``_watchdog``). Folders of owners
that died anyway (the watchdog was killed too, or the machine lost power
mid-cleanup) are swept the first time a later process creates a folder.

Each folder has a *fallback* twin on disk, used file by file when the shared
memory location has no room for one array. The twin's name has a random part
of its own: the primary folder shows in world-readable ``/dev/shm`` as soon
as it exists, and a twin named after it could be created first by another
user. Should a twin's name be taken anyway, the file goes to one of two
spare twins, named in advance like it, so that every process writing for the
folder agrees on them and the owner removes them all.

Folders of owners that died are swept only on file systems local to this
machine, unless asked (``python -m memshare clean --network-fs``): storage
that several machines share holds folders of other hosts, never judged dead
here anyway (see ``_owners``), and listing it at every start costs time.

Mechanism: on Linux, files are memfds by default (see ``_memfd``): nameless
memory held by a descriptor, which needs no room in ``/dev/shm`` and cannot
leak. :func:`choose_location` is the one place that decides, from the
probe of ``_memfd.decision`` and the user's settings: an explicit
``temp_folder`` or ``MEMSHARE_TEMP_FOLDER`` keeps named files there. A
:class:`FolderPair` carries the decision (``in_memory``) to every process
that creates files for it, and :meth:`FolderPair.create_file` and
:func:`delete_file` are the one create/delete pair for both mechanisms.
Folders are still made (lazily) for what falls back to named files.

Security: folders are 0700 and files 0600 whatever the umask; files are
created with ``O_EXCL | O_NOFOLLOW`` so a planted file or symlink is never
followed or truncated; names carry random parts.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

from . import _forksafe, _memfd
from ._config import ENV_TEMP_FOLDER, disk_folder_message, folder_from_environment, format_bytes, resolve_folder
from ._errors import SharedMemoryFallbackWarning, SharedMemoryFullError
from ._owners import FOLDER_PREFIX, OWNER_DEAD, Owner, new_folder_name, new_twin_name, parse_folder_name
from ._watchdog import WatchdogClient, remove_loky_semaphores

logger = logging.getLogger("memshare")

SHM_ROOT = "/dev/shm"
#: Spare twins per folder, used in turn when a twin's name is taken (see the module docstring).
SPARE_TWINS = 2
_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


#: errno values meaning that a file system has no room (quotas and file size limits included).
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def default_base(explicit: Optional[str] = None) -> Tuple[str, str]:
    """The folder under which memshare folders go, and why it was chosen."""
    explicit = resolve_folder(explicit)
    if explicit is not None:
        return explicit, "the temp_folder argument"
    from_environment = folder_from_environment()
    if from_environment is not None:
        path, variable = from_environment
        return path, f"the {variable} environment variable"
    if os.path.isdir(SHM_ROOT) and os.access(SHM_ROOT, os.W_OK | os.X_OK):
        return SHM_ROOT, f"{SHM_ROOT} exists and is writable (RAM-backed)"
    return tempfile.gettempdir(), f"{SHM_ROOT} is not usable; using the system temp dir"


@dataclass(frozen=True)
class Location:
    """Where a folder's files go: the base folder of named files, whether memfds come first, and why."""

    base: str
    in_memory: bool
    reason: str
    chosen_by: Optional[str] = None  # the setting that chose the folder, when the user chose it


def choose_location(explicit: Optional[str] = None) -> Location:
    """The mechanism and place for new files: the one decision, logged once per process.

    memfds when the probe says they work and no folder was set explicitly
    (``temp_folder=``, ``MEMSHARE_TEMP_FOLDER``, ``JOBLIB_TEMP_FOLDER``): a
    folder the user chose keeps named files there.
    """
    base, why = default_base(explicit)
    if resolve_folder(explicit) is not None or folder_from_environment() is not None:
        return Location(base, False, f"named files in {base}: {why} is set", chosen_by=why)
    probed = _memfd.decision()
    if probed.in_memory:
        return Location(base, True, f"memfds: {probed.reason}")
    return Location(base, False, f"named files in {base}: {probed.reason}")


def fallback_base(primary_base: str) -> Optional[str]:
    """The disk location used when ``primary_base`` is full, if it differs."""
    disk = tempfile.gettempdir()
    existing = os.path.abspath(primary_base)
    while not os.path.exists(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)  # the base may not be created yet
    try:
        if os.stat(disk).st_dev == os.stat(existing).st_dev:
            return None
    except OSError:
        return None
    return disk


def free_bytes(path: str) -> Optional[int]:
    """Bytes available to this user in the file system holding ``path``."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or "/")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


#: File system types (``/proc/self/mountinfo``) that other machines may share.
NETWORK_FSTYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "cifs",
        "smb3",
        "smbfs",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "afs",
        "9p",
        "virtiofs",
        "ocfs2",
        "gfs2",
        "orangefs",
        "pvfs2",
        "panfs",
        "wekafs",
        "davfs",
        "fuse",
    }
)
#: FUSE file systems known to be local; any other ``fuse.*`` type counts as shared (sshfs, s3fs, glusterfs...).
LOCAL_FUSE_FSTYPES = frozenset({"fuse.fuse-overlayfs", "fuse.lxcfs", "fuse.portal", "fuse.gvfsd-fuse"})
MOUNTINFO = "/proc/self/mountinfo"


def read_mountinfo() -> str:
    """This process's mount table, or an empty string where there is none (no ``/proc``)."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as table:
            return table.read()
    except OSError:
        return ""


def _unescape_mount_path(field: str) -> str:
    """A mount point as the kernel writes it: space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def mount_fstype(path: str, mountinfo: str) -> Optional[str]:
    """The type of the file system holding ``path`` in the mount table text ``mountinfo``; None if unknown.

    ``path`` is taken as it is (the caller resolves symlinks). The innermost
    mount point containing it counts, and of mounts at the same point the
    last one, which hides the others.
    """
    best: Optional[Tuple[int, str]] = None
    for line in mountinfo.splitlines():
        fields = line.split()
        # id parent major:minor root mount-point options [optional...] - fstype source super-options
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        if separator + 1 >= len(fields):
            continue
        point = _unescape_mount_path(fields[4])
        inside = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fields[separator + 1])
    return None if best is None else best[1]


def is_network_fstype(fstype: Optional[str]) -> bool:
    """True for a file system type that other machines may share (NFS, Lustre, CIFS, most FUSE ones...)."""
    if fstype is None:
        return False
    if fstype.startswith("fuse."):
        return fstype not in LOCAL_FUSE_FSTYPES
    return fstype in NETWORK_FSTYPES


def network_fstype(path: str, mountinfo: Optional[str] = None) -> Optional[str]:
    """The type of the network file system holding ``path``, or None when it is local (or unknown).

    Unknown (no mount table: not Linux) counts as local, as before folder
    names recorded a host; those names still protect another host's folders.
    """
    fstype = mount_fstype(os.path.realpath(path), read_mountinfo() if mountinfo is None else mountinfo)
    return fstype if is_network_fstype(fstype) else None


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
    """

    primary: str
    fallback: Optional[str] = None
    in_memory: bool = False
    #: Twins used in turn when the fallback's path is taken by something not
    #: this user's (see the module docstring); in the same folder as it.
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
        ``/proc/<pid>/fd/<n>``, and :func:`delete_file` closes it.
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
    try:
        if nbytes > 0:
            reserve(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        _memfd.release(path)
        if exc.errno in _MEMFD_FALLBACK_ERRNOS:
            return None
        raise
    except BaseException:
        os.close(fd)
        _memfd.release(path)
        raise
    return path, fd


def _create_reserved(folder: str, nbytes: int, prefix: str) -> Optional[Tuple[str, int]]:
    """Create and reserve a file in ``folder``; None when it has no room."""
    ensure_private_dir(folder)
    path = os.path.join(folder, f"{prefix}-{secrets.token_hex(8)}.bin")
    fd = os.open(path, _FILE_FLAGS, 0o600)
    try:
        os.fchmod(fd, 0o600)
        if nbytes > 0:
            reserve(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        if exc.errno in NO_ROOM_ERRNOS:
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


# (folder, what) pairs already warned about, so that a call warns once and not
# once per array. Process-wide because workers receive a new FolderPair per task.
_warned: set = set()
_warned_lock = _forksafe.lock()


def _forget_warnings(primary: str) -> None:
    """Drop what was warned about a folder that is gone, so that the set stays bounded."""
    with _warned_lock:
        _warned.difference_update({key for key in _warned if key[0] == primary})


def _first_warning(primary: str, what: str) -> bool:
    with _warned_lock:
        if (primary, what) in _warned:
            return False
        _warned.add((primary, what))
        return True


def warn_fallback(primary: str, used: str, nbytes: int, stacklevel: int = 3) -> None:
    """Warn, once per folder, that an array of ``nbytes`` went to ``used`` on disk."""
    if not _first_warning(primary, "disk"):
        return
    warnings.warn(
        f"memshare: shared memory at {os.path.dirname(primary)} has no room for a "
        f"{format_bytes(nbytes)} array ({format_bytes(free_bytes(primary))} free); it was "
        f"written to {os.path.dirname(used)} on disk instead, which is slower. Give shared "
        f"memory more room (docker run --shm-size=2g) or set {ENV_TEMP_FOLDER}.",
        SharedMemoryFallbackWarning,
        stacklevel=stacklevel,
    )


def warn_if_on_disk(location: Location, stacklevel: int = 3) -> None:
    """Warn once per process and folder when the user chose a temp folder on a disk (see ``disk_folder_message``)."""
    if location.in_memory or location.chosen_by is None:
        return
    message = disk_folder_message(
        location.base, mount_fstype(os.path.realpath(location.base), read_mountinfo()), location.chosen_by
    )
    if message is not None and _first_warning(location.base, "not RAM"):
        warnings.warn(message, SharedMemoryFallbackWarning, stacklevel=stacklevel)


def warn_result_pickled(pair: FolderPair, nbytes: int, stacklevel: int = 2) -> None:
    """Warn, once per folder, that a result of ``nbytes`` fitted in no file and was pickled."""
    if not _first_warning(pair.primary, "pickled"):
        return
    where = " nor ".join(os.path.dirname(f) for f in (pair.primary, pair.fallback) if f)
    warnings.warn(
        f"memshare: no room for a {format_bytes(nbytes)} result in {where}; it was pickled back to "
        "the parent instead, which is slower and holds it twice for a while. Give shared memory more room "
        f"(docker run --shm-size=2g), point {ENV_TEMP_FOLDER} at a larger folder, or return smaller arrays.",
        SharedMemoryFallbackWarning,
        stacklevel=stacklevel,
    )


class _ProcessState:
    """Process-wide cleanup bookkeeping.

    One per process because the things it tracks are per process: the
    watchdog pipe, the folders to remove at exit, and whether dead owners'
    folders were swept already. Reset in forked children, which own nothing.
    """

    def __init__(self) -> None:
        self.lock = _forksafe.lock()
        self.watchdog = WatchdogClient()
        self.live_paths: set = set()
        self.swept = False

    def after_fork_in_child(self) -> None:
        self.watchdog.forget_after_fork()
        self.lock = _forksafe.lock()
        self.live_paths = set()


_state = _ProcessState()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_state.after_fork_in_child)


def _remove_paths(paths: List[str]) -> None:
    for path in paths:
        if _is_own_dir(path):
            shutil.rmtree(path, ignore_errors=True)
        with _state.lock:
            _state.live_paths.discard(path)
        _state.watchdog.unregister(path)
        _forget_warnings(path)


@atexit.register
def _remove_all_at_exit() -> None:
    with _state.lock:
        paths = list(_state.live_paths)
    _remove_paths(paths)
    _state.watchdog.close()


def _is_own_dir(path: str) -> bool:
    """True when ``path`` is a directory of this user (not something another user planted at a twin's name)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


class TempFolder:
    """The owner's handle on one private folder pair.

    Nothing touches the disk until :attr:`pair` is first used to create a
    file; :meth:`remove` is idempotent and safe to call from any thread.
    """

    def __init__(self, base: Optional[str] = None, location: Optional[Location] = None) -> None:
        """``location`` (from :func:`choose_location`) wins over ``base`` (an explicit temp folder)."""
        location = location or choose_location(base)
        warn_if_on_disk(location)
        primary_base = location.base
        owner = Owner.current()
        fallback = fallback_base(primary_base)
        # Each twin has a random part of its own (see the module docstring).
        twins = [os.path.join(fallback, new_twin_name(owner)) for _ in range(1 + SPARE_TWINS)] if fallback else []
        self.location = location
        self.pair = FolderPair(
            os.path.join(primary_base, new_folder_name(owner)),
            twins[0] if twins else None,
            location.in_memory,
            tuple(twins[1:]),
        )
        paths = list(self.pair.folders())
        with _state.lock:
            sweep = not _state.swept
            _state.swept = True
            _state.live_paths.update(paths)
        if sweep:
            # Local file systems only (see the module docstring).
            sweep_dead_owners({primary_base, fallback or primary_base, SHM_ROOT, tempfile.gettempdir()})
        # Registered before any file exists: a worker may create the folder
        # (for a result) before the owner does, and it must still be cleaned.
        for path in paths:
            _state.watchdog.register(path)
        self._finalizer = weakref.finalize(self, _remove_own_paths, os.getpid(), paths)

    def remove(self) -> None:
        """Delete the folders and everything in them (in the process that made them; see below)."""
        self._finalizer()


def _remove_own_paths(owner: int, paths: List[str]) -> None:
    """A :class:`TempFolder`'s removal: only in the process that made it.

    A forked child inherits its parent's TempFolder objects; when it drops
    one (its copy of a registry reset after the fork, say) or closes an
    inherited session, the folder is still the parent's and in use. Old loky
    releases start every worker with fork() then exec(), so this runs in
    every such worker for a moment.
    """
    if os.getpid() == owner:
        _remove_paths(paths)


def list_folders(bases) -> List[Tuple[str, Owner]]:
    """memshare folders of this user under ``bases``, with their owners."""
    found = []
    for base in sorted({b for b in bases if b}):
        try:
            entries = os.listdir(base)
        except OSError:
            continue
        for entry in entries:
            if not entry.startswith(FOLDER_PREFIX):
                continue
            owner = parse_folder_name(entry)
            path = os.path.join(base, entry)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if owner is None or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                continue
            found.append((path, owner))
    return found


def folder_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class FoundFolder:
    """A memshare folder of this user, and what can be said of its owner from here."""

    path: str
    owner: Owner
    #: The owner's :meth:`Owner.status` (``_owners.OWNER_*``), judged knowing whether the folder is local.
    status: str
    #: The type of the network file system the folder is on; None when it is local.
    network_fs: Optional[str]


def find_folders(bases, mountinfo: Optional[str] = None) -> List[FoundFolder]:
    """memshare folders of this user under ``bases``, each with its owner's status and file system.

    ``mountinfo`` is the mount table's text (read from ``/proc`` when None,
    once, and only if there is a folder to judge).
    """
    network = {}
    found = []
    for path, owner in list_folders(bases):
        base = os.path.dirname(path)
        if base not in network:
            mountinfo = read_mountinfo() if mountinfo is None else mountinfo
            network[base] = network_fstype(base, mountinfo)
        fstype = network[base]
        found.append(FoundFolder(path, owner, owner.status(local=fstype is None), fstype))
    return found


def sweep_dead_owners(bases, dry_run: bool = False, network: bool = False) -> List[Tuple[str, int]]:
    """Remove the folders of owners that no longer exist; return (path, bytes) of those removed.

    Folders on network file systems are left alone unless ``network`` is
    true; even then only this host's dead owners' folders go (an owner
    on another host, or named without a host there, is never judged dead).
    A folder that could not be removed is not reported (it is still there).
    The named semaphores loky made for a dead owner's pid go with its folder
    (reported with size 0).
    """
    removed = []
    for found in find_folders(bases):
        if found.status != OWNER_DEAD or (found.network_fs is not None and not network):
            continue
        path = found.path
        size = folder_size(path)
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)
            if os.path.lexists(path):
                continue
        removed.append((path, size))
        # And the named semaphores loky made for that pid, if no process has it now (see _watchdog).
        removed.extend((sem, 0) for sem in remove_loky_semaphores(found.owner.pid, dry_run=dry_run))
    return removed


def candidate_bases(explicit: Optional[str] = None) -> set:
    """Every location memshare folders of this user may be found in."""
    primary, _ = default_base(explicit)
    return {primary, SHM_ROOT, tempfile.gettempdir(), fallback_base(primary) or primary}
