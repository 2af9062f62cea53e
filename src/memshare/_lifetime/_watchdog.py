"""A tiny helper process that deletes a process's folders when it dies.

``atexit`` handlers and finalizers do not run when a process is SIGKILLed (the
OOM killer's signal) or crashes, and files in ``/dev/shm`` then hold RAM until
reboot. So the first time a process creates a memshare folder, it starts this
script as a child with a pipe on its stdin, and tells it each folder it creates
or removes. When the pipe reaches end-of-file, whatever the reason the owner
stopped, the watchdog removes the folders still registered and exits.

This file runs as a plain script under ``python -I`` and uses the standard
library only: it must start fast and must not import the owner's packages.
It reads ``/proc`` through ``_procfs``, a standard-library module it loads
from its own folder by path when it runs as a script.
Paths travel hex-encoded, one per line, so that any byte string (non-ASCII,
spaces, newlines, hundreds of characters) survives the protocol.

Besides memshare's folders, a dead owner leaves the named semaphores loky
made in its name (``/dev/shm/sem.loky-<pid>-<8 random characters>``, from
loky's ``SemLock._make_name``): loky unlinks them when the process exits
normally, and nobody does when it is killed. The owner says goodbye (a ``.``
line) before closing the pipe at a normal exit; an end-of-file without it
means the owner died, and once its pid is gone (or a zombie of the same
process) the watchdog removes those semaphores too
(:func:`remove_loky_semaphores`, which the sweep of dead owners and
``python -m memshare clean`` use as well). Removing a semaphore's name never
disturbs a process that has it open (workers still running keep theirs).

loky's resource tracker would unlink them as well, once the last process
holding its pipe (the owner and every worker) is gone, and warn about each,
or about each it found already gone. So the owner does not register its
semaphores with the tracker while its watchdog runs (``_temp_folder``), and
tells the watchdog the tracker's pid (a ``t`` line): the watchdog waits for
the tracker to exit, which means no worker, not even one still starting and
yet to open them by name, needs the semaphores any more, before it removes
them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from typing import IO, Dict, List, Optional, Tuple

try:
    from . import _procfs
except ImportError:  # run as a script (no package): the module next to this file, by its path
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "memshare_procfs", os.path.join(os.path.dirname(os.path.abspath(__file__)), "_procfs.py")
    )
    _procfs = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_procfs)

#: Where loky's named semaphores show up (glibc names them ``/dev/shm/sem.<name>``).
SEMAPHORE_DIR = "/dev/shm"
#: loky's SemLock._make_name: "/loky-<pid>-<8 of tempfile's random characters>".
_LOKY_SEMAPHORE = re.compile(r"^sem\.loky-([0-9]+)-[a-z0-9_]{8}$")
#: How long the watchdog waits for a dead owner's pid to be gone before leaving its semaphores.
OWNER_EXIT_WAIT = 10.0


def _process_state(pid: int) -> Optional[Tuple[str, int]]:
    """(state letter, start time) of ``pid`` from ``/proc``; None when there is no such process."""
    try:
        return _procfs.process_stat(pid)
    except OSError:
        return None


def pid_is_gone(pid: int) -> bool:
    """True when no process runs with ``pid`` in this pid namespace: none has it, or a zombie (dead, unreaped)."""
    state = _process_state(pid)
    if state is not None:
        return state[0] in ("Z", "X")
    try:
        os.kill(pid, 0)  # /proc may be unreadable: ask the kernel
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def loky_semaphores(pid: Optional[int] = None) -> List[str]:
    """Paths of loky's named semaphores of this user, all or only those named after ``pid``.

    Only regular files owned by this user whose name is exactly loky's
    pattern: nothing else in the folder is ever listed.
    """
    try:
        names = os.listdir(SEMAPHORE_DIR)
    except OSError:
        return []
    found = []
    for name in sorted(names):
        match = _LOKY_SEMAPHORE.match(name)
        if match is None or (pid is not None and int(match.group(1)) != pid):
            continue
        path = os.path.join(SEMAPHORE_DIR, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            found.append(path)
    return found


def semaphore_pid(path: str) -> Optional[int]:
    """The pid a loky semaphore's name carries; None for any other name."""
    match = _LOKY_SEMAPHORE.match(os.path.basename(path))
    return int(match.group(1)) if match else None


def remove_loky_semaphores(pid: int, dry_run: bool = False) -> List[str]:
    """Unlink the named semaphores loky made for the dead process ``pid``; return those removed.

    Nothing is removed while a process has that pid: a dead owner's pid
    reused by a live process (which may have made semaphores of its own)
    cannot be told apart by name. ``unlink`` removes the name only, and a
    symbolic link at the name is removed itself, never followed.
    """
    if pid <= 0 or not pid_is_gone(pid):
        return []
    removed = []
    for path in loky_semaphores(pid):
        if not dry_run:
            try:
                os.unlink(path)
            except OSError:
                continue
        removed.append(path)
    return removed


def semaphore_report() -> List[str]:
    """Lines for the doctor: loky's named semaphores left by processes that are gone, by pid."""
    by_pid: dict = {}
    for path in loky_semaphores():
        pid = semaphore_pid(path)
        if pid is not None and pid_is_gone(pid):
            by_pid.setdefault(pid, []).append(path)
    if not by_pid:
        return ["no named semaphores of loky left by dead processes"]
    return [
        f"{SEMAPHORE_DIR}/sem.loky-{pid}-*: {len(paths)} named semaphore(s) of loky left by dead pid {pid} "
        "(`python -m memshare clean` removes those of memshare's dead owners)"
        for pid, paths in sorted(by_pid.items())
    ]


def _wait_for_owner_exit(owner: int, start: Optional[int]) -> bool:
    """Wait until the process ``owner`` (started at ``start``) is gone; True when it is, False if replaced or slow.

    A zombie of the same process is gone for this purpose: it runs no more
    code, and its parent may take any time to reap it.
    """
    deadline = time.monotonic() + OWNER_EXIT_WAIT
    while True:
        state = _process_state(owner)
        if state is None:
            return True
        if start is not None and state[1] != start:
            return False  # the pid names another process now: its semaphores may be its own
        if state[0] in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _wait_for_trackers(trackers: Dict[int, int], deadline: float) -> None:
    """Wait until each loky tracker (pid -> start time) has exited or the pid names another process, or ``deadline``."""
    for pid, start in trackers.items():
        while True:
            state = _process_state(pid)
            if state is None or state[1] != start or state[0] in ("Z", "X") or time.monotonic() > deadline:
                break
            time.sleep(0.02)


def _serve(stream: IO[bytes], owner: int = 0, start: Optional[int] = None) -> None:
    """Track registrations from ``stream``; clean up at its end-of-file.

    ``owner`` is the pid of the process being watched (0: unknown) and
    ``start`` its start time, read when the watchdog started.
    """
    registered: set[bytes] = set()
    trackers: Dict[int, int] = {}  # loky's resource trackers of the owner: pid -> start time
    said_goodbye = False
    for line in stream:
        line = line.strip()
        if not line:
            continue
        action, path = line[:1], bytes.fromhex(line[1:].decode("ascii"))
        if action == b"+":
            registered.add(path)
        elif action == b"-":
            registered.discard(path)
        elif action == b".":
            said_goodbye = True
        elif action == b"t" and path.isdigit():
            state = _process_state(int(path))  # read now, while the owner keeps the tracker running
            if state is not None:
                trackers[int(path)] = state[1]
    # The owner died (no goodbye): its semaphores go first, once its pid is gone (a
    # moment after the pipe closed), and its folders last, so that a watchdog killed
    # in between leaves a folder by which ``python -m memshare clean`` finds the owner.
    if owner > 0 and not said_goodbye and _wait_for_owner_exit(owner, start):
        # The tracker exits once the owner's workers are gone: none of them can still need a semaphore.
        _wait_for_trackers(trackers, time.monotonic() + OWNER_EXIT_WAIT)
        remove_loky_semaphores(owner)
    for path in registered:
        # Only a directory of this user: a folder (or symlink) another user
        # planted at one of the registered names, which the owner passed
        # over, is theirs. rmtree never follows a symlink out of the tree.
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)


class WatchdogClient:
    """The owner's end of the pipe to a watchdog process.

    Thread-safe. If the watchdog cannot be started (no ``fork``, no
    executable), the client degrades to doing nothing: in-process cleanup and
    the sweep of dead owners' folders still apply.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: Optional[subprocess.Popen] = None
        self._pid = -1  # the owner pid the running watchdog belongs to

    def register(self, path: str) -> None:
        self._send(b"+", path)

    def unregister(self, path: str) -> None:
        self._send(b"-", path, start=False)

    def watch_tracker(self, pid: int) -> None:
        """Have the watchdog wait for loky's resource tracker ``pid`` before it removes the owner's semaphores."""
        self._send(b"t", str(pid))

    def running(self) -> bool:
        """True while this process's watchdog runs (started, if it was not, by a registration).

        Without the lock: loky calls it as it makes a semaphore, and a
        collection there may run a finalizer that sends a message (see
        ``_temp_folder``), which takes the lock.
        """
        process = self._current()
        return process is not None and process.poll() is None

    def start(self) -> bool:
        """Start the watchdog if it is not running; True when it runs."""
        with self._lock:
            return self._ensure_started() is not None

    def _send(self, action: bytes, path: str, start: bool = True) -> None:
        message = action + os.fsencode(path).hex().encode("ascii") + b"\n"
        with self._lock:
            process = self._ensure_started() if start else self._current()
            if process is None:
                return
            try:
                process.stdin.write(message)
                process.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                # The watchdog died: the next registration starts a new one, which
                # knows only the folders registered from then on; should the owner
                # be killed, the others are left to the sweep of dead owners' folders.
                self._process = None

    def close(self) -> None:
        """Close the pipe and let the watchdog exit (at interpreter exit)."""
        with self._lock:
            process = self._current()
            self._process = None
        if process is None:
            return
        try:
            # A normal exit: loky removes its own semaphores, and this process is still running.
            process.stdin.write(b".\n")
        except (OSError, ValueError):
            pass
        try:
            process.stdin.close()
            process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def forget_after_fork(self) -> None:
        """In a forked child: drop the inherited pipe without signalling EOF.

        The parent still holds its own end, so closing ours only stops the
        child from keeping the parent's watchdog waiting after the parent dies.
        """
        process, self._process = self._process, None
        self._lock = threading.Lock()
        if process is not None and process.stdin is not None:
            try:
                process.stdin.close()  # unbuffered: closes this fd copy only
            except OSError:
                pass
            # The Popen object of the parent's child must not be waited on here.
            process.returncode = 0

    def _current(self) -> Optional[subprocess.Popen]:
        # A forked child inherits the parent's pipe; that watchdog belongs to
        # the parent, so the child must never write to it.
        if self._pid != os.getpid():
            return None
        return self._process

    def _ensure_started(self) -> Optional[subprocess.Popen]:
        process = self._current()
        if process is not None and process.poll() is None:
            return process
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                # Unbuffered: each message is one write(), so a fork in another
                # thread can never copy a half-sent line into the child.
                bufsize=0,
                # Its own session: Ctrl-C in the owner's terminal must not kill
                # the process that cleans up after an interrupted owner.
                start_new_session=True,
            )
        except OSError:
            self._process = None
            return None
        self._pid = os.getpid()
        return self._process


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    watched = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0
    # The owner's start time now, while it is surely alive (it just started this process).
    watched_state = _process_state(watched) if watched > 0 else None
    _serve(sys.stdin.buffer, watched, watched_state[1] if watched_state else None)
