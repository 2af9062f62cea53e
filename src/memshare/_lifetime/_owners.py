"""Who owns a temp folder, and whether that owner is still alive.

Every folder memshare creates is named
``memshare-<pid>-<start>-<ns>-<host>-<random>``:

* ``pid`` and ``start`` (the process start time, in clock ticks since boot on
  Linux) identify the owner. Checking both means a recycled pid never makes a
  live owner look dead, nor a dead owner look alive. The kernel shows a start
  time through the reader's time namespace (``unshare --time``): it is
  compared after moving it by the two namespaces' boot-time offsets, and
  where those cannot be read the owner counts as alive.
* ``ns`` is the pid namespace of the owner. Containers that share ``/dev/shm``
  (``--ipc=host``) see each other's folders but not each other's processes;
  a folder from another namespace is never judged dead.
* ``host`` identifies the machine (:func:`host_identity`). The initial pid
  namespace has the same inode on every Linux host, so on a temp folder that
  several machines share (NFS or Lustre scratch) the namespace alone would let
  a live owner on another machine look dead here; a folder of another host is
  never judged dead.
* ``random`` makes the name unpredictable, so nobody can plant a file or
  symlink at the path beforehand.

A disk fallback twin carries the same owner fields, a random part of its own,
and the suffix ``-disk``.

A name without the host field (``memshare-<pid>-<start>-<ns>-<random>``, as
memshare 0.1 wrote them) parses with ``host`` None: such an owner is judged
only where the caller knows the folder is on a local file system, which only
this machine's processes write to (see :meth:`Owner.is_alive`); anywhere
else it is kept.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import secrets
import socket
from dataclasses import dataclass
from typing import Optional, Tuple

from . import _procfs

FOLDER_PREFIX = "memshare-"
#: The suffix of a folder's disk fallback twin.
TWIN_SUFFIX = "-disk"
#: Hex digits of the host identity: 40 bits keep the name short while two hosts
#: of even a large cluster almost never share one.
HOST_DIGITS = 10
# The host group is optional: memshare 0.1's names have none.
_NAME_PATTERN = re.compile(
    rf"^memshare-(\d+)-(\d+)-(\d+)-(?:([0-9a-f]{{{HOST_DIGITS}}})-)?[0-9a-f]{{16}}(?:{TWIN_SUFFIX})?$"
)
_MACHINE_ID = "/etc/machine-id"


_HAVE_PROC = _procfs.available()


def process_start_time(pid: int) -> Optional[int]:
    """The start time of ``pid`` as an integer token, or None if it does not exist."""
    if _HAVE_PROC:
        try:
            stat = _procfs.process_stat(pid)
        except FileNotFoundError:
            return None  # with /proc mounted, a missing entry means no such process
        except OSError:
            stat = None
        if stat is not None:
            return stat[1]
    try:
        import psutil

        return int(psutil.Process(pid).create_time() * 1000)
    except Exception:  # psutil.NoSuchProcess, AccessDenied, or no psutil at all
        return None


@functools.cache
def host_identity() -> str:
    """A short identity of this machine, the same in all its processes and stable across calls.

    A hash of ``/etc/machine-id`` (or, where there is none, of the boot id)
    together with the host name: machine ids are copied along with disk
    images, so cloned cluster nodes may share one, while their host names
    differ. Where neither file can be read, the host name alone. Cached, so
    that a process keeps one identity for its whole life (were the host name
    changed meanwhile, its own folders would otherwise look foreign to it); a
    forked child, on the same machine, rightly inherits it.
    """
    try:
        with open(_MACHINE_ID, encoding="ascii", errors="replace") as handle:
            machine = handle.read().strip()
    except OSError:
        machine = ""
    machine = machine or _procfs.boot_id()
    digest = hashlib.sha256(f"{machine}\0{socket.gethostname()}".encode("utf-8", "replace"))
    return digest.hexdigest()[:HOST_DIGITS]


def pid_namespace() -> int:
    """An identifier of this process's pid namespace (0 where unknown)."""
    return _procfs.namespace("self", "pid") or 0


#: What :meth:`Owner.status` says: only ``OWNER_DEAD`` lets a folder be removed.
OWNER_ALIVE = "alive"
OWNER_DEAD = "dead"
OWNER_OTHER_HOST = "on another host"
OWNER_OTHER_NAMESPACE = "in another pid namespace"
OWNER_UNKNOWN_HOST = "of an unknown host (named by an older memshare, on a file system other machines may share)"


@dataclass(frozen=True)
class Owner:
    """The identity of the process that created a folder.

    ``host`` is None for a folder whose name records none (memshare 0.1's names).
    """

    pid: int
    start: int
    namespace: int
    host: Optional[str]

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, process_start_time(pid) or 0, pid_namespace(), host_identity())

    def status(self, local: bool = False) -> str:
        """What can be said of this owner from here: one of the ``OWNER_*`` values.

        ``local`` says that the folder is on a file system only this machine
        writes to (tmpfs, a local disk): an owner without a recorded host can
        then only be of this machine, and is judged like one of this host.
        """
        if self.host is None and not local:
            return OWNER_UNKNOWN_HOST
        if self.host is not None and self.host != host_identity():
            return OWNER_OTHER_HOST
        if self.namespace != pid_namespace():
            return OWNER_OTHER_NAMESPACE
        start = process_start_time(self.pid)
        if start is None:
            return OWNER_DEAD if _pid_certainly_gone(self.pid) else OWNER_ALIVE
        # The start time is read through the reader's time namespace: the owner may
        # have recorded another number for the same start (see _start_seen_by).
        seen = _start_seen_by(self.pid, start)
        if seen is None:
            return OWNER_ALIVE  # cannot tell: keep the folder
        return OWNER_ALIVE if abs(seen - self.start) <= seen.uncertainty else OWNER_DEAD

    def is_alive(self, local: bool = False) -> bool:
        """False only when this owner has certainly exited (``local`` as for :meth:`status`).

        An owner on another host, in another pid namespace, without a host on
        a file system that may be shared, or that cannot be checked, counts as
        alive: deleting a live owner's data is far worse than leaving an
        orphan for ``python -m memshare clean``.
        """
        return self.status(local) != OWNER_DEAD


class _Ticks(int):
    """A start time in clock ticks, and by how many ticks either way it may be off."""

    uncertainty: int

    def __new__(cls, value: int, uncertainty: int = 0) -> _Ticks:
        ticks = super().__new__(cls, value)
        ticks.uncertainty = uncertainty
        return ticks


def _time_namespace(pid: object) -> Optional[int]:
    """The inode of the time namespace ``pid`` (or ``"self"``) lives in; None when it cannot be read."""
    return _procfs.namespace(pid, "time")


def _boottime_offset(pid: object) -> Optional[int]:
    """The boot-time offset (ns) of the time namespace ``pid`` lives in; None when it cannot be known.

    ``timens_offsets`` shows the namespace of the process's future children,
    which is its own unless it has just unshared one: then it is unknown.
    """
    children = _procfs.namespace(pid, "time_for_children")
    if children is None or children != _time_namespace(pid):
        return None
    try:
        return _procfs.boottime_offset(pid)
    except (OSError, ValueError):
        return None


def _start_seen_by(pid: int, start: int) -> Optional[_Ticks]:
    """``start``, the start time of ``pid`` read here, as ``pid`` itself reads it; None when unknown.

    The kernel adds the reader's boot-time offset to a start time (a process
    under ``unshare --time --boottime N`` reads its own start N seconds
    later than other processes do), so the owner's recorded start is
    comparable only after moving it by the difference of the two offsets.
    A whole number of ticks moves it exactly; otherwise it may be one tick
    off either way. Without time namespaces (no ``/proc/self/ns/time``)
    every process reads the same number.
    """
    if _procfs.namespace("self", "time") is None:
        return _Ticks(start)  # no time namespaces here: one clock for all
    here, there = _time_namespace("self"), _time_namespace(pid)
    if here is None or there is None:
        return None  # another user's process, say: its namespace cannot be looked at
    if here == there:
        return _Ticks(start)
    ours, theirs = _boottime_offset("self"), _boottime_offset(pid)
    if ours is None or theirs is None:
        return None
    tick = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    shift, remainder = divmod(theirs - ours, tick)
    return _Ticks(start + shift, 1 if remainder else 0)


def _pid_certainly_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def new_folder_name(owner: Owner) -> str:
    """A fresh, unpredictable folder name that records ``owner`` (who must have a host)."""
    if owner.host is None:
        raise ValueError("memshare: a new folder name must record its owner's host; use Owner.current()")
    return f"{FOLDER_PREFIX}{owner.pid}-{owner.start}-{owner.namespace}-{owner.host}-{secrets.token_hex(8)}"


def new_twin_name(owner: Owner) -> str:
    """A fresh name for a disk fallback twin of ``owner``'s folder.

    Its random part is its own: a twin named after its primary folder could
    be created by another user as soon as the primary shows in ``/dev/shm``.
    """
    return new_folder_name(owner) + TWIN_SUFFIX


def parse_folder_name(name: str) -> Optional[Owner]:
    """The owner recorded in a memshare folder (or twin) name, or None for other names."""
    match = _NAME_PATTERN.match(name)
    if match is None:
        return None
    pid, start, namespace, host = match.groups()
    return Owner(int(pid), int(start), int(namespace), host)


def owner_identity() -> Tuple[int, Optional[int]]:
    """The (pid, start time) of this process, which its workers watch to exit when it dies."""
    pid = os.getpid()
    return pid, process_start_time(pid)
