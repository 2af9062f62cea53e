"""A large CPU torch tensor to every task, and large tensors back: memshare against joblib's loky backend.

Two workloads, two workers, ``--tasks`` tasks:

* ``argument``: one float32 tensor of ``--size-mib`` passed to every task, which sums it (reads it whole);
* ``results``: each task returns a float32 tensor of ``--result-mib`` of its own.

Contenders: ``joblib`` (``joblib.Parallel(backend="loky")``) and ``memshare`` (``memshare.Parallel``).
Each run is a fresh interpreter that imports torch, builds the data, warms the workers up with a tiny
call, then times one call under the memory sampler of ``memshare._tools.benchmarks.memory`` (peak
extra memory of the process tree, shared memory included). Contenders alternate within each repeat,
and the ratio to joblib is taken per repeat, then its median. The machine is printed with the table.

Usage (from the repository root)::

    python -m benchmarks.torch_tensors --size-mib 256 --result-mib 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Dict, List

CONTENDERS = ("joblib", "memshare")
WORKLOADS = ("argument", "results")

_CHILD = r"""
import json, os, sys, time

import torch


def total(tensor):
    return float(tensor.sum())


def make(i, n):
    return torch.full((n,), float(i))


def main():
    contender, workload, mib, tasks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    from memshare._tools.benchmarks.memory import MemorySampler

    if contender == "joblib":
        from joblib import Parallel, delayed

        parallel = Parallel(n_jobs=2, backend="loky")
    else:
        import memshare
        from memshare import Parallel, delayed

        parallel = Parallel(n_jobs=2)
    n = mib * 2**20 // 4
    tensor = torch.ones(n) if workload == "argument" else None
    parallel(delayed(total)(torch.ones(4)) for _ in range(4))  # start the workers
    with MemorySampler(os.getpid()) as sampler:
        started = time.perf_counter()
        if workload == "argument":
            out = parallel(delayed(total)(tensor) for _ in range(tasks))
        else:
            back = parallel(delayed(make)(i, n) for i in range(tasks))
            out = [float(t[-1]) for t in back]
            assert all(type(t) is torch.Tensor for t in back)
        seconds = time.perf_counter() - started
    stats = memshare.last_call_stats() if contender == "memshare" else {}
    print(json.dumps({"seconds": seconds, "peak": sampler.peak_extra_bytes, "check": out, "stats": stats}))


main()
"""


def run_one(contender: str, workload: str, mib: int, tasks: int) -> Dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, contender, workload, str(mib), str(tasks)],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    if done.returncode != 0:
        raise RuntimeError(f"{contender} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> str:
    """The machine and its load, to read the figures by."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPUs ({model}), load average {load}, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="the argument tensor (default 256)")
    parser.add_argument("--result-mib", type=int, default=64, help="each task's result tensor (default 64)")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    args = parser.parse_args(argv)
    print(machine())
    for workload in args.workloads:
        mib = args.size_mib if workload == "argument" else args.result_mib
        data = mib * 2**20 if workload == "argument" else mib * 2**20 * args.tasks
        runs: Dict[str, List[Dict]] = {c: [] for c in CONTENDERS}
        for repeat in range(args.repeats):
            for contender in CONTENDERS if repeat % 2 == 0 else CONTENDERS[::-1]:
                runs[contender].append(run_one(contender, workload, mib, args.tasks))
                print(f"{workload} {repeat + 1}: {contender}: {runs[contender][-1]['seconds']:.2f} s", file=sys.stderr)
        if len({json.dumps(r["check"]) for c in CONTENDERS for r in runs[c]}) != 1:
            raise AssertionError(f"contenders disagree on {workload}")
        ratios = [m["seconds"] / j["seconds"] for m, j in zip(runs["memshare"], runs["joblib"])]
        what = (
            f"one {mib} MiB float32 tensor to {args.tasks} tasks"
            if workload == "argument"
            else f"{args.tasks} tasks each returning a {mib} MiB float32 tensor"
        )
        print(f"\n{what}, 2 workers, {args.repeats} repeats (median [min-max])\n")
        print("| contender | time | time / joblib's (per repeat) | peak extra memory | / data |")
        print("|---|---|---|---|---|")
        for contender in CONTENDERS:
            times = [r["seconds"] for r in runs[contender]]
            peaks = [r["peak"] for r in runs[contender]]
            ratio = (
                f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                if contender == "memshare"
                else "1"
            )
            print(
                f"| {contender} | {statistics.median(times):.2f} s [{min(times):.2f}-{max(times):.2f}] | {ratio} "
                f"| {_mib(statistics.median(peaks))} [{_mib(min(peaks))}-{_mib(max(peaks))}] "
                f"| {statistics.median(peaks) / data:.2f} |"
            )
        stats = runs["memshare"][0]["stats"]
        figures = ("arrays_held_once", "arrays_dumped", "objects_dumped", "results_by_reference")
        print("\nmemshare's figures (first repeat): " + ", ".join(f"{k}={stats.get(k)}" for k in figures))


if __name__ == "__main__":
    main()
