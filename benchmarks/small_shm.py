"""A 512 MiB chunk workload, then 4 x 128 MiB results: Docker's 64 MB /dev/shm against a roomy machine.

Each run is a fresh interpreter that warms its two workers up, then times
the two calls. Runs alternate between the settings, so that a slow phase of
a shared machine weighs on all of them alike; medians are reported. The
small setting mounts 64 MB tmpfs on /dev/shm and on the temp dir in a
private mount namespace (``unshare -m``, root only), as a container with
Docker's defaults has. The temp dir is a fresh folder that TMPDIR points at,
not /tmp itself, which may hold this checkout or its virtual environment.
``roomy, named files`` is the same run on the roomy machine with memfds turned off (``MEMSHARE_MEMFD=0``): the mechanism
memshare used before memfds.

Usage (from the repository root, as root)::

    python -m benchmarks.small_shm --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

RUN = r"""
import json, time, warnings
import numpy as np
import memshare
from memshare import Parallel, delayed

def chunk_sum(X, i):
    return float(X[i].sum())

def result(i):
    return np.full(128 * 2**20 // 8, float(i))

X = np.ones((64, 512 * 2**20 // 8 // 64))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    Parallel(n_jobs=2)(delayed(abs)(i) for i in range(4))  # workers up
    started = time.perf_counter()
    sums = Parallel(n_jobs=2)(delayed(chunk_sum)(X, i) for i in range(64))
    chunks = time.perf_counter() - started
    inputs = memshare.last_call_stats()
    started = time.perf_counter()
    results = Parallel(n_jobs=2)(delayed(result)(i) for i in range(4))
    back = time.perf_counter() - started
    outputs = memshare.last_call_stats()
assert sums == [float(X.shape[1])] * 64 and [r[-1] for r in results] == [0.0, 1.0, 2.0, 3.0]
print(json.dumps({
    "chunks": chunks, "results": back, "warnings": len(caught),
    "fallback_files": inputs["fallback_files"] + outputs["fallback_files"],
    "pickled": outputs["results_pickled_no_room"],
}))
"""


def settings(temp: str) -> dict:
    """Name -> (command prefix, extra environment) of each setting, with the temp dir at ``temp``."""
    small = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && mount -t tmpfs -o size=64m tmpfs {temp}"
    return {
        "roomy /dev/shm": ([], {}),
        "64 MB /dev/shm and temp dir": (
            ["unshare", "-m", "--propagation", "private", "sh", "-c", small + ' && exec "$0" "$@"'],
            {},
        ),
        "roomy, named files": ([], {"MEMSHARE_MEMFD": "0"}),
    }


def run_once(prefix, extra_env, temp: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MEMSHARE_TEMP_FOLDER", "JOBLIB_TEMP_FOLDER")}
    env.update(extra_env, TMPDIR=temp)
    done = subprocess.run(prefix + [sys.executable, "-c", RUN], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=7)
    options = parser.parse_args()
    temp = tempfile.mkdtemp(prefix="bench-small-tmp-")
    try:
        chosen = settings(temp)
        runs = {name: [] for name in chosen}
        for repeat in range(options.repeats):
            for name, (prefix, env) in chosen.items():
                runs[name].append(run_once(prefix, env, temp))
                print(f"repeat {repeat + 1}: {name}: {runs[name][-1]}", file=sys.stderr)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    roomy_total = statistics.median(r["chunks"] + r["results"] for r in runs["roomy /dev/shm"])
    print(
        "| setting | chunks (512 MiB, 64 tasks) | results (4 x 128 MiB) | total | total / roomy | warnings, "
        "disk files, pickled |"
    )
    print("|---|---|---|---|---|---|")
    for name, results in runs.items():
        chunks = statistics.median(r["chunks"] for r in results)
        back = statistics.median(r["results"] for r in results)
        total = statistics.median(r["chunks"] + r["results"] for r in results)
        ratio = total / roomy_total
        odd = f"{sum(r['warnings'] for r in results)}, {sum(r['fallback_files'] for r in results)}, " + str(
            sum(r["pickled"] for r in results)
        )
        print(f"| {name} | {chunks:.3f} s | {back:.3f} s | {total:.3f} s | {ratio:.2f} | {odd} |")


if __name__ == "__main__":
    main()
