"""A large Python object passed to every task: memshare against joblib's loky backend.

The object is a dict of ``--entries`` million string keys to ints (4 million pickle to about
160 MB), passed to ``--tasks`` tasks that each look up a few keys (so the transport is what is
measured), two workers. Contenders:

* ``joblib``: ``joblib.Parallel(backend="loky")``, the dict as an argument of every task;
* ``memshare``: ``memshare.Parallel``, the dict as an argument of every task;
* ``memshare-broadcast``: ``memshare.broadcast(table)`` once, then the broadcast as the argument
  (the time includes the broadcast: the dict is pickled once, and each worker unpickles it once).

With ``--distinct``, each task gets a dict of its own instead (all made before the memory baseline, as the
caller's data): nothing is shared, so this measures what each contender holds while the dicts travel,
joblib pickling each one in loky's feeder thread as it sends it.

Each run is a fresh interpreter: it builds the dict, warms the workers up with a tiny call, then
times one call under the memory sampler of ``memshare._tools.benchmarks.memory`` (peak extra memory of
the process tree, shared memory included). Contenders are interleaved within each repeat.

Usage (from the repository root)::

    python -m benchmarks.objects --entries 4 --repeats 3
    python -m benchmarks.objects --entries 0.25 --tasks 16 --distinct --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List

CONTENDERS = ("joblib", "memshare", "memshare-broadcast")

_CHILD = r"""
import json, os, pickle, sys, time


def lookup(table, k):
    table = table.value if hasattr(table, "value") else table
    return sum(table[f"key-{(k * 7919 + j) % len(table)}"] for j in range(100))


def main():
    contender, entries, tasks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    distinct = sys.argv[4] == "distinct"
    from memshare._tools.benchmarks.memory import MemorySampler

    if contender == "joblib":
        from joblib import Parallel, delayed

        parallel = Parallel(n_jobs=2, backend="loky")
    else:
        import memshare
        from memshare import Parallel, delayed

        parallel = Parallel(n_jobs=2)
    if distinct:  # one dict per task, all made before the baseline: the caller's own data
        tables = [{f"key-{i}": i + k for i in range(entries)} for k in range(tasks)]
        table = tables[0]
    else:
        table = {f"key-{i}": i for i in range(entries)}
    pickled = len(pickle.dumps(table, protocol=5))
    parallel(delayed(lookup)({"key-0": 0}, k) for k in range(4))  # start the workers
    with MemorySampler(os.getpid()) as sampler:
        started = time.perf_counter()
        if distinct:
            out = parallel(delayed(lookup)(tables[k], k) for k in range(tasks))
        else:
            argument = memshare.broadcast(table) if contender == "memshare-broadcast" else table
            out = parallel(delayed(lookup)(argument, k) for k in range(tasks))
        seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "pickled_size": pickled, "peak": sampler.peak_extra_bytes, "check": out}))


main()
"""


def run_one(contender: str, entries: int, tasks: int, distinct: bool = False) -> Dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, contender, str(entries), str(tasks), "distinct" if distinct else "same"],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    if done.returncode != 0:
        raise RuntimeError(f"{contender} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1024**2:,.0f} MB"


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=float, default=1, help="millions of dict entries (default 1)")
    parser.add_argument("--tasks", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument(
        "--distinct", action="store_true", help="each task gets a dict of its own (made before the baseline)"
    )
    args = parser.parse_args(argv)
    if args.distinct and "memshare-broadcast" in args.contenders:
        args.contenders.remove("memshare-broadcast")  # a broadcast is for data every task reads
    entries = int(args.entries * 1_000_000)
    results: Dict[str, List[Dict]] = {c: [] for c in args.contenders}
    for repeat in range(args.repeats):
        for contender in args.contenders if repeat % 2 == 0 else args.contenders[::-1]:
            results[contender].append(run_one(contender, entries, args.tasks, args.distinct))
            print(f"repeat {repeat + 1}: {contender}: {results[contender][-1]['seconds']:.2f} s", file=sys.stderr)
    checks = {json.dumps(r["check"]) for runs in results.values() for r in runs}
    if len(checks) != 1:
        raise AssertionError(f"contenders disagree: {checks}")
    pickled = next(iter(results.values()))[0]["pickled_size"]
    print(
        f"\n{'a distinct' if args.distinct else 'one'} dict of {entries:,} str -> int ({_mb(pickled)} pickled) "
        f"{'for each of' if args.distinct else 'to'} {args.tasks} tasks, 2 workers, "
        f"{args.repeats} repeats (median [min-max])\n"
    )
    print("| contender | time | x joblib | peak extra memory |")
    print("|---|---|---|---|")
    base = statistics.median(r["seconds"] for r in results["joblib"]) if "joblib" in results else None
    for contender, runs in results.items():
        times = [r["seconds"] for r in runs]
        peaks = [r["peak"] for r in runs]
        ratio = f"{statistics.median(times) / base:.2f}x" if base else "-"
        print(
            f"| {contender} | {statistics.median(times):.2f} s [{min(times):.2f}-{max(times):.2f}] | {ratio} "
            f"| {_mb(statistics.median(peaks))} [{_mb(min(peaks))}-{_mb(max(peaks))}] |"
        )


if __name__ == "__main__":
    main()
