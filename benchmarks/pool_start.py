"""The first pool of a process: import, create, first ``map``, close; memshare against joblib and the standard pool.

Each repeat runs every contender in a fresh interpreter, interleaved, with two workers and ``f(x) = x + 1``
(defined in the main script) over ``range(8)``. What is timed, inside the interpreter, goes from before
the import of the pool's module to after ``close()`` and ``join()``: what a script that uses one pool
pays. Contenders: memshare's pool under its default start method (forkserver) and with ``context="fork"``,
joblib's ``MemmappingPool`` (under multiprocessing's default start method: fork on Linux up to Python 3.13,
forkserver from 3.14; the table names the one used) and ``multiprocessing.Pool`` under forkserver and
fork. Each child also reports whether its workers and the parent had imported joblib, loky or numpy after
the map. With ``--numpy-first`` each child imports numpy first, inside the timed span, as a script that sends
arrays does.
A first round, not counted, writes the bytecode of every module (the children write and read it even where
``PYTHONDONTWRITEBYTECODE`` is set, as for a package pip installed and compiled) and brings the files into
the page cache.

Usage (from the repository root)::

    python -m benchmarks.pool_start --repeats 9
    python -m benchmarks.pool_start --repeats 9 --numpy-first
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

_CHILD = r"""
import json, multiprocessing, sys, time

def f(x):
    return x + 1

NAMES = ("joblib", "joblib.externals.loky", "numpy", "pandas", "pyarrow", "scipy")

def imported(_):
    return sorted(name for name in NAMES if name in sys.modules)

if __name__ == "__main__":
    which = sys.argv[1]
    started = time.perf_counter()
    if sys.argv[2:] == ["numpy"]:
        import numpy
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
    pool.map(f, range(8))
    pool.close()
    pool.join()
    elapsed = time.perf_counter() - started
    parent = imported(None)
    pool = type(pool)(1) if which.startswith("memshare") and which != "memshare-fork" else None
    worker = pool.apply(imported, (None,)) if pool is not None else None
    if pool is not None:
        pool.close()
        pool.join()
    method = multiprocessing.get_start_method() if which == "joblib" else None
    print(json.dumps({"first_map": elapsed, "parent": parent, "worker": worker, "method": method}))
"""

CONTENDERS = ("memshare", "memshare-fork", "joblib", "forkserver", "fork")
LABELS = {
    "memshare": "memshare MemmappingPool (forkserver)",
    "memshare-fork": "memshare MemmappingPool (fork)",
    "joblib": "joblib MemmappingPool ({method})",
    "forkserver": "mp.Pool (forkserver)",
    "fork": "mp.Pool (fork)",
}


#: The children's environment: bytecode written and read, as for an installed package (pip compiles it),
#: even where the calling environment sets PYTHONDONTWRITEBYTECODE.
_ENV = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}


def run_once(script: str, contender: str, env: Optional[Dict[str, str]] = None, numpy_first: bool = False) -> Dict:
    """One fresh interpreter with ``contender``'s first pool.

    The script is a file: under forkserver the standard pool's workers find
    ``f`` by importing the main script, which ``-c`` lacks.
    """
    completed = subprocess.run(
        [sys.executable, script, contender, *(["numpy"] if numpy_first else [])],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env=env or _ENV,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    from memshare._tools.benchmarks.harness import machine_description

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--environment-as-is",
        action="store_true",
        help="children get this environment unchanged (PYTHONDONTWRITEBYTECODE included): a package without "
        "bytecode, such as an editable install in such an environment, is compiled by every interpreter",
    )
    parser.add_argument("--numpy-first", action="store_true", help="each child imports numpy first, timed")
    args = parser.parse_args()
    env = dict(os.environ) if args.environment_as_is else _ENV
    samples: Dict[str, List[Dict]] = {name: [] for name in CONTENDERS}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pool-start-") as folder:
        script = os.path.join(folder, "pool_start_child.py")
        with open(script, "w") as child:
            child.write(_CHILD)
        for name in CONTENDERS:  # a round not counted: bytecode written, files in the page cache
            run_once(script, name, env, args.numpy_first)
        for _ in range(args.repeats):
            for name in CONTENDERS:
                samples[name].append(run_once(script, name, env, args.numpy_first))
    load_after = os.getloadavg()
    median = {name: statistics.median(run["first_map"] for run in runs) for name, runs in samples.items()}
    print("\n".join(machine_description(sys.argv)))
    print(
        f"- Load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in load_before)} before, "
        f"{', '.join(f'{x:.2f}' for x in load_after)} after"
    )
    first = "numpy's import, then " if args.numpy_first else ""
    print(f"\n{args.repeats} repeats, each contender in a fresh interpreter, interleaved; seconds from {first}the")
    print("import of the pool's module to the end of close() and join().\n")
    print("| contender | median | min-max | / joblib's pool | / mp.Pool (forkserver) |")
    print("|---|---|---|---|---|")
    for name in CONTENDERS:
        values = [run["first_map"] for run in samples[name]]
        label = LABELS[name].format(method=samples[name][-1].get("method"))
        print(
            f"| {label} | {median[name]:.3f} s | {min(values):.3f}-{max(values):.3f} s "
            f"| {median[name] / median['joblib']:.2f} | {median[name] / median['forkserver']:.2f} |"
        )
    last = samples["memshare"][-1]
    print(f"\nmemshare (forkserver), after its first map: the parent had imported {last['parent'] or 'none'} of")
    print(f"joblib, loky, numpy, pandas, pyarrow and scipy; a worker of a second pool, {last['worker'] or 'none'}.")


if __name__ == "__main__":
    main()
