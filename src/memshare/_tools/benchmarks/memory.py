"""Peak extra memory of a process tree, sampled from a separate process.

Why this measure: RSS counts every shared page once per process that maps it
and misses files in ``/dev/shm`` entirely, and ``MemFree`` swings by hundreds of
MB from run to run on shared machines. The sum of ``RssAnon`` (private,
anonymous memory) over the process tree plus the machine's ``Shmem`` (tmpfs and
shared memory pages) counts each byte of data once wherever it lives.

Two modes. ``"machine"`` adds the machine's ``Shmem`` (``/proc/meminfo``),
which counts every tmpfs and shared-memory page of the machine once; on a
machine shared with other sessions it moves with their files too, and a
previous call's files deleted during a run make the next contender look
smaller. ``"tree"`` (the default) adds only the
``/dev/shm`` files of the tree (named after one of its pids, or mapped or open
in one of its processes) that were not there at the baseline.

The sampler runs in its own process (this file, as a subprocess) so that sampling goes on
while the measured process is busy in C code holding the GIL.

Usage::

    with MemorySampler(os.getpid()) as sampler:
        work()
    print(sampler.peak_extra_bytes)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import psutil

DEFAULT_INTERVAL = 0.02
#: "Extra after return" is sampled until this many consecutive samples agree within SETTLE_TOLERANCE bytes...
SETTLE_SAMPLES = 8
SETTLE_TOLERANCE = 2 << 20
#: ...or for at most this many seconds after the call returned.
SETTLE_SECONDS = 2.0
SHM_DIR = "/dev/shm"
MEMFD_PREFIX = "/memfd:"  # how memfds show in /proc/PID/maps and as /proc/PID/fd links
FileKey = Tuple[int, int, str]


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
    """One sample in ``"machine"`` mode: sum of ``RssAnon`` over the tree plus the machine's ``Shmem``."""
    return sum(read_rss_anon(pid) for pid in tree_pids(root_pid, exclude)) + read_shmem()


def _pid_in_name(name: str, pids: Set[str]) -> bool:
    return any(token in pids for token in re.split(r"[-_.]", name))


def tree_shm_files(pids: List[int], shm_dir: str = SHM_DIR) -> Dict[FileKey, int]:
    """Files in ``shm_dir`` and memfds that belong to the tree: ``(dev, inode, path) -> allocated bytes``.

    A file belongs to the tree when a top-level entry's name carries one of the
    tree's pids as a token (joblib's ``joblib_memmapping_folder_<pid>_...``,
    memshare's ``memshare-<pid>-...``, loky's ``sem.loky-<pid>-...``) or when a
    tree process maps it or holds it open (``/proc/PID/maps`` and ``fd``).
    memfds (memshare's default on Linux) have no folder: they count when a
    tree process maps them or holds them open.
    """
    files: Dict[FileKey, int] = {}

    def add(path: str, name: Optional[str] = None) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return
        # The path is part of the key because tmpfs reuses the inode numbers of deleted files.
        files[(st.st_dev, st.st_ino, name or path)] = st.st_blocks * 512

    pid_tokens = {str(pid) for pid in pids}
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        entries = []
    for entry in entries:
        if not _pid_in_name(entry.name, pid_tokens):
            continue
        if entry.is_dir(follow_symlinks=False):
            for dirpath, _, names in os.walk(entry.path):
                for name in names:
                    add(os.path.join(dirpath, name))
        else:
            add(entry.path)
    prefixes = (shm_dir.rstrip("/") + "/", MEMFD_PREFIX)
    for pid in pids:
        # Through /proc/PID/map_files and /proc/PID/fd, so that files already unlinked but still mapped or
        # open (memshare unlinks result files once they are mapped) are still counted.
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = max(line.find(prefix) for prefix in prefixes)
                    if at >= 0:
                        path = line[at:].rstrip("\n").removesuffix(" (deleted)")
                        add(f"/proc/{pid}/map_files/{line.split(None, 1)[0]}", path)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = f"/proc/{pid}/fd/{fd}"
                try:
                    target = os.readlink(link)
                except OSError:
                    continue
                if target.startswith(prefixes):
                    add(link, target.removesuffix(" (deleted)"))
        except OSError:
            continue
    return files


def _sample_tree(root_pid: int, exclude: int, before: Set[FileKey]) -> Tuple[int, Set[FileKey]]:
    """One sample in ``"tree"`` mode: ``RssAnon`` of the tree plus its shm files not present at baseline."""
    pids = tree_pids(root_pid, exclude)
    files = tree_shm_files(pids)
    new = sum(size for key, size in files.items() if key not in before)
    return sum(read_rss_anon(pid) for pid in pids) + new, set(files)


def _serve(root_pid: int, interval: float, mode: str = "tree") -> None:
    """Body of the sampler process: baseline, then sample until a line arrives on stdin.

    Protocol (one line each): it prints ``ready <baseline>``, waits for any line
    on stdin while sampling, then prints ``done <baseline> <peak> <samples> <last>``, where ``<last>``
    is the final sample: the memory still held once the measured call has returned and memory settled
    (:func:`settled`, at most ``SETTLE_SECONDS``); then ``trace <seconds>:<bytes> ...``, every sample
    with the time it was taken, counted from the baseline (the memory over time of the pictures).
    """
    import select

    me = os.getpid()
    before: Set[FileKey] = set()
    started = time.monotonic()
    trace: List[Tuple[float, int]] = []

    def sample() -> int:
        if mode == "machine":
            value = sample_once(root_pid, me)
        else:
            value = _sample_tree(root_pid, me, before)[0]
        trace.append((time.monotonic() - started, value))
        return value

    if mode == "tree":
        # Files already there are left out of the baseline as they are left out of every later sample.
        pids = tree_pids(root_pid, me)
        before = set(tree_shm_files(pids))
        baseline = sum(read_rss_anon(pid) for pid in pids)
    else:
        baseline = sample()
    started = time.monotonic()  # time zero: the baseline, just before the measured call starts
    trace[:] = [(0.0, baseline)]
    peak = baseline
    samples = 1
    print(f"ready {baseline}", flush=True)
    while not select.select([sys.stdin], [], [], interval)[0]:
        value = sample()
        samples += 1
        peak = max(peak, value)
    # One last sample so that a peak at the very end is not missed.
    last = sample()
    peak = max(peak, last)
    settling = settle(sample, last, interval)
    print(f"done {baseline} {peak} {samples + len(settling)} {settling[-1]}", flush=True)
    print("trace " + " ".join(f"{seconds:.3f}:{value}" for seconds, value in trace), flush=True)


def settle(sample: Callable[[], int], first: int, interval: float, seconds: float = SETTLE_SECONDS) -> List[int]:
    """Samples taken from ``first`` on until memory settles (:func:`settled`) or ``seconds`` pass; the last counts.

    What a call still holds once it returned: memory may be released a little
    after the call returns (a dump deleted by a callback 50-70 ms later, say),
    so one sample at the return would report it as held.
    """
    samples = [first]
    deadline = time.monotonic() + seconds
    while not settled(samples) and time.monotonic() < deadline:
        time.sleep(interval)
        samples.append(sample())
    return samples


def settled(samples: List[int], count: int = SETTLE_SAMPLES, tolerance: int = SETTLE_TOLERANCE) -> bool:
    """True when the last ``count`` samples differ by at most ``tolerance`` bytes: memory stopped changing."""
    recent = samples[-count:]
    return len(recent) == count and max(recent) - min(recent) <= tolerance


class MemorySampler:
    """Context manager measuring peak extra memory of ``root_pid``'s process tree.

    After the ``with`` block, ``baseline_bytes``, ``peak_bytes``,
    ``peak_extra_bytes`` (peak minus baseline, never negative), ``end_extra_bytes``
    (the last sample minus baseline, never negative: what is still held once the
    block ended and memory settled, see :func:`settled`), ``samples`` and ``trace``
    (every sample as ``(seconds since the baseline, extra bytes)``, never negative) are set.
    The baseline is taken before ``__enter__`` returns. The sampler is
    a plain subprocess running this file, so the caller needs no
    ``if __name__ == "__main__"`` guard (as it would with a spawned
    ``multiprocessing.Process``).
    """

    def __init__(self, root_pid: Optional[int] = None, interval: float = DEFAULT_INTERVAL, mode: str = "tree") -> None:
        if mode not in ("tree", "machine"):
            raise ValueError(f"mode must be 'tree' or 'machine', not {mode!r}")
        self.mode = mode
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self.interval = interval
        self.baseline_bytes = 0
        self.peak_bytes = 0
        self.peak_extra_bytes = 0
        self.end_extra_bytes = 0
        self.samples = 0
        self.trace: List[Tuple[float, int]] = []
        self._process: Optional[subprocess.Popen] = None

    def __enter__(self) -> MemorySampler:
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(self.root_pid), str(self.interval), self.mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self._process.stdout.readline().split()
        if not line or line[0] != "ready":
            self._stop_process()
            raise RuntimeError("memory sampler failed to start")
        self.baseline_bytes = int(line[1])
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._process.stdin.write("stop\n")
            self._process.stdin.flush()
            line = self._process.stdout.readline().split()
            if line and line[0] == "done":
                self.baseline_bytes, self.peak_bytes, self.samples, last = (int(x) for x in line[1:5])
                self.peak_extra_bytes = max(0, self.peak_bytes - self.baseline_bytes)
                self.end_extra_bytes = max(0, last - self.baseline_bytes)
                trace = self._process.stdout.readline().split()
                if trace and trace[0] == "trace":
                    pairs = (item.split(":") for item in trace[1:])
                    self.trace = [(float(t), max(0, int(v) - self.baseline_bytes)) for t, v in pairs]
        finally:
            self._stop_process()

    def _stop_process(self) -> None:
        if self._process is None:
            return
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            stream.close()
        self._process = None


def measure_peak(func, *args, interval: float = DEFAULT_INTERVAL, **kwargs):
    """Run ``func(*args, **kwargs)`` under a sampler; return ``(result, peak_extra_bytes)``."""
    with MemorySampler(os.getpid(), interval) as sampler:
        result = func(*args, **kwargs)
    return result, sampler.peak_extra_bytes


if __name__ == "__main__":
    _serve(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
