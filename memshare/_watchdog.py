"""A tiny helper process that deletes a process's folders when it dies.

``atexit`` handlers and finalizers do not run when a process is SIGKILLed (the
OOM killer's signal) or crashes, and files in ``/dev/shm`` then hold RAM until
reboot. So the first time a process creates a memshare folder, it starts this
script as a child with a pipe on its stdin, and tells it each folder it creates
or removes. When the pipe reaches end-of-file, whatever the reason the owner
stopped, the watchdog removes the folders still registered and exits.

This file runs as a plain script under ``python -I`` and uses the standard
library only: it must start fast and must not import the owner's packages.
Paths travel hex-encoded, one per line, so that any byte string (non-ASCII,
spaces, newlines, hundreds of characters) survives the protocol.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
from typing import IO, Optional


def _serve(stream: IO[bytes]) -> None:
    """Track registrations from ``stream``; clean up at its end-of-file."""
    registered: set[bytes] = set()
    for line in stream:
        line = line.strip()
        if not line:
            continue
        action, path = line[:1], bytes.fromhex(line[1:].decode("ascii"))
        if action == b"+":
            registered.add(path)
        elif action == b"-":
            registered.discard(path)
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
                # The watchdog died: start a new one next time, re-registering is
                # the caller's job only for new folders; old ones fall to sweeping.
                self._process = None

    def close(self) -> None:
        """Close the pipe and let the watchdog exit (at interpreter exit)."""
        with self._lock:
            process = self._current()
            self._process = None
        if process is None:
            return
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
                [sys.executable, "-I", os.path.abspath(__file__)],
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
    _serve(sys.stdin.buffer)
