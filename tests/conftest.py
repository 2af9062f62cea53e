"""The suite's shared fixtures and helpers, and its check that a run leaves nothing behind.

At the end of the session, :func:`_nothing_left_behind` fails the run if a process the run started
still runs outside the test process's tree (an orphan, which would outlive the run), or if /dev/shm or
the temp dir holds a memshare folder (a name ``memshare clean`` would parse) that appeared during the
run and whose owner is an orphan of this run or died after starting during it. Other programs'
``memshare-*`` entries, folders from before the run and other runs' processes are never counted; a
dead owner cannot say which run it belonged to, so a run beside another on one machine may report the
other's leftovers. Tests that plant folders in their own tmp dir check those themselves;
:func:`_remove_planted_folders` tidies them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from typing import Dict, List, Optional

import joblib
import numpy as np
import pytest

from memshare._lifetime import _memfd
from memshare._lifetime._owners import OWNER_DEAD, Owner, new_folder_name, parse_folder_name, process_start_time

#: The ``return_as`` values of the installed joblib ("generator_unordered" appeared in joblib 1.4).
JOBLIB_VERSION = tuple(int(part) for part in joblib.__version__.split(".")[:2])
RETURN_AS = ("list", "generator") + (("generator_unordered",) if JOBLIB_VERSION >= (1, 4) else ())

#: The environment variables that choose where memshare puts its files, or whether it holds arrays once.
LOCATION_VARIABLES = ("MEMSHARE_TEMP_FOLDER", "JOBLIB_TEMP_FOLDER", "MEMSHARE_MEMFD", "MEMSHARE_PROMOTE")

#: Set when pytest starts (not when a worker imports this module for a task function) and inherited by
#: every process the run starts, since tests build child environments from ``os.environ``: how the leak
#: check tells this run's processes from those of other runs.
RUN_VARIABLE = "MEMSHARE_TESTS_RUN"
#: Where the leak check looks for memshare folders left behind.
LEAK_BASES = ("/dev/shm", tempfile.gettempdir())
#: How long the leak check waits for what is on its way out: watchdogs of owners that just exited
#: remove their folders (and wait up to 10 s for a dead owner's pid), orphaned workers notice their parent died.
LEAK_GRACE = 20.0


@pytest.fixture
def default_location(monkeypatch):
    """No location or holding setting from the environment that runs the tests: memshare chooses itself."""
    for name in LOCATION_VARIABLES:
        monkeypatch.delenv(name, raising=False)


# Named files differ from memfds only in how a file is made and found (os.open in a private folder): the same
# calls on every Python, so their runs are version-independent, while memfds run in every environment.
NAMED = pytest.param("named", marks=pytest.mark.version_independent)


@pytest.fixture(params=["memfd", NAMED])
def mechanism(request):
    """Run a test with each kind of shared memory: memfds (the default on Linux) and named files in /dev/shm."""
    previous = _memfd.decision()
    if request.param == "named":
        _memfd.set_decision_for_tests(False, "tests: named files")
    elif not previous.in_memory:
        pytest.skip(f"memfds are not usable here: {previous.reason}")
    yield request.param
    _memfd.set_decision_for_tests(previous.in_memory, previous.reason)


def without_location_settings(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """A copy of ``env`` (default: this process's environment) without :data:`LOCATION_VARIABLES`."""
    source = os.environ if env is None else env
    return {name: value for name, value in source.items() if name not in LOCATION_VARIABLES}


def total(*arrays) -> float:
    """The sum of every element of ``arrays``: a task that reads its arguments whole."""
    return sum(float(np.asarray(array).sum()) for array in arrays)


def worker_pid(_=None) -> int:
    """The pid of the process that runs it: a task that tells workers apart."""
    return os.getpid()


def alive(pid: int) -> bool:
    """True while ``pid`` runs: it exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """Point memshare at a private folder so tests can inspect what it creates."""
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", str(base))
    return base


#: Runs ``python -m memshare`` in a fresh interpreter whose shared memory root is its first argument.
_CLI_WITH_SHM_ROOT = (
    "import sys; from memshare._lifetime import _location; _location.SHM_ROOT = sys.argv.pop(1); "
    "from memshare.__main__ import main; sys.exit(main())"
)


class PrivateBases:
    """A test's own shared memory root and temp dir, standing for /dev/shm and the system temp dir."""

    def __init__(self, shm: str, tmp: str) -> None:
        self.shm, self.tmp = shm, tmp

    def command(self, *args: str) -> List[str]:
        """``python -m memshare *args``, run with these bases (pass ``self.env()`` as its environment)."""
        return [sys.executable, "-c", _CLI_WITH_SHM_ROOT, self.shm, *args]

    def env(self, base=None) -> Dict[str, str]:
        """The environment for :meth:`command`: no location setting but ``base``, and the private temp dir."""
        env = without_location_settings()
        env["TMPDIR"] = self.tmp
        if base is not None:
            env["MEMSHARE_TEMP_FOLDER"] = str(base)
        return env


def plant_foreign_folders(bases) -> List[str]:
    """Folders named as memshare names them under each of ``bases``, as other programs leave them; their paths.

    Each base gets one of a live owner of this host (this process), one of a live owner of another host,
    and one of a dead owner of this host (another program's leftover, which a sweep may take at any time).
    """
    me = Owner.current()
    child = subprocess.Popen(["sleep", "0"])
    child.wait()
    host = "0123456789" if me.host != "0123456789" else "9876543210"
    owners = (me, Owner(me.pid, me.start, me.namespace, host), Owner(child.pid, 777, me.namespace, me.host))
    planted = []
    for base in bases:
        for owner in owners:
            path = os.path.join(base, new_folder_name(owner))
            os.mkdir(path, 0o700)
            with open(os.path.join(path, "dump-0123456789abcdef.bin"), "wb") as data:
                data.write(b"\1" * 4096)
            planted.append(path)
    return planted


@pytest.fixture
def private_bases(tmp_path, monkeypatch):
    """The tools see only the test's own folders, beside other programs' folders in the real ones.

    ``clean`` and ``doctor`` search /dev/shm and the system temp dir, where other programs (other test
    runs) keep memshare folders, live or dead, that would change what they print. This points memshare's
    shared memory root (a folder on the same tmpfs, so ``doctor`` judges the same file system) and the
    temp dir at the test's own folders, drops the location settings, and plants live and dead foreign
    folders in the real /dev/shm and temp dir for the test's duration, so a test that still looks there
    fails every time rather than now and then.
    """
    for name in LOCATION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    shm = tempfile.mkdtemp(prefix="tests-private-shm-", dir=LEAK_BASES[0])
    tmp = tmp_path / "private-tmp"
    tmp.mkdir()
    planted = plant_foreign_folders(LEAK_BASES)
    for module in ("memshare._lifetime._location", "memshare._tools.cli", "memshare._tools.doctor"):
        monkeypatch.setattr(f"{module}.SHM_ROOT", shm)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    try:
        yield PrivateBases(shm, str(tmp))
    finally:
        for path in planted + [shm]:
            shutil.rmtree(path, ignore_errors=True)


def memshare_entries(base) -> list:
    """Every memshare folder under ``base`` with the files inside it."""
    found = []
    try:
        entries = sorted(os.listdir(base))
    except FileNotFoundError:
        return found
    for entry in entries:
        if entry.startswith("memshare-"):
            path = os.path.join(base, entry)
            try:
                found.append((entry, sorted(os.listdir(path)) if os.path.isdir(path) else None))
            except FileNotFoundError:
                pass  # removed while we looked: a cleanup racing with the check
    return found


def files_under(base) -> list:
    return [f for _, files in memshare_entries(base) for f in (files or [])]


def open_descriptors() -> set:
    """This process's descriptors, each with what it is open on.

    Compared as sets, ``after - before`` is what a test left open: another
    thread closing its own descriptor meanwhile (a finished executor's pipes)
    does not count, and a descriptor number reused for another file does.
    """
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            found.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except OSError:
            continue  # closed meanwhile, or the listing's own descriptor
    return found


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def run_script(code: str, timeout: float = 120, env=None, check=True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; return the completed process."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"script failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


MS_RDONLY = 1  # mount(2) flag


def _mount_tmpfs(path, size: str, flags: int = 0) -> int:
    """Mount a tmpfs of ``size`` at ``path`` with mount(2) ``flags``; return 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", flags, f"size={size}".encode()) != 0:
        return ctypes.get_errno()
    return 0


def mount_small_tmpfs(tmp_path, name: str, size: str, purpose: str):
    """Mount a tmpfs of ``size`` at ``tmp_path / name``, or skip the test saying why (root only)."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {size} tmpfs {purpose} needs root (CI runs as root)")
    mount_point = tmp_path / name
    mount_point.mkdir()
    error = _mount_tmpfs(mount_point, size)
    if error:
        pytest.skip(f"mount not permitted here (errno {error}: {os.strerror(error)})")
    return mount_point


def unmount(mount_point) -> None:
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 MiB tmpfs, like Docker's default /dev/shm (root only; CI runs as root); unmounted afterwards."""
    mount_point = mount_small_tmpfs(tmp_path, "small-shm", "64m", "to simulate Docker's /dev/shm")
    try:
        yield mount_point
    finally:
        unmount(mount_point)


@pytest.fixture(autouse=True)
def _remove_planted_folders(request):
    """After a test, remove memshare-named entries it planted under its tmp_path.

    Some tests create such folders on purpose (a live owner's folder that the
    sweep must keep, a planted symlink). Leak checks assert before this runs,
    so it hides nothing; it keeps pytest's retained tmp dirs free of them.
    """
    root = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if root is None:
        return
    for path in sorted(root.rglob("memshare-*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory this user cannot create anything in, with the error type and errno that creating something raises.

    A 0500 directory for a regular user; root ignores modes, so for root a
    read-only tmpfs (EROFS).
    """
    path = tmp_path / "unwritable"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        try:
            yield path, PermissionError, errno.EACCES
        finally:
            path.chmod(0o700)
        return
    error = _mount_tmpfs(path, "1m", MS_RDONLY)
    if error:
        pytest.skip(f"root ignores folder modes, and mounting a read-only tmpfs failed (errno {error})")
    try:
        yield path, OSError, errno.EROFS
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def mappings_of(addresses) -> list:
    """For each address: (path, permissions) of the mapping of this process that holds it."""
    with open("/proc/self/maps") as maps:
        lines = [line.split(None, 5) for line in maps.read().splitlines()]
    found = []
    for address in addresses:
        for fields in lines:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                found.append((fields[5].strip() if len(fields) > 5 else "", fields[1]))
                break
        else:
            found.append(("", ""))
    return found


def memfds_held(pid="self") -> list:
    """The link targets of the memshare memfds process ``pid`` holds open (one entry per descriptor)."""
    found = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:memshare-"):
            found.append(target)
    return found


def run_with_private_mounts(
    code: str, mounts: dict, timeout: float = 300, extra_env: Optional[dict] = None
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter inside a private mount namespace with tmpfs ``mounts`` (path -> options).

    ``extra_env`` adds environment variables (memshare's own are cleared first).

    Mounts made there are invisible to the rest of the machine and vanish with
    the process. Root only (CI runs as root): skips elsewhere, saying why.
    """
    if os.geteuid() != 0:
        pytest.skip("mounting tmpfs in a private mount namespace needs root (CI runs as root)")
    if shutil.which("unshare") is None:
        pytest.skip("util-linux's unshare is not installed")
    commands = [f"mount -t tmpfs -o {options} tmpfs {path}" for path, options in mounts.items()]
    shell = " && ".join(commands + ['exec "$0" -c "$1"'])
    env = dict(without_location_settings(), TMPDIR="/tmp")
    env.update(extra_env or {})
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m not permitted here: {probe.stderr.decode(errors='replace').strip()}")
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", shell, sys.executable, textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


#: The start of ``_held_memory.mmapped_chunk``'s answers for an array glibc took from its heap, which another
#: array of the same size may not be: tests that need an array held once keep such arrays aside and try again.
HEAP_SERVED = ("not a malloc chunk of its own mapping", "its memory is not a private anonymous mapping")


def made_where_glibc_maps_it(make, unfit, nbytes: int):
    """``make()``'s first object for which ``unfit(obj)`` is None, making more while glibc took them from its heap.

    ``unfit(obj)`` says why ``obj`` cannot be held once (None: it can). glibc serves even a large request from
    heap memory that earlier tests of this process freed, when enough is free there: such an object is rightly not
    held once, and another of the same size may not be there. So one whose reason is ``HEAP_SERVED`` is kept aside
    while another is made: at most 1 GiB of them (``nbytes`` each), and none past the call, so that a failing run
    holds no gigabytes. Fails with the reason when none is fit (at once for a reason other than where glibc put it).
    """
    kept_aside, reason = [], None
    try:
        for _ in range(1024**3 // max(nbytes, 1) + 1):
            made = make()
            reason = unfit(made)
            if reason is None:
                return made
            if not reason.startswith(HEAP_SERVED):
                break  # not where glibc put it: another would fail alike
            kept_aside.append(made)
        del made
    finally:
        kept_aside.clear()
    raise AssertionError(f"nothing of {nbytes} bytes made here could be held once in this process: {reason}")


def array_fit_to_hold(nbytes: int, seed: int = 0):
    """A new ordinary float64 array of about ``nbytes`` that memshare can hold once, in this process as it is now."""
    from memshare._parent import _held_memory, _held_once

    def unfit(array):
        reason = _held_once.unfit_reason(array, "r", None)
        if reason is None:
            return None
        placement = _held_memory.mmapped_chunk(array.ctypes.data, array.nbytes)
        return reason if placement is None else placement  # where glibc put it, when that is the reason

    return made_where_glibc_maps_it(lambda: np.random.default_rng(seed).random(nbytes // 8), unfit, nbytes)


def process_tree(root: int) -> list:
    """``root`` and every process below it (found through /proc), whatever session they moved to."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                ppid = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def pytest_configure(config) -> None:
    os.environ[RUN_VARIABLE] = uuid.uuid4().hex


def pytest_collection_modifyitems(items) -> None:
    """Run the tests of a module that sets ``RUN_GROUPED_BY = "param"`` grouped by that parameter's value.

    joblib's loky backend replaces its workers whenever a call's ``mmap_mode``
    differs from the previous call's; tests that compare with joblib under
    every mode would otherwise start two workers each. The sort is stable:
    within a value, tests keep their order.
    """
    positions = {}
    for index, item in enumerate(items):
        param = getattr(getattr(item, "module", None), "RUN_GROUPED_BY", None)
        spec = getattr(item, "callspec", None)
        if param is not None and spec is not None and param in spec.params:
            positions.setdefault(item.module, []).append(index)
    for module, indexes in positions.items():
        param = module.RUN_GROUPED_BY
        grouped = sorted((items[i] for i in indexes), key=lambda item: str(item.callspec.params[param]))
        for index, item in zip(indexes, grouped):
            items[index] = item


def _carries(pid: int, marker: bytes) -> bool:
    """True when process ``pid`` started with ``marker`` (``NAME=value``) in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return marker in environ.read().split(b"\0")
    except OSError:
        return False  # gone, or not ours to read


def _orphans(marker: bytes) -> List[int]:
    """Running processes of this run that are not below the test process: they would outlive the run."""
    below = set(process_tree(os.getpid()))
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and int(entry) not in below and _carries(int(entry), marker) and alive(int(entry))
    ]


def _memshare_folders() -> Dict[str, Owner]:
    """Every entry of :data:`LEAK_BASES` named like a memshare folder (as ``memshare clean`` parses names)."""
    found = {}
    for base in LEAK_BASES:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            owner = parse_folder_name(name)
            if owner is not None:
                found[os.path.join(base, name)] = owner
    return found


def _left_behind(before: set, session_start: int, orphans: List[int]) -> List[str]:
    """Folders that appeared during the run whose owner is an orphan of this run, or died after starting during it.

    A dead owner's environment can no longer be read: it counts as this run's when it started after the test
    process did. Live owners below the test process (the test process too) remove their folders when they exit.
    """
    left = []
    for path, owner in _memshare_folders().items():
        if path in before or owner.pid == os.getpid():
            continue
        status = owner.status(local=True)
        if (status == OWNER_DEAD and owner.start >= session_start) or owner.pid in orphans:
            left.append(f"{path} (owner pid {owner.pid}: {status})")
    return left


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind():
    """Fail the run if it left a process or a memshare folder behind (see the module docstring); Linux only."""
    if not os.path.isdir("/proc/self"):
        yield
        return
    before = set(_memshare_folders())
    session_start = process_start_time(os.getpid()) or 0
    marker = f"{RUN_VARIABLE}={os.environ[RUN_VARIABLE]}".encode()
    yield
    orphans: List[int] = []
    left: List[str] = []

    def clean() -> bool:
        nonlocal orphans, left
        orphans = _orphans(marker)
        left = _left_behind(before, session_start, orphans)
        return not orphans and not left

    if not wait_until(clean, LEAK_GRACE, interval=0.2):
        commands = {}
        for pid in orphans:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    commands[pid] = cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:160]
            except OSError:
                commands[pid] = "(exited)"
        pytest.fail(
            "the run left behind"
            + "".join(f"\n  process {pid}: {command}" for pid, command in commands.items())
            + "".join(f"\n  folder {entry}" for entry in left),
            pytrace=False,
        )
