"""Nameless shared memory: ``memfd_create`` files, held by descriptors, reached through ``/proc``.

This module is the registry of the memfds a process owns (:func:`create`,
:func:`release`): the owner holds each open for as long as the file lives,
and deleting the file is closing that descriptor. Another process of the same
user opens it through its path ``/proc/<owner pid>/fd/<n>``. Whether memfds
work here is probed once per process (:func:`decision`), never guessed; the
descriptors kept open stay within a budget (:func:`budget`); a forked child
closes the ones it inherited.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

from .. import _forksafe
from .._config import env_flag
from .._stats import logger
from . import _procfs

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

#: Environment variable that turns memfds off ("0"), keeping named files.
ENV_MEMFD = "MEMSHARE_MEMFD"
NAME_PREFIX = "memshare-"
#: What the ``/proc`` link of a memshare memfd names: ``/memfd:memshare-<kind>-<random> (deleted)``.
_LINK_PATTERN = re.compile(r"^/memfd:memshare-([a-z]+)-[0-9a-f]{16} \(deleted\)$")
_PROC_FD_PATTERN = re.compile(r"^/proc/(\d+)/fd/(\d+)$")
#: Share of the soft RLIMIT_NOFILE that the descriptors memshare keeps open may take; the rest is
#: the user's program's. A live memfd costs its owner one descriptor (mappings keep none:
#: ``_mapping.map_descriptor``); past the budget a named file, which needs none, is made instead.
BUDGET_SHARE = 0.5
#: Of the budget, what memfds leave to memshare's other descriptors: a session's result socket
#: and its folder, result descriptors received and not yet mapped.
RESERVED = 16
#: The soft limit is raised to the hard limit, but not past this (a hard limit of millions is common).
RAISE_CAP = 1 << 16
#: The child of the probe opens the path it is given and prints what it opened.
_PROBE_CHILD = "import os,sys;s=os.fstat(os.open(sys.argv[1],os.O_RDONLY));print(s.st_dev,s.st_ino)"


@dataclass(frozen=True)
class Decision:
    """Whether this process shares through memfds, and why (one line for the log and the doctor)."""

    in_memory: bool
    reason: str
    seconds: float = 0.0  # what the probe took


class _Registry:
    """The memfds this process owns: path -> descriptor.

    Per process because descriptors are. A forked child closes the
    descriptors it inherited: it owns none of these files, and its copies
    would keep the parent's memory alive for as long as the child lives. The
    decision is kept in a child: it holds for the same machine, user and
    mounts.
    """

    def __init__(self) -> None:
        # Re-entrant: a shared or held array collected by the garbage collector
        # while this thread holds the lock releases its memfd from a finalizer
        # in the same thread.
        self.lock = _forksafe.rlock()
        self.fds: Dict[str, int] = {}
        # path -> (device, inode) of the memfd held there: what the path names for as long as it is held,
        # known without a stat (``_refs`` uses it to trust a reference to this process's own memfd).
        self.identities: Dict[str, Tuple[int, int]] = {}
        # path -> (identity, allocated bytes) of a memfd whose size and allocation no longer change
        # (see ``settle``), by identity too, and their total: what ``held`` sums without a system call.
        self.settled: Dict[str, Tuple[Tuple[int, int], int]] = {}
        self.settled_identities: Set[Tuple[int, int]] = set()
        self.settled_bytes = 0
        self.decision: Optional[Decision] = None
        self.raised = False  # the soft descriptor limit was raised (or found unraisable) once
        self.over_budget_logged = False

    def after_fork_in_child(self) -> None:
        self.lock = _forksafe.rlock()
        self.over_budget_logged = False
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}
        self.identities = {}
        self.settled = {}
        self.settled_identities = set()
        self.settled_bytes = 0


_registry = _Registry()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_registry.after_fork_in_child)


def decision() -> Decision:
    """Whether memfds work here, probed on the first call in this process."""
    with _registry.lock:
        if _registry.decision is None:
            started = time.perf_counter()
            in_memory, reason = _probe()
            _registry.decision = Decision(in_memory, reason, time.perf_counter() - started)
            # One line in the decision log per process: which mechanism, and why.
            if in_memory:
                logger.debug("memshare: shared memory is memfds: %s", reason)
            else:
                logger.info("memshare: shared memory is named files (memfds unusable): %s", reason)
        return _registry.decision


def _probe() -> Tuple[bool, str]:
    """(works, why): try what sharing needs, end to end, once.

    ``/proc`` may be hidden, ``memfd_create`` missing, or another process
    refused the open, so a tiny child process really opens a memfd through
    ``/proc/<pid>/fd/<n>`` (about 10 ms): a plain ``open()`` that needs
    ptrace read access, which processes of the same user have (Yama restricts
    only attaching). memshare's workers are its own children, of the same
    user; workers running as another user could not open the path, which
    the probe cannot foresee: ``MEMSHARE_MEMFD=0`` is for that case.
    """
    if not env_flag(ENV_MEMFD, True):
        return False, f"{ENV_MEMFD}={os.environ[ENV_MEMFD].strip().lower()} turns memfds off"
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return False, "memfd_create is not available (Linux only, Python 3.8+)"
    if not os.path.isdir(_procfs.fd_folder(os.getpid())):
        return False, "/proc is not mounted or hidden, so workers could not open memfds"
    try:
        fd = os.memfd_create(f"{NAME_PREFIX}probe-{secrets.token_hex(8)}", os.MFD_CLOEXEC)
    except OSError as exc:
        return False, f"memfd_create failed: {exc}"
    try:
        info = os.fstat(fd)
        path = _procfs.fd_path(os.getpid(), fd)
        try:
            child = subprocess.run(
                [sys.executable, "-I", "-S", "-c", _PROBE_CHILD, path],
                capture_output=True,
                timeout=60,
                close_fds=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return False, f"could not start a process to check that memfds can be opened: {exc}"
        if child.stdout.split() != [str(info.st_dev).encode(), str(info.st_ino).encode()]:
            last = (child.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            return False, f"another process could not open a memfd through {path}: {last}"
    finally:
        os.close(fd)
    return True, "memfd_create works and another process opened a memfd through /proc/<pid>/fd"


def set_decision_for_tests(in_memory: bool, reason: str) -> None:
    """Replace this process's decision (tests of the fallback use it)."""
    with _registry.lock:
        _registry.decision = Decision(in_memory, reason)


def descriptor_limits() -> Tuple[Optional[int], Optional[int]]:
    """This process's (soft, hard) ``RLIMIT_NOFILE``; None for a limit that is unlimited or unknown."""
    if resource is None:
        return None, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (None if soft == resource.RLIM_INFINITY else soft), (None if hard == resource.RLIM_INFINITY else hard)


def budget() -> Optional[int]:
    """How many descriptors memshare may keep open in this process now; None without a limit."""
    soft, _ = descriptor_limits()
    return None if soft is None else int(soft * BUDGET_SHARE)


def held_count() -> int:
    """How many memfd descriptors this process keeps open (at most :func:`budget` less ``RESERVED``)."""
    with _registry.lock:
        return len(_registry.fds)


def _raise_soft_limit() -> None:
    """Raise the soft descriptor limit towards the hard one, once per process, and log it."""
    soft, hard = descriptor_limits()
    if soft is None or resource is None:
        return
    target = max(soft, RAISE_CAP) if hard is None else min(hard, max(soft, RAISE_CAP))
    if target <= soft:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    except (OSError, ValueError) as exc:
        logger.info("memshare: could not raise the soft descriptor limit from %d to %d: %s", soft, target, exc)
        return
    logger.info(
        "memshare: raised the soft descriptor limit (ulimit -n) from %d to %d (hard limit %s): "
        "memshare's shared memory needs more descriptors; it keeps at most %d%% of the limit",
        soft,
        target,
        "unlimited" if hard is None else hard,
        int(BUDGET_SHARE * 100),
    )


def within_budget() -> bool:
    """True when one more memfd stays within the budget (raising the soft limit once if that helps).

    When the memfds held reach the budget, the soft limit is raised towards
    the hard one, once per process (logged); past the budget after that, the
    answer is no, and the reason is logged once.
    """
    with _registry.lock:
        held = len(_registry.fds)
        limit = budget()
        if limit is None or held < limit - RESERVED:
            return True
        if not _registry.raised:
            _registry.raised = True
            _raise_soft_limit()
            limit = budget()
            if limit is None or held < limit - RESERVED:
                return True
        if not _registry.over_budget_logged:
            _registry.over_budget_logged = True
            soft, hard = descriptor_limits()
            logger.info(
                "memshare: new shared memory is named files in the private folder, not memfds: memshare holds "
                "%d memfds, its budget of %d%% of the descriptor limit (soft %s, hard %s); the rest is left to "
                "the program. Raise `ulimit -n` to use memfds for more arrays",
                held,
                int(BUDGET_SHARE * 100),
                soft,
                "unlimited" if hard is None else hard,
            )
        return False


def create(kind: str) -> Tuple[str, int]:
    """A new empty 0600 memfd of ``kind``, held by this process: (its ``/proc`` path, a descriptor for the caller).

    The caller closes the descriptor it gets, as for a named file; the file
    lives until :func:`release` closes the one kept here. Its path is a magic
    link, so ``O_NOFOLLOW`` cannot be used on it: whoever opens one checks the
    file's identity (device, inode) afterwards, and that its link names a
    memshare memfd of the right kind (:func:`kind_of`). Raises ``OSError``
    with EMFILE when memshare's descriptors are at their budget (see
    :func:`within_budget`): the caller makes a named file instead.
    """
    if not within_budget():
        raise OSError(errno.EMFILE, f"memshare: {held_count()} memfds held, the descriptor budget ({budget()})")
    kept = os.memfd_create(f"{NAME_PREFIX}{kind}-{secrets.token_hex(8)}", os.MFD_CLOEXEC)
    try:
        os.fchmod(kept, 0o600)
        info = os.fstat(kept)
        fd = os.dup(kept)
    except BaseException:
        os.close(kept)
        raise
    path = _procfs.fd_path(os.getpid(), kept)
    with _registry.lock:
        _registry.fds[path] = kept
        _registry.identities[path] = (info.st_dev, info.st_ino)
    return path, fd


def release(path: str) -> bool:
    """Close this process's memfd at ``path``: the file is gone once no mapping or other descriptor holds it.

    True when ``path`` is a memfd path (whether this process held it or not:
    nobody may unlink a ``/proc`` path); False for a named file.
    """
    if not is_memfd_path(path):
        return False
    with _registry.lock:
        fd = _registry.fds.pop(path, None)
        _registry.identities.pop(path, None)
        settled = _registry.settled.pop(path, None)
        if settled is not None:
            _registry.settled_identities.discard(settled[0])
            _registry.settled_bytes -= settled[1]
    if fd is not None:
        os.close(fd)
    return True


def duplicate(path: str) -> int:
    """A new descriptor of this process's memfd at ``path`` (the caller closes it).

    Raises FileNotFoundError when this process does not hold it (any more).
    """
    with _registry.lock:
        fd = _registry.fds.get(path)
        if fd is None:
            raise FileNotFoundError(f"memshare: this process holds no memfd at {path!r}")
        return os.dup(fd)


def held_identity(path: str) -> Optional[Tuple[int, int]]:
    """(device, inode) of the memfd this process holds at ``path``; None when it holds none there.

    No system call: while this process holds the memfd, its ``/proc`` path
    names that file and no other (the descriptor is closed only by
    :func:`release`, or in a forked child, which starts with none).
    """
    return _registry.identities.get(path)  # one dict lookup: atomic, no lock needed


def settle(path: str) -> None:
    """The memfd this process holds at ``path`` has all its bytes allocated and keeps its size.

    What it holds then stays true, since memshare never resizes a file nor
    frees part of one: :func:`held_memfds` counts it with no system call (a
    process may hold thousands of broadcasts). A file not wholly allocated
    yet (no ``fallocate`` where it lives) is asked each time.
    """
    with _registry.lock:
        fd = _registry.fds.get(path)
        if fd is None or path in _registry.settled:
            return
        info = os.fstat(fd)
        if info.st_blocks * 512 >= info.st_size:
            identity, nbytes = (info.st_dev, info.st_ino), info.st_blocks * 512
            _registry.settled[path] = (identity, nbytes)
            _registry.settled_identities.add(identity)
            _registry.settled_bytes += nbytes


class HeldMemfds(NamedTuple):
    """The memfds this process holds: those settled as totals, the others as they are now."""

    settled_count: int
    settled_bytes: int
    others: List[os.stat_result]  # one ``fstat`` each


def held_memfds() -> HeldMemfds:
    """What the memfds this process holds are now: a sum for the settled, an ``fstat`` of each other."""
    with _registry.lock:
        count, nbytes = len(_registry.settled), _registry.settled_bytes
        settled, fds = _registry.settled, []
        if len(settled) < len(_registry.fds):  # else every one is settled: no walk over thousands
            fds = [fd for path, fd in _registry.fds.items() if path not in settled]
    others = []
    for fd in fds:
        try:
            others.append(os.fstat(fd))
        except OSError:
            continue  # released meanwhile
    return HeldMemfds(count, nbytes, others)


def is_settled(identity: Tuple[int, int]) -> bool:
    """True when ``identity`` is a settled memfd this process holds (counted in :func:`held_memfds`' sum)."""
    return identity in _registry.settled_identities  # one set lookup: atomic, no lock needed


def held_paths() -> List[str]:
    """The paths of the memfds this process holds."""
    with _registry.lock:
        return list(_registry.fds)


def is_memfd_path(path: str) -> bool:
    """True for a ``/proc/<pid>/fd/<n>`` path, which memshare uses for memfds only."""
    return isinstance(path, str) and _PROC_FD_PATTERN.match(path) is not None


def kind_of(path: str) -> Optional[str]:
    """The kind (``dump``, ``result``, ``shared``) of the memshare memfd at the ``/proc`` path ``path``, else None."""
    try:
        target = os.readlink(path)
    except OSError:
        return None
    match = _LINK_PATTERN.match(target)
    return match.group(1) if match else None


def kind_of_descriptor(fd: int) -> Optional[str]:
    """:func:`kind_of` for a descriptor this process opened: no race with the path being reused."""
    return kind_of(_procfs.fd_path("self", fd))
