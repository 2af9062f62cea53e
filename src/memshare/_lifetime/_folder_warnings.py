"""Warnings about where shared files went, each given once per folder: on disk, in a folder on disk, pickled.

The memo of what was warned about is per process (a worker gets a new
``FolderPair`` with every task, but warns once per folder all the same) and
stays bounded: a folder's entries go when the folder is removed
(:func:`forget_warnings`).
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Protocol, Set, Tuple

from .. import _forksafe
from .._config import ENV_TEMP_FOLDER, disk_folder_message, format_bytes
from .._errors import SharedMemoryFallbackWarning
from . import _procfs
from ._location import Location, free_bytes, mount_fstype

# (folder, what) pairs already warned about, so that a call warns once and not once per array.
_warned: Set[Tuple[str, str]] = set()
_warned_lock = _forksafe.lock()


class FolderNames(Protocol):
    """What a warning reads of a folder pair (``_folders.FolderPair``): its folder and its disk fallback."""

    @property
    def primary(self) -> str: ...

    @property
    def fallback(self) -> Optional[str]: ...


def forget_warnings(primary: str) -> None:
    """Drop what was warned about a folder that is gone, so that the memo stays bounded."""
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
        location.base, mount_fstype(os.path.realpath(location.base), _procfs.mountinfo()), location.chosen_by
    )
    if message is not None and _first_warning(location.base, "not RAM"):
        warnings.warn(message, SharedMemoryFallbackWarning, stacklevel=stacklevel)


def warn_result_pickled(pair: FolderNames, nbytes: int, stacklevel: int = 2) -> None:
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
