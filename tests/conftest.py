"""Shared fixtures: an isolated temp location per test, and leak checks."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Optional

import joblib
import pytest

#: The ``return_as`` values of the installed joblib ("generator_unordered" appeared in joblib 1.4).
JOBLIB_VERSION = tuple(int(part) for part in joblib.__version__.split(".")[:2])
RETURN_AS = ("list", "generator") + (("generator_unordered",) if JOBLIB_VERSION >= (1, 4) else ())


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """Point memshare at a private folder so tests can inspect what it creates."""
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", str(base))
    return base


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
    """A 64 MB tmpfs, like Docker's default /dev/shm (root only; CI runs as root)."""
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
    env = dict(os.environ, TMPDIR="/tmp")
    for name in ("MEMSHARE_TEMP_FOLDER", "JOBLIB_TEMP_FOLDER", "MEMSHARE_MEMFD", "MEMSHARE_PROMOTE"):
        env.pop(name, None)
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


def array_fit_to_hold(nbytes: int, seed: int = 0):
    """A new ordinary float64 array of about ``nbytes`` that memshare can hold once, in this process as it is now.

    Whether an array can be held once also depends on where glibc put it (a mapping of its own, not heap memory
    freed by earlier tests); arrays that do not qualify are kept aside while another is made. Fails with the reason
    when none qualifies, so that a test depending on holding once says why it could not.
    """
    import numpy as np

    from memshare import _promotion

    kept_aside, reason = [], None
    for _ in range(16):
        array = np.random.default_rng(seed).random(nbytes // 8)
        reason = _promotion.unfit_reason(array, "r", None)
        if reason is None:
            return array
        kept_aside.append(array)
    raise AssertionError(f"no array of {nbytes} bytes could be held once in this process: {reason}")


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
