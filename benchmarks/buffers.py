"""Arrow data passed to every task: memshare (out-of-band buffers) against joblib's loky backend.

Two workloads, each a DataFrame passed to 8 tasks that each compute one cheap statistic (so the
transport is what is measured), two workers:

* ``string[pyarrow]``: one ``string[pyarrow]`` column of about ``--size`` MB;
* ``parquet``: a DataFrame read from a Parquet file with ``dtype_backend="pyarrow"`` (a string
  column and a float column, about ``--size`` MB in all);
* ``object``: one object-dtype string column (Python ``str`` objects) of about ``--size`` MB of text,
  which memshare pickles once per call as an argument object (there are no buffers to share);
* ``numeric``: four float64 columns, ``--size`` MB in all (plain NumPy blocks: memshare holds them once);
* ``returned``: the other way: 2 tasks each build and return a ``string[pyarrow]`` DataFrame of
  about ``--size``/2 MB (the time includes building it in the worker, the same for both).

``--second-call`` times a second call over the same data, the first one untimed: memshare sends again
the Arrow buffers its first call wrote (after comparing them), where joblib pickles everything again.
``--task-seconds S`` makes each task also sleep ``S`` seconds. With cheap tasks, joblib's feeder thread
pickling the argument for one task at a time keeps its workers from overlapping; a task that works a
while lets both workers hold their copy of the argument at once, as in real use.

Each run is a fresh interpreter: it builds the data, warms the workers up with a tiny call, then
times one call under the memory sampler of ``memshare._tools.benchmarks.memory`` (peak extra memory of
the process tree, shared memory included). Contenders are interleaved within each repeat.
"pickled" is what the call's task payloads weighed: memshare's ``last_call_stats()["bytes_pickled"]``;
for joblib, 8 times the argument's pickled size (loky pickles it for every task).

Usage (from the repository root)::

    python -m benchmarks.buffers --size 512 --repeats 3
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

TASKS = 8
CONTENDERS = ("memshare", "joblib")
WORKLOADS = ("string[pyarrow]", "parquet", "object", "numeric", "returned")

_CHILD = r"""
import json, os, pickle, sys, time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq


def strings(nbytes):
    # Strings of 24 to 40 bytes, built as Arrow buffers directly (fast for any size).
    rng = np.random.default_rng(0)
    lengths = rng.integers(24, 41, size=max(1, nbytes // 32), dtype=np.int32)
    offsets = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    data = rng.integers(97, 123, size=int(offsets[-1]), dtype=np.uint8)
    return pa.StringArray.from_buffers(lengths.size, pa.py_buffer(offsets), pa.py_buffer(data))


def make(workload, size_mb, folder):
    if workload == "numeric":
        rows = size_mb * 1024**2 // 32
        return pd.DataFrame(np.random.default_rng(2).random((rows, 4)), columns=list("abcd"))
    if workload == "object":
        column = strings(size_mb * 1024**2).to_pylist()
        return pd.DataFrame({"s": pd.Series(column, dtype=object)})
    column = strings(size_mb * 1024**2 if workload == "string[pyarrow]" else size_mb * 1024**2 * 3 // 4)
    if workload == "string[pyarrow]":
        return pa.table({"s": column}).to_pandas(types_mapper={pa.string(): pd.StringDtype("pyarrow")}.get)
    path = os.path.join(folder, "data.parquet")
    floats = np.random.default_rng(1).random(len(column))
    pq.write_table(pa.table({"s": column, "f": floats}), path)
    return pd.read_parquet(path, dtype_backend="pyarrow")


def statistic(frame, k):
    if TASK_SECONDS:
        time.sleep(TASK_SECONDS)  # a task that works a while: both workers hold their argument at once
    column = frame[frame.columns[k % len(frame.columns)]]
    which = k % 4
    if which == 0:
        return int(column.count())
    if which == 1:
        return str(column.iloc[(k * 1000) % len(column)])
    if which == 2:
        return int(column.isna().sum())
    return len(frame)


def build(size_mb):
    return make("string[pyarrow]", size_mb, None)


TASK_SECONDS = float(os.environ.get("BUFFERS_BENCH_TASK_SECONDS", "0"))
SECOND_CALL = os.environ.get("BUFFERS_BENCH_SECOND_CALL") == "1"


def main():
    workload, contender, size_mb, folder = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    from memshare._tools.benchmarks.memory import MemorySampler

    if contender == "memshare":
        import memshare
        from memshare import Parallel, delayed

        parallel = lambda: Parallel(n_jobs=2)
    else:
        from joblib import Parallel, delayed

        parallel = lambda: Parallel(n_jobs=2, backend="loky")
    if workload == "returned":
        frame = build(1)
        run = lambda: parallel()(delayed(build)(size_mb // 2) for _ in range(2))
    else:
        frame = make(workload, size_mb, folder)
        run = lambda: parallel()(delayed(statistic)(frame, k) for k in range(8))
    parallel()(delayed(statistic)(frame.head(10), k) for k in range(2))  # start the workers
    if SECOND_CALL:
        run()  # the first call, untimed: the second one is measured
    with MemorySampler(os.getpid()) as sampler:
        started = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - started
    if workload == "returned":
        data_bytes = sum(int(f.memory_usage(deep=False).sum()) for f in out)
        out = [len(f) for f in out]
        pickled = None
    else:
        data_bytes = int(frame.memory_usage(deep=workload == "object").sum())  # str objects count too
        if contender == "memshare":
            pickled = memshare.last_call_stats()["bytes_pickled"]
        else:
            pickled = 8 * len(pickle.dumps(frame, protocol=5))
    print(json.dumps({"seconds": seconds, "pickled": pickled, "peak": sampler.peak_extra_bytes,
                      "data": data_bytes, "check": out}))


main()
"""


def run_one(workload: str, contender: str, size_mb: int, task_seconds: float = 0.0, second_call: bool = False) -> Dict:
    env = {
        **os.environ,
        "BUFFERS_BENCH_TASK_SECONDS": str(task_seconds),
        "BUFFERS_BENCH_SECOND_CALL": "1" if second_call else "0",
    }
    with tempfile.TemporaryDirectory(prefix="buffers-bench-") as folder:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, workload, contender, str(size_mb), folder],
            capture_output=True,
            text=True,
            timeout=1800,
            env=env,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
    if done.returncode != 0:
        raise RuntimeError(f"{workload}/{contender} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pickled(runs: List[Dict]) -> str:
    if runs[0]["pickled"] is None:
        return "(results)"
    return _mb(statistics.median(r["pickled"] for r in runs))


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1024**2:,.0f} MB" if nbytes >= 1024**2 else f"{nbytes / 1024:,.0f} KB"


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="data size in MB (default 512)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument(
        "--task-seconds",
        type=float,
        default=0.0,
        help="each task also sleeps this long, so that both workers hold their argument at once (default 0)",
    )
    parser.add_argument(
        "--second-call",
        action="store_true",
        help="time a second call over the same data, the first one untimed (memshare keeps Arrow buffers)",
    )
    args = parser.parse_args(argv)
    results: Dict = {(w, c): [] for w in args.workloads for c in CONTENDERS}
    for repeat in range(args.repeats):
        for workload in args.workloads:
            for contender in CONTENDERS if repeat % 2 == 0 else CONTENDERS[::-1]:
                results[workload, contender].append(
                    run_one(workload, contender, args.size, args.task_seconds, args.second_call)
                )
                print(
                    f"repeat {repeat + 1}: {workload} {contender}: {results[workload, contender][-1]['seconds']:.2f} s",
                    file=sys.stderr,
                )
    print(
        f"\n{TASKS} tasks, 2 workers, --size {args.size}, --task-seconds {args.task_seconds}, "
        f"{'second call, ' if args.second_call else ''}"
        f"{args.repeats} repeats (median [min-max])\n"
    )
    print("| data | contender | time | pickled per call | peak extra memory |")
    print("|---|---|---|---|---|")
    for workload in args.workloads:
        checks = {json.dumps(r["check"]) for c in CONTENDERS for r in results[workload, c]}
        if len(checks) != 1:
            raise AssertionError(f"{workload}: contenders disagree: {checks}")
        for contender in CONTENDERS:
            runs = results[workload, contender]
            times = [r["seconds"] for r in runs]
            peaks = [r["peak"] for r in runs]
            print(
                f"| {workload} ({_mb(runs[0]['data'])}) | {contender} | {statistics.median(times):.2f} s "
                f"[{min(times):.2f}-{max(times):.2f}] | {_pickled(runs)} "
                f"| {_mb(statistics.median(peaks))} [{_mb(min(peaks))}-{_mb(max(peaks))}] |"
            )


if __name__ == "__main__":
    main()
