"""An owner in another time namespace is never judged dead.

The start time in ``/proc/<pid>/stat`` is read through the reader's time
namespace: a process started under ``unshare --time --boottime N`` records a
start N seconds later than the one other processes read for it. The sweep of
dead owners (run by every process's first folder, and by ``python -m memshare
clean``) took that difference for a recycled pid and removed a live job's
folders. Making a time namespace needs root; the test is skipped elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import wait_until, without_location_settings

from memshare._lifetime import _owners
from memshare._lifetime._owners import OWNER_ALIVE, OWNER_DEAD, Owner, parse_folder_name
from memshare._lifetime._sweep import find_folders, sweep_dead_owners

# Version-independent (folder ownership across Linux time namespaces: the kernel and memshare alone): run in CI's
# whole-suite environment (main) only.
pytestmark = pytest.mark.version_independent

# A job that makes its folders (a session's, for a call that dumps, and the shared-array store's), says where
# they are, waits for a line on stdin, then makes another call with the same data and exits.
JOB = """
import sys
import numpy as np
import memshare
from memshare import Parallel, delayed

def total(x):
    return float(x.sum())

data = np.ones(200_000)
shared = memshare.share(np.ones(100_000))
with Parallel(n_jobs=2, max_nbytes="1K") as parallel:
    assert parallel(delayed(total)(data) for _ in range(2)) == [200_000.0] * 2
    print("ready", flush=True)
    sys.stdin.readline()
    assert parallel(delayed(total)(data) for _ in range(2)) == [200_000.0] * 2
    assert parallel(delayed(total)(shared) for _ in range(2)) == [100_000.0] * 2
print("OK", flush=True)
"""

OFFSETS = [
    pytest.param(["--boottime", "100000", "--monotonic", "100000"], id="boottime-and-monotonic"),
    pytest.param(["--boottime", "100000"], id="boottime"),
    pytest.param(["--monotonic", "100000"], id="monotonic"),
    pytest.param([], id="no-offset"),
]


def _can_make_time_namespaces() -> str:
    """Why this machine cannot run a process in a new time namespace ('' when it can)."""
    if os.geteuid() != 0:
        return "making a time namespace (unshare --time) needs root"
    if shutil.which("unshare") is None:
        return "no unshare command"
    if not os.path.exists("/proc/self/ns/time"):
        return "this kernel has no time namespaces"
    probe = subprocess.run(["unshare", "--time", "--boottime", "1", "true"], capture_output=True, timeout=30)
    return "" if probe.returncode == 0 else f"unshare --time fails here: {probe.stderr.decode(errors='replace')}"


WHY_NOT = _can_make_time_namespaces()


def _folders_of(pid: int, base: str) -> list:
    return sorted(name for name in os.listdir(base) if name.startswith(f"memshare-{pid}-"))


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "-")
@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "named-files"])
@pytest.mark.parametrize("offsets", OFFSETS)
def test_a_job_in_a_time_namespace_keeps_its_folders(tmp_path, offsets, memfd):
    if memfd:
        # memfds need no folder of the user's choosing; the session's folder (for its result socket) is in /dev/shm.
        base = "/dev/shm"
        env = without_location_settings()
    else:
        base = str(tmp_path / "base")
        os.mkdir(base)
        env = {**without_location_settings(), "MEMSHARE_TEMP_FOLDER": base}
    log = tmp_path / "stderr.txt"
    with open(log, "w") as errors:
        # stderr to a file: the job's workers inherit it, and a pipe would keep the test waiting for them.
        job = subprocess.Popen(
            ["unshare", "--time", *offsets, sys.executable, "-c", textwrap.dedent(JOB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
        )
    try:
        assert job.stdout.readline().strip() == "ready", log.read_text()
        folders = _folders_of(job.pid, base)
        assert folders, "the job made no folder"
        owner = parse_folder_name(folders[0])
        assert owner is not None and owner.pid == job.pid
        # What another process (a new job's first folder, or `memshare clean`) says of the live job.
        assert owner.status(local=True) == OWNER_ALIVE
        found = [f.status for f in find_folders([base]) if f.owner.pid == job.pid]
        assert found == [OWNER_ALIVE] * len(folders)
        # Only dead owners' folders go: the job's stay, and its calls go on.
        sweep_dead_owners([base])
        assert _folders_of(job.pid, base) == folders
        job.stdin.write("go\n")
        job.stdin.flush()
        assert job.stdout.readline().strip() == "OK", log.read_text()
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
        job.wait(timeout=30)
        job.stdin.close()
        job.stdout.close()
    assert job.returncode == 0, log.read_text()
    assert wait_until(lambda: _folders_of(job.pid, base) == [], 15), _folders_of(job.pid, base)


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "-")
def test_a_recycled_pid_in_another_time_namespace_is_still_judged_dead():
    """The start time is compared across namespaces, not given up on: another process at the pid is not the owner."""
    sleeper = subprocess.Popen(["unshare", "--time", "--boottime", "100000", "sleep", "60"])
    try:
        assert wait_until(lambda: _owners.process_start_time(sleeper.pid) is not None, 10)
        assert wait_until(lambda: os.readlink(f"/proc/{sleeper.pid}/ns/time") != os.readlink("/proc/self/ns/time"), 10)
        here = Owner.current()
        start = _owners.process_start_time(sleeper.pid)
        # Started 100000 s later in its own clock: that is what it records as its own start.
        assert Owner(sleeper.pid, start + 100000 * os.sysconf("SC_CLK_TCK"), here.namespace, here.host).is_alive()
        assert Owner(sleeper.pid, start, here.namespace, here.host).status() == OWNER_DEAD
        assert Owner(sleeper.pid, start - 50, here.namespace, here.host).status() == OWNER_DEAD
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/time"), reason="this kernel has no time namespaces")
def test_an_owner_whose_clock_cannot_be_compared_is_kept(monkeypatch):
    """When the other process's time namespace cannot be read, a different start time proves nothing."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        start = _owners.process_start_time(child.pid)
        here = Owner.current()
        owner = Owner(child.pid, start + 12345, here.namespace, here.host)
        monkeypatch.setattr(_owners, "_time_namespace", lambda pid: None if pid == child.pid else 1)
        assert owner.status() == OWNER_ALIVE
        monkeypatch.setattr(_owners, "_time_namespace", lambda pid: 1)  # the same namespace: a recycled pid
        assert owner.status() == OWNER_DEAD
    finally:
        child.kill()
        child.wait()
