"""Peak extra memory of a process tree, sampled from a separate process.

Why this measure: RSS counts every shared page once per process that maps it
and misses files in ``/dev/shm`` entirely, and ``MemFree`` swings by hundreds of
MB from run to run on shared machines. The sum of ``RssAnon`` (private,
anonymous memory) over the process tree plus the machine's ``Shmem`` (tmpfs and
shared memory pages) counts each byte of data once wherever it lives.

The sampler runs in its own process (spawn context) so that sampling goes on
while the measured process is busy in C code holding the GIL.

Usage::

    with MemorySampler(os.getpid()) as sampler:
        work()
    print(sampler.peak_extra_bytes)
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import List, Optional

import psutil

DEFAULT_INTERVAL = 0.02


def read_rss_anon(pid: int) -> int:
    """``RssAnon`` of one process in bytes (0 if it is gone or has no such line)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def read_shmem() -> int:
    """The machine's ``Shmem`` from ``/proc/meminfo`` in bytes."""
    with open("/proc/meminfo", "rb") as meminfo:
        for line in meminfo:
            if line.startswith(b"Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_pids(root_pid: int, exclude: int) -> List[int]:
    """The root pid and all its descendants, without ``exclude`` (the sampler itself)."""
    try:
        root = psutil.Process(root_pid)
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [root_pid] + [child.pid for child in children if child.pid != exclude]


def sample_once(root_pid: int, exclude: int = -1) -> int:
    """One sample: sum of ``RssAnon`` over the tree plus the machine's ``Shmem``."""
    return sum(read_rss_anon(pid) for pid in tree_pids(root_pid, exclude)) + read_shmem()


def _sampler_main(root_pid: int, interval: float, conn) -> None:
    """Body of the sampler process: baseline, then sample until told to stop."""
    me = os.getpid()
    baseline = sample_once(root_pid, me)
    peak = baseline
    samples = 1
    conn.send(("ready", baseline))
    while not conn.poll(interval):
        value = sample_once(root_pid, me)
        samples += 1
        if value > peak:
            peak = value
    conn.recv()
    # One last sample so that a peak at the very end is not missed.
    peak = max(peak, sample_once(root_pid, me))
    conn.send(("done", baseline, peak, samples + 1))
    conn.close()


class MemorySampler:
    """Context manager measuring peak extra memory of ``root_pid``'s process tree.

    After the ``with`` block, ``baseline_bytes``, ``peak_bytes``,
    ``peak_extra_bytes`` (peak minus baseline, never negative) and ``samples``
    are set. The baseline is taken before ``__enter__`` returns.
    """

    def __init__(self, root_pid: Optional[int] = None, interval: float = DEFAULT_INTERVAL) -> None:
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self.interval = interval
        self.baseline_bytes = 0
        self.peak_bytes = 0
        self.peak_extra_bytes = 0
        self.samples = 0
        self._process = None
        self._conn = None

    def __enter__(self) -> MemorySampler:
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(
            target=_sampler_main, args=(self.root_pid, self.interval, child_conn), name="memshare-bench-sampler"
        )
        self._process.daemon = True
        self._process.start()
        child_conn.close()
        self._conn = parent_conn
        if not parent_conn.poll(60):
            self._stop_process()
            raise RuntimeError("memory sampler did not start within 60 s")
        _, self.baseline_bytes = parent_conn.recv()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._conn.send("stop")
            if self._conn.poll(60):
                _, self.baseline_bytes, self.peak_bytes, self.samples = self._conn.recv()
                self.peak_extra_bytes = max(0, self.peak_bytes - self.baseline_bytes)
        finally:
            self._stop_process()

    def _stop_process(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
            self._process = None


def measure_peak(func, *args, interval: float = DEFAULT_INTERVAL, **kwargs):
    """Run ``func(*args, **kwargs)`` under a sampler; return ``(result, peak_extra_bytes)``."""
    with MemorySampler(os.getpid(), interval) as sampler:
        result = func(*args, **kwargs)
    return result, sampler.peak_extra_bytes
