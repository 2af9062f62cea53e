"""A killed owner, or a forked child that ends without exiting normally, leaves nothing for loky's tracker to say.

loky's resource tracker unlinks, when the last process holding its pipe is
gone, the named semaphores still registered with it, and warns about each.
memshare's watchdog removes a dead owner's loky semaphores too (the tracker
may be killed with the owner): the tracker then found them gone and printed a
``FileNotFoundError`` warning for each, nine lines a run, and a worker still
starting could not open them. Every process of the run writes its stderr
into one file, read once no process holds it open any more.

A child forked without ``multiprocessing`` shares its parent's tracker
(before Python 3.15) without knowing its pid: its watchdog learns the pid
from the tracker's pipe, or it would remove the semaphores at once, while
the child's workers still starting need them (loky prints their traceback
on stdout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import wait_until, without_location_settings

NOISE = ("resource_tracker", "leaked", "FileNotFoundError", "KeyError", "Traceback", "Warning")

KILLED_OWNER = """
import os, sys, time
import numpy as np
from memshare import Parallel, delayed

def pid_of_worker(x):
    return os.getpid()

if __name__ == "__main__":
    with Parallel(n_jobs=2, max_nbytes="1K") as parallel:
        parallel(delayed(pid_of_worker)(np.ones(1000)) for _ in range(4))
        print("ready", flush=True)
        time.sleep(600)
"""

FORKED_CHILD = """
import os, sys, warnings
import numpy as np
from memshare import Parallel, delayed

# Python 3.12+ warns that this script's own os.fork() runs in a process with threads: the script's
# doing, not memshare's, and not the noise this test looks for.
warnings.filterwarnings("ignore", message=r".*multi-threaded.*fork", category=DeprecationWarning)

def total(x):
    return float(x.sum())

if __name__ == "__main__":
    assert Parallel(n_jobs=2, max_nbytes="1K")(delayed(total)(np.ones(1000)) for _ in range(4)) == [1000.0] * 4
    child = os.fork()
    if child == 0:
        # A child that ends as multiprocessing's do, without the interpreter's exit handlers, while
        # most of its six workers are still starting: they open loky's semaphores by name as they do.
        result = Parallel(n_jobs=6, max_nbytes="1K")(delayed(total)(np.ones(1000)) for _ in range(4))
        os._exit(0 if result == [1000.0] * 4 else 1)
    _, status = os.waitpid(child, 0)
    print("child", child, os.waitstatus_to_exitcode(status), flush=True)
"""


def _holders(path: str) -> list:
    """Pids of the processes that have ``path`` open."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def _named_after(pid: int) -> list:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith((f"sem.loky-{pid}-", f"memshare-{pid}-")))


def _run(tmp_path, code: str, kill: bool) -> tuple:
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(code))
    log = tmp_path / "stderr.txt"
    with open(log, "w") as errors:
        process = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=without_location_settings(),
            start_new_session=True,
        )
    stdout = ""
    try:
        # Up to the line that reports ("ready", "child ..."), which another process's output may precede;
        # reading to the end would wait for every process that inherited the pipe.
        for line in iter(process.stdout.readline, ""):
            stdout += line
            if line.startswith(("ready", "child ")):
                break
        if kill:
            assert stdout.splitlines()[-1:] == ["ready"], log.read_text()
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=120)
        # The tracker, the workers and the watchdog outlive the owner for a moment; all of them are done once
        # no process holds the log (the watchdog writes nowhere, but removes the semaphores before it exits).
        assert wait_until(lambda: not _holders(str(log)), 60), _holders(str(log))
        stdout += _rest_of(process.stdout)  # what a worker printed after the report (loky: a failed start)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
    return process, stdout, log.read_text()


def _rest_of(pipe) -> str:
    """What is left to read in ``pipe`` now, without waiting for a writer that may still hold it."""
    os.set_blocking(pipe.fileno(), False)
    chunks = []
    while True:
        try:
            chunk = os.read(pipe.fileno(), 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="loky's named semaphores live in /dev/shm")
def test_a_killed_owner_leaves_loky_nothing_to_report(tmp_path):
    process, stdout, stderr = _run(tmp_path, KILLED_OWNER, kill=True)
    assert wait_until(lambda: _named_after(process.pid) == [], 30), _named_after(process.pid)
    found = [word for word in NOISE if word in stderr + stdout]
    assert not found, f"the output mentions {found}:\n{stdout}\n{stderr}"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="loky's named semaphores live in /dev/shm")
def test_a_forked_child_that_ends_abruptly_leaves_loky_nothing_to_report(tmp_path):
    process, stdout, stderr = _run(tmp_path, FORKED_CHILD, kill=False)
    reports = [line.split() for line in stdout.splitlines() if line.startswith("child ")]
    assert process.returncode == 0 and len(reports) == 1 and reports[0][2:] == ["0"], (stdout, stderr)
    child = int(reports[0][1])
    assert wait_until(lambda: _named_after(child) == [] and _named_after(process.pid) == [], 30)
    found = [word for word in NOISE if word in stderr + stdout]
    assert not found, f"the output mentions {found}:\n{stdout}\n{stderr}"
