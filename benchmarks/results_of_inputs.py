"""Tasks that return their input: 8 tasks each returning ``X``, ``X[: n // 2]`` or a strided tail of it.

joblib pickles each task's result back, so the parent ends with 8 copies; memshare maps the argument's file
(its array held once, or its dump) copy-on-write in the parent for each result: no copy, no new file. Each
contender runs in a fresh interpreter per repeat, the contenders interleaved, with its workers started first
(a tiny call); each of the three calls is timed alone, then every result is read whole (checked against the
values, which also faults in every page) and the parent's extra memory is taken:

* memory = the process's ``RssAnon`` + each shared-memory file it maps, counted once per file (the largest
  ``Size`` among that file's mappings in ``/proc/self/smaps``: memshare maps whole files, and a mapped file
  lives whole), so that a file mapped by ``X`` and by 8 results counts once, as the machine holds it;
* extra at the end = that memory with the results alive, less that memory just before the call.

Contenders: ``memshare`` (``X`` held once, the default), ``memshare-dumped`` (``MEMSHARE_PROMOTE=0``: ``X``
is dumped), ``joblib`` (loky, its default auto-memmapping of ``X``).

Usage (from the repository root)::

    python -m benchmarks.results_of_inputs --size-mib 256 --repeats 3
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
import gc, json, sys, time
import numpy as np

def whole(x):
    return x

def first_half(x):
    return x[: x.shape[0] // 2]

def strided_tail(x):
    return x[x.shape[0] // 4 :: 3]

def nothing(_):
    return None

def memory():
    anon, shared = 0, {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    inode, rss = None, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                name = fields[5] if len(fields) > 5 else ""
                shm = name.startswith(("/memfd:", "/dev/shm/")) or "memshare" in name or "joblib" in name
                inode = (fields[3], int(fields[4])) if shm and int(fields[4]) else None
            elif inode is not None and fields[0] == "Size:":
                shared[inode] = max(shared.get(inode, 0), int(fields[1]) * 1024)
    return anon + sum(shared.values())

if __name__ == "__main__":
    which, size_mib, tasks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if which == "joblib":
        from joblib import Parallel, delayed
    else:
        from memshare import Parallel, delayed
    x = np.random.default_rng(0).random(size_mib * 2**20 // 8)
    parallel = Parallel(n_jobs=2)
    parallel(delayed(nothing)(i) for i in range(2))  # the workers are started
    out = {}
    for func in (whole, first_half, strided_tail):
        gc.collect()
        before = memory()
        started = time.perf_counter()
        results = parallel(delayed(func)(x) for _ in range(tasks))
        seconds = time.perf_counter() - started
        expected = float(func(x).sum())
        correct = all(float(r.sum()) == expected for r in results)  # reads every page of every result
        out[func.__name__] = {"seconds": seconds, "extra": memory() - before, "correct": correct}
        del results
    print(json.dumps(out))
"""

CONTENDERS = ("memshare", "memshare-dumped", "joblib")
RETURNS = ("whole", "first_half", "strided_tail")
LABELS = {"whole": "`X`", "first_half": "`X[: n // 2]`", "strided_tail": "`X[n // 4 :: 3]`"}


def run_once(script: str, contender: str, size_mib: int, tasks: int) -> Dict[str, Dict[str, float]]:
    """One fresh interpreter making the three calls with ``contender``."""
    env = dict(os.environ)
    env.pop("MEMSHARE_PROMOTE", None)
    if contender == "memshare-dumped":
        env["MEMSHARE_PROMOTE"] = "0"
    completed = subprocess.run(
        [sys.executable, script, contender.split("-")[0], str(size_mib), str(tasks)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
        env=env,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    samples: Dict[str, List[Dict[str, Dict[str, float]]]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="results-of-inputs-") as folder:
        script = os.path.join(folder, "results_of_inputs_child.py")
        with open(script, "w") as child:
            child.write(_CHILD)
        for _ in range(args.repeats):
            for name in CONTENDERS:
                samples[name].append(run_once(script, name, args.size_mib, args.tasks))
    print("\n".join(machine_description(sys.argv)))
    print(f"- load average before the run's end: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(
        f"\n`X`: {args.size_mib} MiB of float64; {args.tasks} tasks, each returning the view listed, n_jobs=2, "
        f"workers started; {args.repeats} repeats, each contender in a fresh process, interleaved; median "
        "(min-max). Extra memory: the parent's, with the results alive, over just before the call.\n"
    )
    print("| each task returns | contender | time | min-max | / joblib | extra memory at the end | / X | correct |")
    print("|---|---|---|---|---|---|---|---|")
    size = args.size_mib * 2**20
    for what in RETURNS:
        joblib_time = statistics.median(run[what]["seconds"] for run in samples["joblib"])
        for name in CONTENDERS:
            times = [run[what]["seconds"] for run in samples[name]]
            extra = statistics.median(run[what]["extra"] for run in samples[name])
            correct = all(run[what]["correct"] for run in samples[name])
            print(
                f"| {LABELS[what]} | {name} | {statistics.median(times):.3f} s | {min(times):.3f}-{max(times):.3f} s "
                f"| {statistics.median(times) / joblib_time:.2f} | {extra / 2**20:+.0f} MiB | {extra / size:+.3f} "
                f"| {'yes' if correct else 'NO'} |"
            )


if __name__ == "__main__":
    main()
