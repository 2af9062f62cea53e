"""``python -m memshare doctor``: can memshare share arrays well on this machine?

The usual ways memshare ends up slow or short of room are environmental: a
container with Docker's default 64 MiB ``/dev/shm``, a tmpfs filled by someone
else's leftovers, or folders left behind by owners that were killed together
with their watchdog. This module gathers the facts that decide those cases,
prints them, and ends with a verdict: one ``OK:`` line, or one ``PROBLEM:``
line per problem saying what to do about it. The exit status is non-zero when
there is a problem, so the check can gate a CI job or a container start.

It only reads: it never creates, changes or removes anything of the user's
(the one-time probe of memfds makes a memfd of one page, which goes at once).

It reports the sharing settings in force, as a call made here would see them
(an enclosing ``joblib.parallel_config``, then the environment, then the
defaults), each with where it comes from, and says why a feature they turn
off is off: never "on" for what a call would not do. A temp folder the user
chose on a disk file system gets a note with its cost and the RAM choice.

It also says which mechanism memshare uses (memfds or named files, and why:
the decision of ``_location.choose_location``), and lists the memfds of
memshare that processes of this user hold, by owner: they hold memory
although no folder shows them.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import platform
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .. import _compat
from .._config import (
    format_bytes,
)
from .._lifetime import _holdings, _memfd, _memfd_census, _procfs, _watchdog
from .._lifetime._location import (
    SHM_ROOT,
    choose_location,
    default_base,
    fallback_base,
    free_bytes,
    mount_fstype,
)
from .._lifetime._owners import OWNER_ALIVE, OWNER_DEAD
from .._lifetime._sweep import candidate_bases, find_folders, folder_size
from .doctor_settings import report_settings, settings_in_force

GIB = 1024**3
#: Below this, shared memory is too small for typical workloads; Docker's 64 MiB default is far below it.
MIN_SHM_BYTES = GIB
#: Shared memory with less than this fraction free is reported as nearly full.
NEARLY_FULL_FRACTION = 0.10
#: cgroup limits at or above this mean "no limit" (v1 reports about 2**63 when unlimited).
_NO_LIMIT_BYTES = 2**60
CGROUP_V2_MAX = "/sys/fs/cgroup/memory.max"
CGROUP_V1_LIMIT = "/sys/fs/cgroup/memory/memory.limit_in_bytes"


def shm_size_advice(nbytes: int) -> str:
    """How to give a container's /dev/shm at least ``nbytes`` (and never less than 2 GiB)."""
    gib = max(2, -(-nbytes // GIB))
    return (
        f"docker run --shm-size={gib}g ... (docker compose: shm_size: {gib}gb; Kubernetes: mount an emptyDir "
        f"volume with medium: Memory and sizeLimit: {gib}Gi at /dev/shm)"
    )


@dataclass
class Verdict:
    """What the checks found: problems make the doctor exit non-zero, notes do not."""

    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


def memory_limit() -> Tuple[Optional[int], str]:
    """The container's memory limit in bytes (None for none), and where it was read."""
    for path, version in ((CGROUP_V2_MAX, "cgroup v2"), (CGROUP_V1_LIMIT, "cgroup v1")):
        try:
            with open(path, encoding="ascii") as limit_file:
                text = limit_file.read().strip()
        except (OSError, ValueError):
            continue
        if text == "max":
            return None, f"none ({version} {path}: max)"
        try:
            value = int(text)
        except ValueError:
            continue
        if value >= _NO_LIMIT_BYTES or value >= _physical_memory():
            return None, f"none ({version} {path}: {value}, not below the machine's RAM)"
        return value, f"{version} {path}"
    return None, "none found (no cgroup memory controller visible)"


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return _NO_LIMIT_BYTES


def _fs_type(path: str) -> str:
    """The file system type of the mount holding ``path``, from the mount table; ``unknown`` without one."""
    return mount_fstype(os.path.realpath(path), _procfs.mountinfo()) or "unknown"


def _version(module_name: str) -> str:
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # not installed, or broken: either is worth showing
        return f"not importable ({type(exc).__name__})"
    return str(getattr(module, "__version__", "unknown"))


def _check_shm(
    shm: str, need: int, limit: Optional[int], say: Callable[[str], None], verdict: Verdict, in_memory: bool = False
) -> None:
    """Report on the shared memory location ``shm`` and judge its size and free space.

    With memfds (``in_memory``), memshare's arrays need no room there: a
    small or full ``shm`` is then a note, not a problem.
    """
    # With memfds, what would be a problem for named files is a note.
    report = verdict.notes.append if in_memory else verdict.problems.append
    threshold = max(MIN_SHM_BYTES, 2 * need)
    if not os.path.isdir(shm):
        say("  missing")
        report(
            f"{shm} does not exist, so arrays go to the disk temp folder, which is slow. Provide a RAM-backed "
            f"{shm} ({shm_size_advice(threshold)}) or set MEMSHARE_TEMP_FOLDER to a tmpfs folder."
        )
        return
    try:
        st = os.statvfs(shm)
    except OSError as exc:
        say(f"  cannot be inspected: {exc}")
        report(f"{shm} cannot be inspected ({exc}); check its permissions and mount.")
        return
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    fs_type = _fs_type(shm)
    say(f"  file system: {fs_type}")
    say(f"  size: {format_bytes(size)}, free: {format_bytes(free)}")
    if not os.access(shm, os.W_OK | os.X_OK):
        report(
            f"{shm} is not writable by this user, so arrays go to disk. Fix its permissions (it should be "
            "mode 1777, like /tmp) or set MEMSHARE_TEMP_FOLDER to a writable tmpfs folder."
        )
    if fs_type not in ("tmpfs", "ramfs", "unknown"):
        verdict.notes.append(f"{shm} is on {fs_type}, not tmpfs: files there may be written to disk.")
    if size < threshold:
        why = f"2x the {format_bytes(need)} given with --need" if 2 * need > MIN_SHM_BYTES else "the 1 GiB minimum"
        docker = " (Docker's default is 64 MiB)" if size < MIN_SHM_BYTES else ""
        report(
            f"{shm} is only {format_bytes(size)}{docker}, below {why}; arrays that do not fit go to disk, which is "
            f"slower. Give it at least {format_bytes(threshold)}: {shm_size_advice(threshold)}."
        )
    elif free < NEARLY_FULL_FRACTION * size or free < 2 * need:
        report(
            f"{shm} is nearly full ({format_bytes(free)} free of {format_bytes(size)}). Remove leftovers with "
            f"`python -m memshare clean`, and see what else fills it with `du -sh {shm}/*`."
        )
    if limit is not None and limit < size:
        verdict.notes.append(
            f"files in {shm} count against the container memory limit of {format_bytes(limit)}, "
            "so that is the real room for shared arrays plus everything else."
        )


def _check_memfds(say: Callable[[str], None], memfds: List[_memfd_census.LiveMemfd]) -> None:
    """List the memshare memfds that processes of this user hold, by owner."""
    by_owner: dict = {}
    for memfd in memfds:
        by_owner.setdefault(memfd.pid, []).append(memfd)
    if not by_owner:
        say("  none held by any process of this user")
    for pid, held in sorted(by_owner.items()):
        kinds = ", ".join(f"{sum(m.kind == k for m in held)} {k}" for k in sorted({m.kind for m in held}))
        say(f"  pid {pid}: {len(held)} memfd(s) ({kinds}), {format_bytes(sum(m.nbytes for m in held))}")


#: What a process holds, by where: file identity -> bytes.
_Holding = Dict[str, Dict[Tuple[int, int], int]]
_WHERE = ("folders", "memfds", "mapped")


def _report_holdings(shm: str, say: Callable[[str], None], memfds: List[_memfd_census.LiveMemfd]) -> None:
    """One line on the shared memory memshare holds for this user's live processes, then one per process.

    This process's figures come from its own records (``_holdings.held``,
    as ``last_call_stats`` reports them); another's from what shows of it:
    the files in its folders in ``shm``, the memfds it holds open, and the
    deleted memshare files it maps that no process holds (results it
    adopted). Each file counts once, for the process that keeps it.
    """
    me = os.getpid()
    own = _holdings.held()
    others: Dict[int, _Holding] = {}

    def holding(pid: int) -> _Holding:
        return others.setdefault(pid, {where: {} for where in _WHERE})

    for found in find_folders({shm}):
        if found.status == OWNER_ALIVE and found.owner.pid != me:
            for info in _holdings.folder_files(found.path):
                holding(found.owner.pid)["folders"][(info.st_dev, info.st_ino)] = info.st_blocks * 512
    held_open = {(memfd.device, memfd.inode) for memfd in memfds}
    for memfd in memfds:
        if memfd.pid != me:
            holding(memfd.pid)["memfds"][(memfd.device, memfd.inode)] = memfd.nbytes
    for pid in _user_pids():
        if pid == me:
            continue
        mapped = {key: n for key, n in _holdings.mapped_by(pid).items() if key not in held_open}
        if mapped:
            holding(pid)["mapped"].update(mapped)
    counted: set = set()
    totals: Dict[int, Tuple[int, int, int]] = {}
    for pid, by_where in sorted(others.items()):
        sums = []
        for where in _WHERE:
            fresh = {key: n for key, n in by_where[where].items() if key not in counted}
            counted.update(fresh)
            sums.append(sum(fresh.values()))
        if any(sums):
            totals[pid] = (sums[0], sums[1], sums[2])
    everything = own.total + sum(sum(figures) for figures in totals.values())
    processes = len(totals) + (1 if own.total else 0)
    say(
        f"  memshare holds {format_bytes(everything)} of shared memory for {processes} live process(es) of this "
        f"user (this process: {format_bytes(own.total)}). A container's memory limit counts all of it (cgroup "
        "shmem); a process's RSS and PSS count it only once that process reads or writes it."
    )
    rows = [(me, (own.folders, own.memfds, own.mapped), " (this process)")] if own.total else []
    rows += [(pid, figures, "") for pid, figures in totals.items()]
    for pid, (folders, in_memfds, mapped), which in rows:
        say(
            f"  pid {pid} {_command(pid)}{which}: {format_bytes(folders + in_memfds + mapped)}: "
            f"{format_bytes(folders)} in folders in {shm}, "
            f"{format_bytes(in_memfds)} in memfds it holds open, {format_bytes(mapped)} in deleted files only "
            "its mappings keep (results it received)"
        )


def _user_pids() -> List[int]:
    """The processes of this user, as ``/proc`` lists them (none where it cannot be read)."""
    try:
        entries = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []
    pids = []
    for entry in entries:
        try:
            if os.stat(f"/proc/{entry}").st_uid == os.geteuid():
                pids.append(int(entry))
        except OSError:
            continue  # gone meanwhile
    return sorted(pids)


def _command(pid: int) -> str:
    """The command name of ``pid`` in parentheses, or "(gone)" when it cannot be read."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as comm:
            return f"({comm.read().strip()})"
    except OSError:
        return "(gone)"


def _check_folders(shm: str, say: Callable[[str], None], verdict: Verdict) -> None:
    """List memshare folders in every place they may be, and judge the dead owners' ones."""
    bases = candidate_bases() | {shm}
    folders = find_folders(bases)
    if not folders:
        say(f"  none (looked in {', '.join(sorted(bases))})")
    dead_count, dead_bytes, on_network = 0, 0, False
    for found in folders:
        size = folder_size(found.path)
        if found.status == OWNER_DEAD:
            status = "owner dead"
            dead_count += 1
            dead_bytes += size
        elif found.status == OWNER_ALIVE:
            status = "owner alive"
        else:
            status = f"owner {found.status} (kept)"
        if found.network_fs is not None:
            status += f", on a network file system ({found.network_fs})"
            on_network = on_network or found.status == OWNER_DEAD
        say(f"  {found.path}: pid {found.owner.pid}, {status}, {format_bytes(size)}")
    if dead_count:
        option = ("" if shm == SHM_ROOT else f" --shm {shm}") + (" --network-fs" if on_network else "")
        verdict.problems.append(
            f"{dead_count} folder(s) of dead owners hold {format_bytes(dead_bytes)}. "
            f"Remove them with `python -m memshare clean{option}`."
        )


def _check_internals(say: Callable[[str], None], verdict: Verdict) -> None:
    """Report the private names of other libraries memshare relies on (see ``_compat``)."""
    missing = _compat.failed_checks()
    say(
        f"  internals of joblib, loky, numpy and the standard library: {len(_compat.CHECKS) - len(missing)} of "
        f"{len(_compat.CHECKS)} found"
    )
    for check in missing:
        verdict.problems.append(
            f"{check.name} is missing in the installed versions, so {check.why} no longer holds. Install the "
            "joblib and Python versions README lists as tested, or a memshare release that supports yours."
        )


def run_doctor(shm: str = SHM_ROOT, need: int = 0, say: Callable[[str], None] = print) -> int:
    """Print the report and verdict through ``say``; return 0 when healthy, 1 otherwise."""
    verdict = Verdict()
    in_force = settings_in_force()
    location = choose_location(in_force.settings.temp_folder)
    primary, reason = default_base(in_force.settings.temp_folder)
    fallback = fallback_base(primary)
    say("Mechanism")
    say(f"  {location.reason}")
    if location.in_memory:
        say(f"  (probed in {_memfd.decision().seconds * 1000:.0f} ms; named files only where a memfd cannot be made)")
    say("Settings in force (joblib.parallel_config, then the environment, then the defaults)")
    report_settings(in_force, location, say, verdict.problems, verdict.notes)
    say("Where memshare puts files")
    say(f"  primary:  {primary} (because {reason}), {format_bytes(free_bytes(primary))} free")
    if fallback:
        fallback_free = format_bytes(free_bytes(fallback))
        say(f"  fallback: {fallback} (on disk, used per array when the primary is full), {fallback_free} free")
    elif not os.path.isdir(primary):
        say(f"  fallback: none ({primary} does not exist yet, and no fallback is chosen for a missing base)")
        verdict.notes.append(f"create {primary} beforehand so that memshare can fall back to disk when it is full.")
    else:
        say("  fallback: none (the system temp dir is on the same file system as the primary)")

    limit, limit_source = memory_limit()
    say(f"Shared memory at {shm}")
    _check_shm(shm, need, limit, say, verdict, location.in_memory)
    say(f"  container memory limit: {format_bytes(limit) + ' (' + limit_source + ')' if limit else limit_source}")

    say("memshare folders")
    _check_folders(shm, say, verdict)
    memfds = _memfd_census.live_memfds()
    say("memshare memfds")
    _check_memfds(say, memfds)
    say("Shared memory memshare holds")
    _report_holdings(shm, say, memfds)
    say("Descriptors and loky's named semaphores")  # the descriptor budget, and what dead runs left
    for line in _memfd_census.descriptor_report() + _watchdog.semaphore_report():
        say(f"  {line}")

    say("Versions")
    say(f"  python {platform.python_version()} ({platform.python_implementation()}), {platform.platform()}")
    for name in ("numpy", "joblib"):
        say(f"  {name} {_version(name)}")
    say(f"  loky {_version('joblib.externals.loky')} (bundled with joblib; memshare's workers run on it)")
    say(f"  memshare {_version('memshare')}")
    say(f"  multiprocessing default start method: {multiprocessing.get_start_method()}")
    _check_internals(say, verdict)

    say("Verdict")
    for note in verdict.notes:
        say(f"NOTE: {note}")
    for problem in verdict.problems:
        say(f"PROBLEM: {problem}")
    if verdict.problems:
        return 1
    where = "memfds" if location.in_memory else primary
    say(f"OK: memshare can share arrays through {where}; no leftovers of dead owners.")
    return 0
