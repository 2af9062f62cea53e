"""The machine a benchmark runs on: sizes, its memory and load, and a size refused before it could exhaust them.

:func:`parse_size` and :func:`format_size` read and print sizes;
:func:`default_size` picks one that is safe here; :func:`machine_description`
writes the report's header and :func:`load_average` the load the report
judges noise by. Before any process or data exists, a size whose peak (every
contender process of a workload holding the data, plus the copies of the one
being timed) would exceed the memory available is refused (:func:`check_fits`).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import shutil
import time
from typing import List, Optional, Sequence, Tuple

from .runners import LIMIT_PARTS, PICKLING
from .workloads import make_workloads
from .workloads_returns import RETURN_TASKS

GiB = 1 << 30
MiB = 1 << 20


def parse_size(text: str) -> int:
    """``"256M"``, ``"1G"``, ``"1.5GiB"``, ``"1000000"`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 256M, 1G)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * {"": 1, "K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}[unit])


def format_size(nbytes: float) -> str:
    """Bytes as MiB or GiB, for tables."""
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / MiB:.0f} MiB"


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def default_size() -> int:
    """min(1 GiB, 1/16 of RAM, 1/4 of free /dev/shm): large enough to matter, small enough to be safe."""
    candidates = [GiB, _meminfo("MemTotal") // 16]
    if os.path.isdir("/dev/shm"):
        candidates.append(shutil.disk_usage("/dev/shm").free // 4)
    return max(MiB, min(candidates))


def machine_description(argv: Sequence[str]) -> List[str]:
    """Lines describing the machine, versions, date and command line, for the report header."""
    import joblib
    import numpy
    from joblib.externals import loky

    import memshare

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else 0
    command = " ".join([argv[0]] + [shlex.quote(a) for a in argv[1:]]) if argv else ""
    return [
        f"- CPU: {cpu}, {os.cpu_count()} cores",
        f"- RAM: {format_size(_meminfo('MemTotal'))}, /dev/shm: {format_size(shm)}",
        f"- Python {platform.python_version()}, numpy {numpy.__version__}, joblib {joblib.__version__}, "
        f"loky {loky.__version__} (bundled), memshare {memshare.__version__}",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- Command: `{command}`",
    ]


def load_average() -> Optional[Tuple[float, float, float]]:
    """The machine's 1, 5 and 15-minute load averages; None where the system does not say."""
    try:
        return os.getloadavg()
    except OSError:
        return None


class TooLargeError(ValueError):
    """The benchmark would need more memory than the machine has available."""


#: The share of MemAvailable a run may plan to use: the rest is left to the system and other processes.
MEMORY_SHARE = 0.9


def data_factor(key: str) -> float:
    """How many times ``size`` the prepared data of workload ``key`` holds in each contender's process.

    (l)'s dict pickles to size/64 and takes about 7 times that in memory: 1/4 leaves room.
    """
    if key in ("c", "d", "m", "p"):
        return 0
    return 0.25 if key == "l" else 1


def copies_factor(key: str, contender: str) -> float:
    """How many times ``size`` a contender makes while it is timed on workload ``key``, on top of its data.

    A fresh copy of the input before each repeat (then the old one is freed),
    a dump or the pickled pieces during the call; for (c) the results, once in
    the worker and, when pickled or dumped, once more in the parent; for (m)
    the results and, after the first run, the expected ones. joblib pickles a
    DataFrame (j, k) into every task, and each worker unpickles its own copy:
    a few times the frame at once. In (l) each worker unpickles its own dict.
    In (q) and (r) each task's result is ``X``: copied back once per task
    except by memshare (which maps ``X``'s file) and serial.
    """
    if key in ("d", "p"):
        return 0
    if key == "c":
        return 2 if contender in PICKLING + ("joblib",) else 1
    if key == "m":
        return 3 if contender == "joblib" else 2
    if key in ("j", "k", "n"):
        return 4 if contender == "joblib" else 1
    if key == "l":
        return 0.5
    if key in ("q", "r"):
        # X is dumped (or, for mp.Pool, pickled into the tasks in flight), and every result comes back whole.
        return 1 if contender.startswith("memshare") or contender == "serial" else 2 + RETURN_TASKS
    return 1


def estimate_peak(workloads: str, contenders: Sequence[str], size: int) -> Tuple[int, str, int]:
    """The most memory a run needs at once: (bytes, the workload that needs it, its contender processes).

    Every contender of a workload lives in a process of its own, each holding
    its own data, for the whole workload; contenders are timed one at a time,
    so the copies of one timed contender come on top. Pickling contenders are
    counted even where the pickle budget would skip them.
    """
    best = (0, "", 0)
    for key, workload in make_workloads().items():
        if key not in workloads:
            continue
        names = [c for c in workload.contenders if c in contenders]
        if workload.limit_bytes is not None and "memshare" in names:
            names += [p for p in LIMIT_PARTS if workload.limit_formula == "inputs" or p != "first-touch"]
        if not names:
            continue
        peak = int(size * (len(names) * data_factor(key) + max(copies_factor(key, n) for n in names)))
        if peak > best[0]:
            best = (peak, key, len(names))
    return best


def check_fits(workloads: str, contenders: Sequence[str], size: int, available: Optional[int] = None) -> None:
    """Refuse, before any process or data exists, a run whose peak exceeds the memory available.

    A run past it would meet the kernel's OOM killer, which may end any
    process of the user, not only the benchmark's.
    """
    available = _meminfo("MemAvailable") if available is None else available
    if available <= 0:
        return  # unknown (no /proc/meminfo): nothing to judge by
    peak, key, processes = estimate_peak(workloads, contenders, size)
    budget = int(MEMORY_SHARE * available)
    if peak <= budget:
        return
    factor = peak / size
    largest = int(budget / factor) // MiB * MiB
    fits = f"--size {largest // MiB}M" if largest >= MiB else "no size (free some memory first)"
    raise TooLargeError(
        f"--size {format_size(size)} needs about {format_size(peak)} at its peak (workload ({key}): {processes} "
        f"contender processes each hold the data, plus the copies of the one being timed), more than "
        f"{int(MEMORY_SHARE * 100)}% of the {format_size(available)} available (MemAvailable). The largest size "
        f"that fits is {format_size(largest)}: pass {fits}, or trim the contenders with --contenders (e.g. "
        "--contenders memshare,joblib) or the workloads with --workloads."
    )
