"""Where new shared files go: memfds or named files, under which folder, and what file system holds a place.

:func:`choose_location` is the one decision between memfds and named files,
made from ``_memfd``'s probe and the user's settings: a folder the user chose
(``temp_folder=``, ``MEMSHARE_TEMP_FOLDER``, ``JOBLIB_TEMP_FOLDER``) keeps
named files there. The other functions only read: a place's disk fallback, its
free room, and whether other machines may share its file system.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from typing import Optional, Tuple

from .._config import folder_from_environment, resolve_folder
from . import _memfd, _procfs

SHM_ROOT = "/dev/shm"


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

    Unknown (no mount table: not Linux) counts as local. Another host's
    folders are safe there all the same: a folder's name records its host,
    and only this host's owners are judged dead (``_owners``).
    """
    fstype = mount_fstype(os.path.realpath(path), _procfs.mountinfo() if mountinfo is None else mountinfo)
    return fstype if is_network_fstype(fstype) else None
