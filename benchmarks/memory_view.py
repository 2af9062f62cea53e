"""What process tools and the cgroup see of results that came back but were not touched yet.

Each run is a fresh Python process that returns ``--count`` arrays of
``--size`` MiB from 2 workers and reads, before the call, after it and after
reading every result once: VmRSS, RssAnon and RssShmem (/proc/self/status),
Pss, Pss_Anon and Pss_Shmem (/proc/self/smaps_rollup), the cgroup's shmem
(memory.stat, v2 or v1) and, for memshare, ``bytes_in_shared_memory``. The
contenders run interleaved, ``--repeats`` times: memshare with memfds,
memshare with named files in /dev/shm (``MEMSHARE_MEMFD=0``), joblib's
loky backend. Figures are the median change from before the call, in MiB.

    python benchmarks/memory_view.py --count 8 --size 64 --repeats 3

The cgroup figure is the whole cgroup's: other processes in it move it too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List

MIB = 1024**2
CONTENDERS = {"memshare (memfds)": {}, "memshare (named files)": {"MEMSHARE_MEMFD": "0"}, "joblib": {}}
FIGURES = ("VmRSS", "RssAnon", "RssShmem", "Pss", "Pss_Anon", "Pss_Shmem", "cgroup shmem", "bytes_in_shared_memory")


def _fields(path: str) -> Dict[str, int]:
    found = {}
    with open(path) as lines:
        for line in lines:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                found[name] = int(parts[0]) * 1024
    return found


def _cgroup_shmem() -> int:
    with open("/proc/self/cgroup") as lines:
        entries = [line.rstrip("\n").split(":", 2) for line in lines]
    for _, controllers, path in entries:
        for stat in (f"/sys/fs/cgroup/memory{path}/memory.stat", f"/sys/fs/cgroup{path}/memory.stat"):
            if ("memory" in controllers.split(",") or controllers == "") and os.path.exists(stat):
                with open(stat) as figures:
                    for line in figures:
                        name, value = line.split()
                        if name == "shmem":
                            return int(value)
    return -1


def _sample(stats_bytes: int) -> Dict[str, int]:
    status = _fields("/proc/self/status")
    rollup = _fields("/proc/self/smaps_rollup")
    return {
        "VmRSS": status["VmRSS"],
        "RssAnon": status["RssAnon"],
        "RssShmem": status["RssShmem"],
        "Pss": rollup["Pss"],
        "Pss_Anon": rollup["Pss_Anon"],
        "Pss_Shmem": rollup["Pss_Shmem"],
        "cgroup shmem": _cgroup_shmem(),
        "bytes_in_shared_memory": stats_bytes,
    }


def make(seed: int, nbytes: int):
    import numpy as np

    return np.full(nbytes, seed % 251 + 1, dtype=np.uint8)  # every page written in the worker


def child(contender: str, count: int, size: int) -> None:
    """One run, in this fresh process: print the three samples as JSON."""
    import joblib
    import numpy as np

    import memshare

    def stats_bytes() -> int:
        figures = memshare.last_call_stats() if contender.startswith("memshare") else None
        return int(figures["bytes_in_shared_memory"]) if figures else 0

    if contender.startswith("memshare"):
        call = memshare.Parallel(n_jobs=2)
    else:
        call = joblib.Parallel(n_jobs=2)
    call(joblib.delayed(len)([i]) for i in range(2))  # workers started before "before"
    before = _sample(stats_bytes())
    results = call(joblib.delayed(make)(i, size * MIB) for i in range(count))
    after = _sample(stats_bytes())
    assert sum(int(np.asarray(r[::4096]).sum()) for r in results) > 0  # reads one byte of every page
    touched = _sample(stats_bytes())
    print(json.dumps({"after call": _delta(after, before), "after touching": _delta(touched, before)}))


def _delta(now: Dict[str, int], then: Dict[str, int]) -> Dict[str, int]:
    return {name: now[name] - then[name] if name != "bytes_in_shared_memory" else now[name] for name in now}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--size", type=int, default=64, help="MiB per result")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.count, args.size)
        return
    runs: Dict[str, List[dict]] = {name: [] for name in CONTENDERS}
    for _ in range(args.repeats):
        for name, env in CONTENDERS.items():
            command = [sys.executable, __file__, "--child", name, "--count", str(args.count), "--size", str(args.size)]
            out = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    with open("/proc/loadavg") as load:
        loadavg = " ".join(load.read().split()[:3])
    print(f"{args.count} results of {args.size} MiB, n_jobs=2, {args.repeats} repeats; load average {loadavg}")
    print(f"median change from before the call, MiB ({', '.join(FIGURES)}):")
    for name, samples in runs.items():
        for when in ("after call", "after touching"):
            medians = [statistics.median(sample[when][figure] for sample in samples) / MIB for figure in FIGURES]
            print(f"| {name} | {when} | " + " | ".join(f"{value:.0f}" for value in medians) + " |")


if __name__ == "__main__":
    main()
