"""Who owns a temp folder, and whether that owner is still alive.

Every folder memshare creates is named ``memshare-<pid>-<start>-<ns>-<random>``:

* ``pid`` and ``start`` (the process start time, in clock ticks since boot on
  Linux) identify the owner. Checking both means a recycled pid never makes a
  live owner look dead, nor a dead owner look alive.
* ``ns`` is the pid namespace of the owner. Containers that share ``/dev/shm``
  (``--ipc=host``) see each other's folders but not each other's processes;
  a folder from another namespace is never judged dead.
* ``random`` makes the name unpredictable, so nobody can plant a file or
  symlink at the path beforehand.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from typing import Optional, Tuple

FOLDER_PREFIX = "memshare-"
_NAME_PATTERN = re.compile(r"^memshare-(\d+)-(\d+)-(\d+)-([0-9a-f]{16})(?:-disk)?$")


_HAVE_PROC = os.path.isdir("/proc/self")


def process_start_time(pid: int) -> Optional[int]:
    """The start time of ``pid`` as an integer token, or None if it does not exist."""
    if _HAVE_PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            # Fields after "(comm)" start at field 3 ("state"); starttime is field 22.
            return int(fields[19])
        except FileNotFoundError:
            return None  # with /proc mounted, a missing entry means no such process
        except (OSError, IndexError, ValueError):
            pass
    try:
        import psutil

        return int(psutil.Process(pid).create_time() * 1000)
    except Exception:  # psutil.NoSuchProcess, AccessDenied, or no psutil at all
        return None


def pid_namespace() -> int:
    """An identifier of this process's pid namespace (0 where unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class Owner:
    """The identity of the process that created a folder."""

    pid: int
    start: int
    namespace: int

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, process_start_time(pid) or 0, pid_namespace())

    def is_alive(self) -> bool:
        """False only when this owner has certainly exited.

        A folder from another pid namespace, or one whose owner cannot be
        checked, counts as alive: deleting a live owner's data is far worse
        than leaving an orphan for ``python -m memshare clean``.
        """
        if self.namespace != pid_namespace():
            return True
        start = process_start_time(self.pid)
        if start is None:
            return not _pid_certainly_gone(self.pid)
        return start == self.start


def _pid_certainly_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def new_folder_name(owner: Owner) -> str:
    """A fresh, unpredictable folder name that records ``owner``."""
    return f"{FOLDER_PREFIX}{owner.pid}-{owner.start}-{owner.namespace}-{secrets.token_hex(8)}"


def parse_folder_name(name: str) -> Optional[Owner]:
    """The owner recorded in a memshare folder name, or None for other names."""
    match = _NAME_PATTERN.match(name)
    if match is None:
        return None
    pid, start, namespace, _ = match.groups()
    return Owner(int(pid), int(start), int(namespace))


def owner_identity() -> Tuple[int, Optional[int]]:
    """The (pid, start time) of this process, which its workers watch to exit when it dies."""
    pid = os.getpid()
    return pid, process_start_time(pid)
