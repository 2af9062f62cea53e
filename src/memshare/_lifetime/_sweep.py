"""This user's memshare folders: finding them, and sweeping away those whose owner died.

``python -m memshare clean`` and ``doctor`` use it, and so does each
process's first folder (``_temp_folder``). Only a folder whose owner has
certainly exited goes (``_owners``), and only on a file system local to this
machine unless asked: storage that several machines share holds other hosts'
folders, never judged dead here, and listing it at every start would cost
time. The named semaphores loky made for a dead owner go with its folder.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from typing import Iterable, List, Optional, Set, Tuple

from . import _location, _procfs
from ._owners import FOLDER_PREFIX, OWNER_DEAD, Owner, parse_folder_name
from ._watchdog import remove_loky_semaphores


def list_folders(bases: Iterable[Optional[str]]) -> List[Tuple[str, Owner]]:
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
    """The bytes the files under ``path`` take (their blocks, not their sizes)."""
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


def find_folders(bases: Iterable[Optional[str]], mountinfo: Optional[str] = None) -> List[FoundFolder]:
    """memshare folders of this user under ``bases``, each with its owner's status and file system.

    ``mountinfo`` is the mount table's text (read from ``/proc`` when None,
    once, and only if there is a folder to judge).
    """
    network = {}
    found = []
    for path, owner in list_folders(bases):
        base = os.path.dirname(path)
        if base not in network:
            mountinfo = _procfs.mountinfo() if mountinfo is None else mountinfo
            network[base] = _location.network_fstype(base, mountinfo)
        fstype = network[base]
        found.append(FoundFolder(path, owner, owner.status(local=fstype is None), fstype))
    return found


def sweep_dead_owners(
    bases: Iterable[Optional[str]], dry_run: bool = False, network: bool = False
) -> List[Tuple[str, int]]:
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


def candidate_bases(explicit: Optional[str] = None) -> Set[str]:
    """Every location memshare folders of this user may be found in."""
    primary, _ = _location.default_base(explicit)
    return {primary, _location.SHM_ROOT, tempfile.gettempdir(), _location.fallback_base(primary) or primary}
