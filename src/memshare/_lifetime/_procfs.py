"""Reading Linux's ``/proc``: mappings, page flags, descriptors, processes, mounts and namespaces.

Every file of ``/proc`` that memshare reads is read and parsed here, once:
each function reads one file or folder and returns what it says, raising
``OSError`` (or returning None, as each says) where ``/proc`` is missing,
hidden or unreadable, so that each caller decides what that means for it.
The fast check of one mapping (``_refs._maps_same_file``: a single ``stat``
of ``/proc/self/map_files``) stays where it is used.

Standard library only and no import of memshare: the watchdog, a plain
script, loads this file by its path. psutil reads the same files through a
``Process`` object made per call (one kept would name the parent in a forked
child), which costs more per call, and its start time is not the kernel's
clock ticks that folder names carry.
"""

from __future__ import annotations

import errno
import os
from typing import Iterator, List, NamedTuple, Optional, Tuple

PROC = "/proc"
#: This process's mappings, one line each.
MAPS = "/proc/self/maps"
_PAGEMAP = "/proc/self/pagemap"
_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
_MOUNTINFO = "/proc/self/mountinfo"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_EXE = "/proc/self/exe"


def available() -> bool:
    """True when ``/proc`` is mounted and shows this process."""
    return os.path.isdir(f"{PROC}/self")


# -- this process's memory ------------------------------------------------------


class Mapping(NamedTuple):
    """One line of ``/proc/self/maps``, its fields as the kernel writes them."""

    start: int
    end: int
    permissions: bytes  # e.g. b"rw-p": ``p`` private, ``s`` shared
    offset: int  # in the file
    device: bytes  # b"00:00" for anonymous memory
    inode: bytes  # b"0" for anonymous memory
    path: Optional[bytes]  # None for unnamed memory; also b"[heap]", b"[anon:...]", b"... (deleted)"


def mappings() -> Iterator[Mapping]:
    """This process's mappings in address order, read now and parsed as they are iterated.

    Raises OSError when ``/proc/self/maps`` cannot be read (not Linux, no
    ``/proc``). The file is read whole at once, so the mappings are those of
    one instant; lines are parsed lazily, so a caller that stops early
    parses no more.
    """
    with open(MAPS, "rb") as maps:
        lines = maps.read().splitlines()
    return _parsed(lines)


def _parsed(lines: List[bytes]) -> Iterator[Mapping]:
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 5:
            continue
        start, end = (int(x, 16) for x in fields[0].split(b"-"))
        path = fields[5] if len(fields) == 6 else None
        yield Mapping(start, end, fields[1], int(fields[2], 16), fields[3], fields[4], path)


def mapping_count() -> Optional[int]:
    """How many mappings this process has now; None when ``/proc/self/maps`` cannot be read."""
    try:
        with open(MAPS, "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:
        return None


def max_map_count() -> Optional[int]:
    """The kernel's limit of mappings per process (``vm.max_map_count``); None where unknown."""
    try:
        with open(_MAX_MAP_COUNT, "rb") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return None


def pagemap(first_page: int, count: int) -> bytes:
    """The ``/proc/self/pagemap`` entries of ``count`` pages from page number ``first_page``: 8 bytes each.

    Raises OSError when it cannot be read, or reads short.
    """
    with open(_PAGEMAP, "rb", buffering=0) as entries:
        raw = os.pread(entries.fileno(), count * 8, first_page * 8)
    if len(raw) != count * 8:
        raise OSError(errno.EIO, f"short read of {_PAGEMAP}")
    return raw


def executable() -> Optional[str]:
    """The real path of this process's executable; None when it cannot be known."""
    try:
        return os.path.realpath(_EXE)
    except OSError:
        return None


# -- descriptors ----------------------------------------------------------------


def fd_folder(pid: object = "self") -> str:
    """The ``/proc`` folder of the descriptors of process ``pid`` (a number, or ``"self"``)."""
    return f"{PROC}/{pid}/fd"


def fd_path(pid: object, fd: object) -> str:
    """The ``/proc`` path of descriptor ``fd`` of process ``pid`` (a number, or ``"self"``)."""
    return f"{PROC}/{pid}/fd/{fd}"


def descriptors(pid: object = "self") -> List[str]:
    """The descriptor numbers (as names) process ``pid`` holds now; raises OSError when they cannot be listed.

    Listing ``self`` opens a descriptor of its own, which the list includes.
    """
    return os.listdir(fd_folder(pid))


def pids() -> List[int]:
    """The pids of every process ``/proc`` shows; raises OSError when it cannot be read."""
    return [int(entry) for entry in os.listdir(PROC) if entry.isdigit()]


def pipe_reader(fd: int) -> Optional[int]:
    """The pid of another process holding the read end of the pipe whose write end is this process's ``fd``.

    None when ``fd`` is not a pipe, when no other process shows it open for
    reading, or when ``/proc`` cannot be read. Only processes whose
    descriptors this user may list are seen.
    """
    try:
        target = os.readlink(fd_path("self", fd))
        if not target.startswith("pipe:"):
            return None
        candidates = pids()
    except OSError:
        return None
    me = os.getpid()
    for pid in candidates:
        if pid == me:
            continue
        try:
            held = descriptors(pid)
        except OSError:
            continue
        for name in held:
            try:
                if os.readlink(fd_path(pid, name)) == target and _opened_for_reading(pid, name):
                    return pid
            except OSError:
                continue
    return None


def _opened_for_reading(pid: int, fd: str) -> bool:
    """True when descriptor ``fd`` of ``pid`` was opened read-only (its ``fdinfo`` flags, in octal)."""
    with open(f"{PROC}/{pid}/fdinfo/{fd}", "rb") as info:
        for line in info:
            if line.startswith(b"flags:"):
                return int(line.split()[1], 8) & os.O_ACCMODE == os.O_RDONLY
    return False


# -- processes ------------------------------------------------------------------


def process_stat(pid: int) -> Optional[Tuple[str, int]]:
    """(state letter, start time in clock ticks since boot) of ``pid``, from ``/proc/<pid>/stat``.

    Raises ``FileNotFoundError`` when ``/proc`` is mounted and has no such
    process, any other OSError when it cannot be read; None when its content
    cannot be parsed.
    """
    with open(f"{PROC}/{pid}/stat", "rb") as stat:
        content = stat.read()
    try:
        # The command name, in parentheses, may hold anything: the fields after its last ")" start at
        # field 3 ("state"); starttime is field 22.
        fields = content.rsplit(b")", 1)[1].split()
        return fields[0].decode("ascii", "replace"), int(fields[19])
    except (IndexError, ValueError):
        return None


def namespace(pid: object, name: str) -> Optional[int]:
    """The inode of the namespace ``name`` (``pid``, ``time``...) process ``pid`` lives in; None when unreadable."""
    try:
        return os.stat(f"{PROC}/{pid}/ns/{name}").st_ino
    except OSError:
        return None


def boottime_offset(pid: object) -> Optional[int]:
    """The boot-time offset (ns) of ``/proc/<pid>/timens_offsets``: that of ``pid``'s future children.

    None when the file has no such line; raises OSError or ValueError when it
    cannot be read or parsed.
    """
    with open(f"{PROC}/{pid}/timens_offsets", "rb") as offsets:
        for line in offsets:
            fields = line.split()
            if len(fields) == 3 and fields[0] == b"boottime":
                return int(fields[1]) * 1_000_000_000 + int(fields[2])
    return None


def boot_id() -> str:
    """This boot's random id; empty when it cannot be read."""
    try:
        with open(_BOOT_ID, encoding="ascii", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return ""


# -- mounts ---------------------------------------------------------------------


def mountinfo() -> str:
    """This process's mount table, or an empty string where there is none (no ``/proc``)."""
    try:
        with open(_MOUNTINFO, encoding="utf-8", errors="surrogateescape") as table:
            return table.read()
    except OSError:
        return ""
