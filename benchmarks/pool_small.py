"""``MemmappingPool`` on small items, against joblib's ``MemmappingPool`` and ``multiprocessing.Pool``.

Each contender runs in a fresh interpreter per repeat (so start-up is measured as a user meets it), the
contenders interleaved within each repeat, with ``f(x) = x + 1`` and two workers:

* ``start``: import the pool's module, create the pool, first ``map`` of 100 items;
* ``map``: ``map(f, range(20000))``;
* ``imap``: ``list(imap(f, range(2000)))`` (chunksize 1, the standard default);
* ``apply``: 2000 ``apply_async(f, (i,))``, then every ``.get()``.

memshare and ``mp.Pool (forkserver)`` use forkserver, memshare's default; ``mp.Pool (fork)`` and joblib's pool use
fork, the default of Python 3.9-3.13 on Linux; ``memshare (fork)`` is memshare's pool with ``context="fork"``, to
show what the fork server costs at start. Ratios are to ``mp.Pool`` with the same start method as the row's
contender (for joblib: fork), and to joblib's pool.

Usage (from the repository root)::

    python -m benchmarks.pool_small --repeats 5
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

def f(x):
    return x + 1

if __name__ == "__main__":
    which = sys.argv[1]
    started = time.perf_counter()
    if which == "memshare":
        from memshare import MemmappingPool
        pool = MemmappingPool(2)
    elif which == "memshare-fork":
        from memshare import MemmappingPool
        pool = MemmappingPool(2, context="fork")
    elif which == "joblib":
        from joblib.pool import MemmappingPool
        pool = MemmappingPool(2)
    else:
        import multiprocessing
        pool = multiprocessing.get_context(which).Pool(2)
    pool.map(f, range(100))
    times = {"start": time.perf_counter() - started}
    started = time.perf_counter()
    pool.map(f, range(20000))
    times["map"] = time.perf_counter() - started
    started = time.perf_counter()
    list(pool.imap(f, range(2000)))
    times["imap"] = time.perf_counter() - started
    started = time.perf_counter()
    pending = [pool.apply_async(f, (i,)) for i in range(2000)]
    [result.get() for result in pending]
    times["apply"] = time.perf_counter() - started
    pool.terminate()
    pool.join()
    print(json.dumps(times))
"""

CONTENDERS = {
    "memshare": "forkserver",
    "memshare-fork": "fork",
    "joblib": "fork",
    "forkserver": "forkserver",
    "fork": "fork",
}
LABELS = {
    "memshare": "memshare MemmappingPool",
    "memshare-fork": "memshare MemmappingPool (fork)",
    "joblib": "joblib MemmappingPool",
    "forkserver": "mp.Pool (forkserver)",
    "fork": "mp.Pool (fork)",
}
OPERATIONS = ("start", "map", "imap", "apply")


def run_once(script: str, contender: str) -> Dict[str, float]:
    """One fresh interpreter running every operation with ``contender``'s pool.

    The script is a file: under forkserver and spawn, the standard pool's
    workers find ``f`` by re-importing the main script, which ``-c`` lacks.
    """
    completed = subprocess.run(
        [sys.executable, script, contender], capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    samples: Dict[str, List[Dict[str, float]]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="pool-small-") as folder:
        script = os.path.join(folder, "pool_small_child.py")
        with open(script, "w") as child:
            child.write(_CHILD)
        for _ in range(args.repeats):
            for name in CONTENDERS:
                samples[name].append(run_once(script, name))
    median = {
        name: {op: statistics.median(run[op] for run in runs) for op in OPERATIONS} for name, runs in samples.items()
    }
    print("\n".join(machine_description(sys.argv)))
    print(f"\n{args.repeats} repeats, each contender in a fresh process, interleaved; median (min-max) seconds.\n")
    print("| operation | contender | median | min-max | / mp.Pool, same start method | / joblib |")
    print("|---|---|---|---|---|---|")
    for op in OPERATIONS:
        for name in CONTENDERS:
            values = [run[op] for run in samples[name]]
            same_method = median[CONTENDERS[name]][op]
            print(
                f"| {op} | {LABELS[name]} | {median[name][op]:.3f} s | {min(values):.3f}-{max(values):.3f} s "
                f"| {median[name][op] / same_method:.2f} | {median[name][op] / median['joblib'][op]:.2f} |"
            )


if __name__ == "__main__":
    main()
