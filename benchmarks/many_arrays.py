"""Many medium arrays: 3000 arrays of 128 KiB, 375 per task, memshare against joblib.

A user's case: a list of 3000 arrays of 128 KiB sent in 8
tasks of 375 to two workers with ``max_nbytes="64K"``, called twice (a
second call over the same arrays), then one task with all 3000. Each run is
a fresh interpreter with ``ulimit -n`` 1024, soft and hard, as an ordinary
account has: memshare must neither run out of descriptors nor slow down.
Each also runs under the machine's own limit.
Runs alternate between memshare and joblib, so that a slow phase of a
shared machine weighs on both alike; medians are reported, with the
descriptors memshare holds in the parent after the calls. A contender that
fails (joblib with all 3000 arrays in one task runs out of descriptors, since
each ``np.memmap`` keeps one) is reported as failed.

Usage (from the repository root)::

    python -m benchmarks.many_arrays --repeats 5
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

RUN = r"""
import json, os, resource, sys, time
if sys.argv[2] == "1024":
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
import numpy as np
import joblib
import memshare
from memshare._lifetime import _memfd_census

def sums(arrays):
    return [float(a.sum()) for a in arrays]

def main(contender):
    library = memshare if contender == "memshare" else joblib
    Parallel, delayed = library.Parallel, library.delayed
    arrays = [np.full(16384, float(i)) for i in range(3000)]
    expected = [16384.0 * i for i in range(3000)]
    lists = [arrays[i::8] for i in range(8)]
    wanted = [expected[i::8] for i in range(8)]
    Parallel(n_jobs=2)(delayed(abs)(i) for i in range(4))  # workers up
    times = {}
    for name in ("first", "second"):
        started = time.perf_counter()
        assert Parallel(n_jobs=2, max_nbytes="64K")(delayed(sums)(part) for part in lists) == wanted
        times[name] = time.perf_counter() - started
    started = time.perf_counter()
    try:
        assert Parallel(n_jobs=2, max_nbytes="64K")(delayed(sums)(part) for part in [arrays]) == [expected]
        times["one task"] = time.perf_counter() - started
    except OSError as exc:
        times["one task"] = f"failed: {exc.strerror or exc}"
    times["descriptors"] = _memfd_census.descriptors_of() if contender == "memshare" else None
    print(json.dumps(times))

if __name__ == "__main__":
    main(sys.argv[1])
"""

#: (library, descriptor limit): "1024" soft and hard, or "as is" (the machine's own).
CONTENDERS = (("memshare", "1024"), ("joblib", "1024"), ("memshare", "as is"), ("joblib", "as is"))


def run_once(contender: str, limit: str) -> dict:
    """One fresh interpreter's figures for ``contender`` under the descriptor ``limit``."""
    done = subprocess.run(
        [sys.executable, "-c", RUN, contender, limit], capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        why = "too many open files" if "Errno 24" in done.stderr else "see its stderr"
        return {"first": f"failed: {why}", "second": "-", "one task": "-", "descriptors": None}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(values: list) -> str:
    numbers = [v for v in values if isinstance(v, (int, float))]
    if len(numbers) < len(values):
        return next(v for v in values if not isinstance(v, (int, float)))[:40]
    return f"{statistics.median(numbers):.2f} s"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args(argv)
    runs: dict = {name: [] for name in CONTENDERS}
    for _ in range(options.repeats):
        for name in CONTENDERS:
            runs[name].append(run_once(*name))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(f"3000 arrays of 128 KiB, 375 per task, 2 workers; medians of {options.repeats} runs")
    print(f"(ulimit -n as is: {soft})")
    print("| contender | ulimit -n | first call | second call | all 3000 in one task | memshare's descriptors |")
    print("|---|---|---|---|---|---|")
    for name in CONTENDERS:
        figures = runs[name]
        held = [r["descriptors"] for r in figures if r.get("descriptors") is not None]
        print(
            f"| {name[0]} | {name[1]} | {_median([r['first'] for r in figures])} | "
            f"{_median([r['second'] for r in figures])} | {_median([r['one task'] for r in figures])} | "
            f"{max(held) if held else '-'} |"
        )


if __name__ == "__main__":
    main()
