"""memshare's memfds seen from outside their owner: every process's, and this process's descriptors on them.

What ``python -m memshare doctor`` and the tests look at, read from
``/proc/<pid>/fd`` of each process of this user; the owner's registry is
``_memfd``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from . import _procfs
from ._memfd import BUDGET_SHARE, NAME_PREFIX, budget, descriptor_limits, kind_of


@dataclass(frozen=True)
class LiveMemfd:
    """A memshare memfd some process holds open (what the doctor lists)."""

    pid: int
    kind: str
    nbytes: int
    device: int = 0
    inode: int = 0


def live_memfds() -> List[LiveMemfd]:
    """Every memshare memfd that a process of this user holds open, once per process and file."""
    found: List[LiveMemfd] = []
    try:
        pids = _procfs.pids()
    except OSError:
        return found
    for pid in sorted(pids):
        seen = set()
        try:
            fds = _procfs.descriptors(pid)
        except OSError:
            continue  # gone, or another user's
        for fd in fds:
            path = _procfs.fd_path(pid, fd)
            kind = kind_of(path)
            if kind is None:
                continue
            try:
                info = os.stat(path)
            except OSError:
                continue
            if info.st_uid != os.geteuid() or (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            found.append(LiveMemfd(pid, kind, info.st_blocks * 512, info.st_dev, info.st_ino))
    return found


def descriptors_of(pid: Optional[int] = None) -> int:
    """How many descriptors process ``pid`` (default: this one) holds on memshare's files.

    Counted from ``/proc/<pid>/fd``: memshare memfds (dump, result, shared,
    held) and anything open in a memshare folder (a session's folder, kept
    open for its result socket). 0 where ``/proc`` cannot be read.
    """
    pid = os.getpid() if pid is None else pid
    try:
        names = _procfs.descriptors(pid)
    except OSError:
        return 0
    count = 0
    for name in names:
        try:
            target = os.readlink(_procfs.fd_path(pid, name))
        except OSError:
            continue
        if target.startswith(f"/memfd:{NAME_PREFIX}") or f"/{NAME_PREFIX}" in target:
            count += 1
    return count


def descriptor_report() -> List[str]:
    """Lines for the doctor: this process's descriptor limits and memshare's budget and use of them."""
    soft, hard = descriptor_limits()
    if soft is None:
        return ["descriptor limit: none (memshare keeps memfds without a budget)"]
    lines = [
        f"descriptor limit (ulimit -n): soft {soft}, hard {'unlimited' if hard is None else hard}; "
        f"memshare keeps at most {budget()} open ({int(BUDGET_SHARE * 100)}% of the soft limit, raised towards "
        "the hard limit once when needed), then uses named files, which need none",
        f"memshare holds {descriptors_of()} descriptor(s) in this process; mappings keep none",
    ]
    if soft < 1024:
        lines.append(f"a soft limit of {soft} is low: `ulimit -n {hard or 4096}` leaves more room to memfds")
    return lines
