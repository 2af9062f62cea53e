"""Thousands of live broadcasts: tiny tasks, each given its own broadcast, against joblib given the objects.

4000 small dicts; memshare broadcasts each (``memshare.broadcast``) and runs ``f(b) = len(b.value)`` over
them with ``memshare.Parallel(n_jobs=2)``; joblib runs ``f(d) = len(d)`` over the dicts with
``joblib.Parallel(n_jobs=2)`` (loky). Each contender runs in a fresh interpreter per repeat, the contenders
interleaved, and makes two calls over every item:

* ``call 1``: the first call, as a user meets it: the workers start, and memshare's unpickle each broadcast on
  first receipt;
* ``call 2``: the same again with the workers running, each now holding its copies of about half of them.

A worker used to check every copy it held (and every cached mapping of one) before each task, so the cost of
a task grew with the number of broadcasts held.

Usage (from the repository root)::

    python -m benchmarks.many_broadcasts --repeats 3 [--count 4000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

from memshare._tools.benchmarks.harness import machine_description

_CHILD = r"""
import json, sys, time

def size_of_broadcast(b):
    return len(b.value)

def size(d):
    return len(d)

if __name__ == "__main__":
    which, count = sys.argv[1], int(sys.argv[2])
    items = [{"item": i, "values": list(range(10))} for i in range(count)]
    times = {}
    if which == "memshare":
        import memshare
        started = time.perf_counter()
        items = [memshare.broadcast(item) for item in items]
        times["broadcast()"] = time.perf_counter() - started
        parallel, delayed, f = memshare.Parallel(n_jobs=2), memshare.delayed, size_of_broadcast
    else:
        import joblib
        parallel, delayed, f = joblib.Parallel(n_jobs=2), joblib.delayed, size
    for call in ("call 1", "call 2"):
        started = time.perf_counter()
        assert parallel(delayed(f)(item) for item in items) == [2] * count
        times[call] = time.perf_counter() - started
    print(json.dumps(times))
"""

CONTENDERS = ("memshare", "joblib")
OPERATIONS = ("call 1", "call 2")


def run_once(script: str, contender: str, count: int) -> Dict[str, float]:
    """One fresh interpreter running both calls with ``contender``."""
    completed = subprocess.run(
        [sys.executable, script, contender, str(count)], capture_output=True, text=True, timeout=1800, check=True
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--count", type=int, default=4000)
    args = parser.parse_args()
    samples: Dict[str, List[Dict[str, float]]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="many-broadcasts-") as folder:
        script = os.path.join(folder, "many_broadcasts_child.py")
        with open(script, "w") as child:
            child.write(_CHILD)
        for _ in range(args.repeats):
            for name in CONTENDERS:
                samples[name].append(run_once(script, name, args.count))
    print("\n".join(machine_description(sys.argv)))
    print(
        f"\n{args.count} broadcasts (memshare) or dicts (joblib), {args.count} tasks per call, n_jobs=2; "
        f"{args.repeats} repeats, each contender in a fresh process, interleaved; median (min-max) seconds.\n"
    )
    print("| operation | contender | median | min-max | / joblib |")
    print("|---|---|---|---|---|")
    joblib_median = {op: statistics.median(run[op] for run in samples["joblib"]) for op in OPERATIONS}
    for op in OPERATIONS:
        for name in CONTENDERS:
            values = [run[op] for run in samples[name]]
            median = statistics.median(values)
            print(
                f"| {op} | {name} | {median:.3f} s | {min(values):.3f}-{max(values):.3f} s "
                f"| {median / joblib_median[op]:.2f} |"
            )
    made = [run["broadcast()"] for run in samples["memshare"]]
    print(f"\nmemshare's {args.count} `broadcast()` calls: median {statistics.median(made):.3f} s.")


if __name__ == "__main__":
    main()
