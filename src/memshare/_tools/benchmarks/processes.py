"""The harness's side of a contender's own process (see ``_contender.py`` for the other side)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Tuple

from .memory import MemorySampler

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_contender.py")


class ContenderError(RuntimeError):
    """The contender's process failed; the message holds its traceback."""


class ContenderDied(ContenderError):
    """The contender's process died (a signal, the OOM killer's SIGKILL say): the run can go on without it."""

    def __init__(self, name: str, returncode: int) -> None:
        self.name, self.returncode = name, returncode
        super().__init__(f"the {name} process {describe_exit(returncode)}")


def describe_exit(returncode: int) -> str:
    """``returncode`` of a process in words: the signal that killed it, by name, or its exit status."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if -returncode == signal.SIGKILL:
        return f"was killed by {name} (when memory runs out, the kernel's OOM killer sends SIGKILL: see `dmesg`)"
    return f"was killed by {name}"


class ContenderProcess:
    """A fresh interpreter running one contender on one workload; ``close()`` ends it."""

    def __init__(self, name: str) -> None:
        self.name = name
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [sys.executable, _SCRIPT, name, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
            )
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        #: The memory over time of the last :meth:`measure` (see ``MemorySampler.trace``).
        self.last_trace: List[Tuple[float, int]] = []

    @property
    def pid(self) -> int:
        return self._process.pid

    def _ask(self, message: tuple, expect: str) -> tuple:
        try:
            self._conn.send(message)
            answer = self._conn.recv()
        except (EOFError, OSError):  # the process is gone: EOF, or a broken pipe / reset while sending
            raise ContenderDied(self.name, self._exit_status()) from None
        if answer[0] == "error":
            raise ContenderError(f"the {self.name} process failed:\n{answer[1]}")
        if answer[0] != expect:
            raise ContenderError(f"the {self.name} process answered {answer!r}, expected {expect!r}")
        return answer

    def prepare(self, key: str, size: int, quick: bool) -> int:
        """Build the workload's data in the process; return what a pickling contender would copy per call."""
        return self._ask(("prepare", key, size, quick), "prepared")[1]

    def measure(
        self, n_jobs: int, memory_mode: str, operation: str = ""
    ) -> Tuple[float, int, int, bool, Dict[str, Any], bool]:
        """One timed run (of ``operation``, for a workload that has several): (seconds, peak extra bytes of the
        process tree, extra bytes still held once the call returned, correct, memshare figures, whether the
        process imported memshare)."""
        self._ask(("measure", n_jobs, operation), "ready")
        with MemorySampler(self.pid, mode=memory_mode) as sampler:
            seconds = self._ask(("go",), "done")[1]
        _, correct, stats, imported = self._ask(("sampled",), "measured")
        self.last_trace = sampler.trace
        return seconds, sampler.peak_extra_bytes, sampler.end_extra_bytes, correct, stats, imported

    def _exit_status(self) -> int:
        """The exit status of a process whose socket closed; killed if it lingers without its socket."""
        try:
            return self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            return self._process.wait()

    def close(self) -> None:
        """Ask the process to quit; kill it if it does not within a minute."""
        try:
            self._conn.send(("quit",))
        except OSError:
            pass  # already gone
        self._conn.close()
        try:
            self._process.wait(60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
